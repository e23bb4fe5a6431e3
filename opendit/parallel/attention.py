"""Sequence-parallel attention: a hook object for `opendit.models.layers.Attention.sequence_parallel`.

Between attention layers each of the P ranks of `group` holds a contiguous chunk of n = ceil(N/P) tokens of
every sample; the rest of a block (adaLN, MLP, residuals) is per token and runs on the chunk unchanged.

  FastSeq  x [B, n, D] --ring all-gather, overlapped with qkv of this rank's H/P heads--> qkv [B, nP, 3, H/P, Dh]
           --attention over the whole sequence--> [B, H/P, nP, Dh] --all-to-all--> [B, H, n, Dh] --proj-->
  Ulysses  x [B, n, D] --qkv (all heads)--> [B, n, 3, H, Dh] --all-to-all--> [B, nP, 3, H/P, Dh]
           --attention--> [B, H/P, nP, Dh] --all-to-all--> [B, H, n, Dh] --proj-->

Padding: `split` pads N up to nP with zeros and remembers N; attention then drops the padded keys/values
(k, v[:, :, :N]), which masks them exactly and keeps flash attention usable (it takes no mask). Padded
queries give finite values that `gather` cuts off, so they receive no gradient.
"""
import torch.distributed as dist
import torch.nn.functional as F

from opendit.kernels.attention import attention
from opendit.parallel.comm import all_to_all, gather_seq
from opendit.parallel.plan import KINDS, default_sp_kind, padded_len
from opendit.parallel.ring import ring_gather_linear


class SequenceParallel:
    """One per model, shared by its Attention modules. kind: "fastseq", "ulysses" or "auto" (by group size).

    `counter` (a CommCounter, optional) tallies the bytes each collective sends. Usage in a model's forward:
    tokens = sp.split(tokens) after embedding; blocks; out = sp.gather(out) before unpatchify.
    """

    def __init__(self, group, kind: str = "auto", counter=None):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.kind = default_sp_kind(self.size) if kind == "auto" else kind
        if self.kind not in KINDS:
            raise ValueError(f"sequence parallel type {kind!r} is unknown; choose one of {KINDS + ('auto',)}")
        self.counter = counter
        self.seq_len = None  # the unpadded length of the sequence being processed, set by split()

    def __deepcopy__(self, memo):
        # Process groups cannot be copied; a copy of the model (e.g. an EMA) shares this group and hook.
        return self

    def __repr__(self):
        return f"SequenceParallel(kind={self.kind!r}, size={self.size}, rank={self.rank})"

    # -------------------------------------------------------------------------------- model boundaries
    def split(self, tokens, dim: int = 1):
        """tokens [B, N, D], the same on every rank of the group -> this rank's chunk [B, ceil(N/P), D].

        The backward is local (this chunk's gradient, zeros elsewhere): see `gather` for why that is exact.
        """
        N = tokens.shape[dim]
        self.seq_len = N
        pad = padded_len(N, self.size) - N
        if pad:
            pads = [0, 0] * (tokens.dim() - 1 - dim % tokens.dim()) + [0, pad]
            tokens = F.pad(tokens, pads)
        return tokens.chunk(self.size, dim=dim)[self.rank]

    def gather(self, x, dim: int = 1):
        """This rank's chunk [B, n, C] -> the whole sequence [B, N, C] on every rank (padding removed).

        Backward: reduce-scatter, the adjoint of the all-gather. Every rank computes the same loss from the
        gathered output, so rank r's weight gradient is P times its chunk's share and the MEAN over the group
        equals the unsplit gradient -- the mean that the DP x SP gradient reduction takes anyway.
        """
        out = gather_seq(x, self.group, dim=dim, counter=self.counter, site="boundary")
        if self.seq_len is not None and self.seq_len < out.shape[dim]:
            out = out.narrow(dim, 0, self.seq_len)
        return out

    # ------------------------------------------------------------------------------------- attention
    def __call__(self, attn, x):
        """attn: an Attention module (weights replicated on every rank); x [B, n, D] -> [B, n, D]."""
        if attn.num_heads % self.size:
            raise ValueError(f"{attn.num_heads} attention heads cannot be split over a sequence-parallel group "
                             f"of {self.size}; choose a group size that divides the head count")
        out = self._fastseq(attn, x) if self.kind == "fastseq" else self._ulysses(attn, x)  # [B, H/P, nP, Dh]
        # Back to sequence-split, all heads: rank i receives its own tokens from every rank, in head order.
        out = all_to_all(out, self.group, scatter_dim=2, gather_dim=1, counter=self.counter, site=self.kind)
        B, n, D = x.shape
        return attn.proj(out.transpose(1, 2).reshape(B, n, D))

    def _fastseq(self, attn, x):
        B, n, D = x.shape
        H, Dh = attn.num_heads, attn.head_dim
        h = H // self.size
        heads = slice(self.rank * h, (self.rank + 1) * h)
        # The rows of qkv.weight are laid out (3, H, Dh): this rank's heads are a view of each of q, k, v.
        w = attn.qkv.weight.view(3, H, Dh, D)[:, heads].reshape(3 * h * Dh, D)
        b = None if attn.qkv.bias is None else attn.qkv.bias.view(3, H, Dh)[:, heads].reshape(-1)
        qkv = ring_gather_linear(x, w, b, self.group, counter=self.counter, site="fastseq")  # [B, nP, 3hDh]
        qkv = qkv.view(B, n * self.size, 3, h, Dh).permute(2, 0, 3, 1, 4)  # [3, B, h, nP, Dh]
        return self._attend(attn, qkv)

    def _ulysses(self, attn, x):
        B, n, D = x.shape
        H, Dh = attn.num_heads, attn.head_dim
        qkv = attn.qkv(x).view(B, n, 3, H, Dh)
        qkv = all_to_all(qkv, self.group, scatter_dim=3, gather_dim=1, counter=self.counter,
                         site="ulysses")  # [B, nP, 3, H/P, Dh]
        return self._attend(attn, qkv.permute(2, 0, 3, 1, 4))

    def _attend(self, attn, qkv):
        """qkv [3, B, h, nP, Dh] over the padded sequence -> [B, h, nP, Dh], padded keys excluded."""
        q, k, v = qkv[0], qkv[1], qkv[2]
        full = q.shape[2]
        N = full if self.seq_len is None else self.seq_len
        if padded_len(N, self.size) != full:
            raise RuntimeError(f"the gathered sequence has {full} tokens but split() last saw {N}; call "
                               f"sp.split(tokens) on every forward before the attention layers")
        if N < full:
            k, v = k[:, :, :N], v[:, :, :N]
        return attention(q, k, v, backend=attn.attn_backend)
