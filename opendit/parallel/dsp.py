"""Dynamic Sequence Parallelism (DSP, Zhao et al. 2024) for spatial-temporal transformers such as Latte.

Such a model alternates spatial blocks (attention within one frame over its S positions) and temporal blocks
(attention across the T' frames at one position). DSP never splits a sequence that attention needs whole:

  spatial blocks   this rank's frames, all positions   [B, T'/P, S, D]    no communication
  before temporal  all-to-all: split positions instead  -> [B, T', S/P, D] (every frame of S/P positions)
  after temporal   all-to-all back                      -> [B, T'/P, S, D]
  model end        all-gather of the output frames      -> [B, T', S, C]

so each temporal block costs two all-to-alls of its activation, (P-1)/P^2 of B T' S D e each (plan.py), and
every rank runs every head (no head-count constraint).

Padding: T' and S are zero-padded to multiples of P. Spatial attention is per frame, so a padded frame only
produces values for itself, cut by the final gather; the temporal layout keeps only the T' real frames
(`to_positions` drops the padded ones, `to_frames` pads them back with zeros), so temporal attention never
sees a padded frame. Padded positions are per-position work in the temporal layout and are cut by
`to_frames`. No value of a padded frame or position reaches a real token, so no gradient flows through one.

Every op is differentiable: the all-to-all's backward is the reverse all-to-all, the gather's a
reduce-scatter, the frame split keeps this rank's gradient. As with FastSeq / Ulysses, every rank computes the
same loss from the gathered output and the MEAN of the group's weight gradients is the unsplit gradient.
"""
import torch.distributed as dist

from opendit.parallel.comm import all_to_all, gather_seq, pad_dim
from opendit.parallel.plan import padded_len


class DynamicSequenceParallel:
    """The DSP hook a spatial-temporal model keeps while its frames are split over `group`.

    Usage in the model's forward, on tokens laid out [B, frames, positions, D]:
    frames = dsp.split_frames(x) before embedding; spatial blocks on [B * T'/P, S, D];
    x = dsp.to_positions(x) -> temporal block on [B * S/P, T', D] -> x = dsp.to_frames(x);
    out = dsp.gather_frames(out) before unpatchify. `counter` (a CommCounter) tallies the bytes under "dsp"
    (the switches) and "boundary" (the gather).
    """

    kind = "dsp"

    def __init__(self, group, counter=None):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.counter = counter
        self.num_frames = None  # T' of the last split_frames(): the real frames of this forward
        self.num_positions = None  # S of the last to_positions()

    def __deepcopy__(self, memo):
        # Process groups cannot be copied; a copy of the model (e.g. an EMA) shares this group and hook.
        return self

    def __repr__(self):
        return f"DynamicSequenceParallel(size={self.size}, rank={self.rank})"

    def split_frames(self, x, dim: int = 1):
        """x with T' frames along `dim`, the same on every rank -> this rank's ceil(T'/P) of them (zero frames
        pad the last ranks). Remembers T'. The backward keeps this chunk's gradient (zeros elsewhere)."""
        T = x.shape[dim]
        self.num_frames = T
        return pad_dim(x, padded_len(T, self.size), dim).chunk(self.size, dim=dim)[self.rank]

    def to_positions(self, x):
        """[B, T'/P (padded), S, D] this rank's frames -> [B, T', ceil(S/P), D]: every REAL frame of this rank's
        positions (S zero-padded to a multiple of P first; the padded frames are dropped after the exchange, so
        temporal attention never sees them)."""
        self._check_frames(x, 1, "to_positions")
        S = x.shape[2]
        self.num_positions = S
        x = pad_dim(x, padded_len(S, self.size), 2)
        x = all_to_all(x, self.group, scatter_dim=2, gather_dim=1, counter=self.counter, site="dsp")
        return x[:, :self.num_frames]

    def to_frames(self, x):
        """[B, T', ceil(S/P), D] -> [B, T'/P (padded), S, D]: back to this rank's frames, all real positions."""
        T, S = self.num_frames, self.num_positions
        if x.shape[1] != T:
            raise ValueError(f"to_frames: x of shape {tuple(x.shape)} holds {x.shape[1]} frames, not the {T} real "
                             f"frames of this forward; pass what to_positions returned, in the same layout")
        x = pad_dim(x, padded_len(T, self.size), 1)  # zero frames: they only meet themselves until the gather
        x = all_to_all(x, self.group, scatter_dim=1, gather_dim=2, counter=self.counter, site="dsp")
        return x[:, :, :S]

    def gather_frames(self, x, dim: int = 1):
        """This rank's frames [B, T'/P, ...] -> all T' real frames [B, T', ...] on every rank. Backward: the
        reduce-scatter (see the module doc for why the group's mean gradient is the unsplit one)."""
        self._check_frames(x, dim, "gather_frames")
        out = gather_seq(x, self.group, dim=dim, counter=self.counter, site="boundary")
        return out.narrow(dim, 0, self.num_frames)

    def _check_frames(self, x, dim, where):
        T = self.num_frames
        if T is None or x.shape[dim] * self.size != padded_len(T, self.size):
            raise ValueError(f"{where}: dim {dim} of shape {tuple(x.shape)} is not this rank's share of the "
                             f"{T} frames split_frames() saw; call split_frames on the input first")
