"""Sequence-parallel attention: the two stages an attention layer calls when its tokens are split over ranks.

Between attention layers each of the P ranks of `group` holds a contiguous chunk of n = ceil(N/P) tokens of
every sample; the rest of a block (adaLN, MLP, residuals) is per token and runs on the chunk unchanged. An
attention layer cuts itself in two around a "head-parallel" middle layout, q, k, v [B, H/P, nP, Dh]: this
rank's heads over the WHOLE padded sequence. Per-head, per-token ops (q/k RMSNorm, RoPE) run there unchanged.

  to_heads FastSeq x [B, n, D] --ring all-gather, hidden behind qkv of this rank's H/P heads--> [3, B, H/P, nP, Dh]
           Ulysses x [B, n, D] --qkv (all heads)--> [B, n, 3, H, Dh] --all-to-all--> [3, B, H/P, nP, Dh]
  attend   both    q, k, v [B, H/P, nP, Dh] --attention--> [B, H/P, nP, Dh] --all-to-all--> [B, H, n, Dh]

Joint sequences (FLUX: text + image, each stream with its own qkv): split and to_heads each stream, concatenate
the head-parallel tensors along the sequence ([txt padded, img padded]) and pass attend the unpadded segment
lengths; it returns the local [txt chunk, img chunk]. See docs/sequence_parallel.md for a sketch.

Padding: `split` pads N up to nP with zeros; attend drops every segment's padded keys/values (k, v[:, :, :N]
for one segment), which masks them exactly and keeps flash attention usable (it takes no mask). Padded
queries give finite values that `gather` cuts off, so they receive no gradient.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from opendit.kernels.attention import attention
from opendit.parallel.comm import all_to_all, gather_seq, pad_dim
from opendit.parallel.plan import HEAD_KINDS, default_sp_kind, padded_len
from opendit.parallel.ring import ring_gather_linear


def _real_tokens(t, seq_lens, padded):
    """t [B, h, sum(padded), Dh] -> [B, h, sum(seq_lens), Dh]: each segment without its padding (one segment:
    the view t[:, :, :N], no copy)."""
    starts = [sum(padded[:i]) for i in range(len(padded))]
    segs = [t[:, :, s:s + N] for s, N in zip(starts, seq_lens)]
    return segs[0] if len(segs) == 1 else torch.cat(segs, dim=2)


class SequenceParallel:
    """One per model, shared by its attention layers. kind: "fastseq", "ulysses" or "auto" (by group size).

    `counter` (a CommCounter, optional) tallies the bytes each collective sends. Usage in a model's forward:
    tokens = sp.split(tokens) after embedding; in each attention layer to_heads, then attend; out =
    sp.gather(out) before unpatchify.
    """

    def __init__(self, group, kind: str = "auto", counter=None):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.kind = default_sp_kind(self.size) if kind == "auto" else kind
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"sequence parallel type {kind!r} does not apply to a model that splits one token "
                             f"sequence; choose one of {HEAD_KINDS + ('auto',)} (DSP: a spatial-temporal model "
                             f"such as Latte, opendit.parallel.DynamicSequenceParallel)")
        self.counter = counter
        self.seq_len = None  # the unpadded length of the last sequence split(), the default of attend/gather
        # A joint sequence's unpadded segment lengths (FLUX: (L_txt, L_img)), set by the model's forward for its
        # attention layers; a checkpointed block's recompute reads them again during that forward's backward.
        self.seq_lens = None

    def __deepcopy__(self, memo):
        # Process groups cannot be copied; a copy of the model (e.g. an EMA) shares this group and hook.
        return self

    def __repr__(self):
        return f"SequenceParallel(kind={self.kind!r}, size={self.size}, rank={self.rank})"

    # -------------------------------------------------------------------------------- model boundaries
    def split(self, tokens, dim: int = 1):
        """tokens [B, N, D], the same on every rank of the group -> this rank's chunk [B, ceil(N/P), D].

        Remembers N as the default length of attend() and gather() (a model with several streams passes
        their lengths explicitly). The backward is local (this chunk's gradient, zeros elsewhere): see
        `gather` for why that is exact.
        """
        N = tokens.shape[dim]
        self.seq_len = N
        return pad_dim(tokens, padded_len(N, self.size), dim).chunk(self.size, dim=dim)[self.rank]

    def pad_full(self, t, seq_lens=None, dim: int = 1):
        """A full-sequence tensor (e.g. RoPE cos/sin [N, Dh/2]) -> the head-parallel layout's padded sequence.

        t holds the segments of lengths seq_lens (default: one segment, all of dim `dim`) one after the other;
        each is zero-padded to a multiple of P, as split() pads its stream: [N_txt + N_img, ...] ->
        [pad(N_txt) + pad(N_img), ...]. Padded tokens only meet padded queries and dropped keys.
        """
        seq_lens = [t.shape[dim]] if seq_lens is None else list(seq_lens)
        if sum(seq_lens) != t.shape[dim]:
            raise ValueError(f"pad_full: dim {dim} of shape {tuple(t.shape)} does not hold the segments "
                             f"{seq_lens}; pass the unpadded lengths of the streams t concatenates")
        segs = t.split(seq_lens, dim=dim)
        return torch.cat([pad_dim(s, padded_len(N, self.size), dim) for s, N in zip(segs, seq_lens)], dim=dim)

    def gather(self, x, dim: int = 1, seq_len=None):
        """This rank's chunk [B, n, C] -> the whole sequence [B, N, C] on every rank (padding removed).

        seq_len: the stream's unpadded N (default: the last split()'s). Backward: reduce-scatter, the adjoint
        of the all-gather. Every rank computes the same loss from the gathered output, so rank r's weight
        gradient is P times its chunk's share and the MEAN over the group equals the unsplit gradient -- the
        mean that the DP x SP gradient reduction takes anyway.
        """
        N = self.seq_len if seq_len is None else seq_len
        full = x.shape[dim] * self.size
        if N is not None and padded_len(N, self.size) != full:
            raise ValueError(f"gather: {x.shape[dim]} tokens per rank hold a padded sequence of {full}, not one "
                             f"of {N} tokens; pass gather(..., seq_len=N) with this stream's unpadded length")
        out = gather_seq(x, self.group, dim=dim, counter=self.counter, site="boundary")
        return out if N is None or N == full else out.narrow(dim, 0, N)

    # ------------------------------------------------------------------------------------- attention
    def to_heads(self, x, weight, bias, num_heads: int):
        """Stage 1: this rank's chunk x [B, n, D] -> qkv [3, B, H/P, nP, Dh], this rank's heads, all tokens.

        weight [3*H*Dh, D], bias [3*H*Dh] or None: a fused qkv Linear whose rows are laid out (3, H, Dh)
        (DiT's and FLUX's). FastSeq projects only this rank's head rows, hidden behind the ring all-gather of
        x; Ulysses projects every head locally and all-to-alls from sequence-split to head-split.
        """
        P = self.size
        if num_heads % P:
            raise ValueError(f"{num_heads} attention heads cannot be split over a sequence-parallel group "
                             f"of {P}; choose a group size that divides the head count")
        if weight.shape[0] % (3 * num_heads):
            raise ValueError(f"to_heads: qkv weight of shape {tuple(weight.shape)} has no (3, {num_heads}, Dh) "
                             f"row layout; pass the fused q, k, v projection of {num_heads} heads")
        B, n, D = x.shape
        H, Dh, h = num_heads, weight.shape[0] // (3 * num_heads), num_heads // P
        if self.kind == "fastseq":
            heads = slice(self.rank * h, (self.rank + 1) * h)
            # The rows are laid out (3, H, Dh): this rank's heads are a slice of each of q, k, v.
            w = weight.view(3, H, Dh, D)[:, heads].reshape(3 * h * Dh, D)
            b = None if bias is None else bias.view(3, H, Dh)[:, heads].reshape(-1)
            qkv = ring_gather_linear(x, w, b, self.group, counter=self.counter, site="fastseq")  # [B, nP, 3hDh]
            qkv = qkv.view(B, n * P, 3, h, Dh)
        else:
            qkv = F.linear(x, weight, bias).view(B, n, 3, H, Dh)
            qkv = all_to_all(qkv, self.group, scatter_dim=3, gather_dim=1, counter=self.counter,
                             site="ulysses")  # [B, nP, 3, H/P, Dh]
        return qkv.permute(2, 0, 3, 1, 4)

    def attend(self, q, k, v, backend: str = "sdpa", seq_lens=None):
        """Stage 2: q, k, v [B, H/P, L, Dh] over the padded sequence -> this rank's tokens [B, H, n, Dh].

        seq_lens: the unpadded lengths of the segments q/k/v concatenate, each padded to a multiple of P
        (L = sum of the padded lengths); default one segment of the last split()'s length. Attention runs over
        every segment's real keys, then one all-to-all returns this rank's chunk of each segment, all heads,
        in segment order: [B, H, n_0 + n_1 + ..., Dh].
        """
        P, L = self.size, q.shape[2]
        seq_lens = [L if self.seq_len is None else self.seq_len] if seq_lens is None else list(seq_lens)
        padded = [padded_len(N, P) for N in seq_lens]
        if sum(padded) != L:
            raise ValueError(f"attend: q has {L} tokens but the segments {seq_lens} pad to {padded} (sum "
                             f"{sum(padded)}); call sp.split on every stream each forward and pass attend its "
                             f"unpadded lengths, in the order the head-parallel tensors were concatenated")
        if padded != seq_lens:
            k, v = _real_tokens(k, seq_lens, padded), _real_tokens(v, seq_lens, padded)
        out = attention(q, k, v, backend=backend)  # [B, H/P, L, Dh]
        if len(padded) > 1:
            # Rank-major order [chunk r of segment 0, chunk r of segment 1, ...] for r = 0..P-1, so that the
            # all-to-all's block r is rank r's tokens: [B, h, L, Dh] -> [B, h, P, n_0 + n_1 + ..., Dh] -> flat.
            segs = [s.unflatten(2, (P, -1)) for s in out.split(padded, dim=2)]
            out = torch.cat(segs, dim=3).flatten(2, 3)
        # Back to sequence-split, all heads: rank i receives its own tokens from every rank, in head order.
        return all_to_all(out, self.group, scatter_dim=2, gather_dim=1, counter=self.counter, site=self.kind)
