"""Choosing and checking a sequence-parallel setup, and the analytic communication volume of each method.

Bytes sent per attention layer per rank, forward (the backward sends the same again), for a sequence of N
tokens (padded to a multiple of P; a joint sequence: the sum of its streams' padded lengths) of width D = H*Dh,
batch B, e bytes per element, over P ranks:

  FastSeq: all-gather of the block input   (P-1)/P   * B N D e
           all-to-all of the attention out  (P-1)/P^2 * B N D e       total (P-1)(P+1)/P^2 * B N D e
  Ulysses: all-to-all of q, k, v          3 (P-1)/P^2 * B N D e
           all-to-all of the attention out  (P-1)/P^2 * B N D e       total 4 (P-1)/P^2     * B N D e

FastSeq sends less only while P + 1 < 4, i.e. at P = 2 (3/4 vs 1 B N D e); they tie at P = 3 and Ulysses
wins from P = 4 on (15/16 vs 3/4 at P = 4, 63/64 vs 7/16 at P = 8). FastSeq's gather is hidden behind the
qkv projection, so at P = 2 it has both the smaller volume and the overlap: the default is FastSeq at P = 2
and Ulysses otherwise (at the P = 3 tie, Ulysses' single collective needs fewer steps than the P-1 ring hops).

DSP (Dynamic Sequence Parallelism, for spatial-temporal models such as Latte, whose attention runs either
within a frame or across frames at one spatial position): spatial blocks run on this rank's T'/P frames with
no communication; one all-to-all before each temporal block switches to S/P positions with all frames, one
after switches back. With T' frames and S positions each padded to a multiple of P:

  DSP:     two all-to-alls of the block activation, per TEMPORAL block   2 (P-1)/P^2 * B T' S D e
           spatial blocks                                                0

Per pair of blocks (spatial + temporal, N = T' S tokens) that is 2 (P-1)/P^2 B N D e, against 8 (P-1)/P^2
for Ulysses on the same two attention layers (4x less) and 2 (P-1)(P+1)/P^2 for FastSeq. DSP also needs no
head divisibility: every rank runs every head.

Model boundaries add one all-gather of the final layer's output (backward: its reduce-scatter), (P-1) times
this rank's chunk: `gather_comm_bytes`.
"""
HEAD_KINDS = ("fastseq", "ulysses")  # split one token sequence; each rank attends with H/P whole heads
KINDS = HEAD_KINDS + ("dsp",)


def default_sp_kind(sp_size: int, kinds=HEAD_KINDS) -> str:
    """What "auto" means for a model that supports `kinds`: DSP where the model supports it (it sends the
    least, see the module doc), else FastSeq at P <= 2 and Ulysses above."""
    by_size = "fastseq" if sp_size <= 2 else "ulysses"
    if "dsp" in kinds:
        return "dsp"
    return by_size if by_size in kinds else kinds[0]


def padded_len(seq_len: int, sp_size: int) -> int:
    """The sequence length rounded up to a multiple of sp_size (the extra tokens are masked out of attention)."""
    return -(-seq_len // sp_size) * sp_size


def comm_bytes_per_layer(kind: str, sp_size: int, seq_len, hidden: int, batch: int = 1,
                         elem_bytes: int = 4, backward: bool = True) -> int:
    """Analytic bytes one rank sends for one attention layer (forward, plus backward when asked).

    seq_len: N, or the lengths of a joint sequence's streams ([N_txt, N_img]), each padded separately.
    DSP's volume depends on the frame and position counts: dsp_comm_bytes_per_block.
    """
    lens = [seq_len] if isinstance(seq_len, int) else list(seq_len)
    P, N, D = sp_size, sum(padded_len(n, sp_size) for n in lens), hidden
    if kind == "fastseq":  # both terms divide exactly: N is a multiple of P, D of the head count's P
        fwd = (P - 1) * (batch * N * D) // P + (P - 1) * (batch * N * D) // (P * P)
    elif kind == "ulysses":
        fwd = 4 * (P - 1) * (batch * N * D) // (P * P)
    elif kind == "dsp":
        raise ValueError("DSP sends nothing inside an attention layer; its volume per temporal block is "
                         "dsp_comm_bytes_per_block(sp_size, frames, positions, hidden)")
    else:
        raise ValueError(f"sequence parallel type {kind!r} is unknown; choose one of {HEAD_KINDS}")
    return fwd * elem_bytes * (2 if backward else 1)


def dsp_comm_bytes_per_block(sp_size: int, frames: int, positions: int, hidden: int, batch: int = 1,
                             elem_bytes: int = 4, backward: bool = True) -> int:
    """Analytic bytes one rank sends for one DSP temporal block: the all-to-all into the position split and
    the one back, each (P-1)/P of this rank's [B, T'/P, S, D] (frames and positions padded to multiples of P).
    Spatial blocks send nothing."""
    P = sp_size
    elems = batch * padded_len(frames, P) * padded_len(positions, P) * hidden  # divisible by P^2
    return 2 * (P - 1) * elems // (P * P) * elem_bytes * (2 if backward else 1)


def gather_comm_bytes(sp_size: int, seq_len: int, width: int, batch: int = 1, elem_bytes: int = 4,
                      backward: bool = True) -> int:
    """Analytic bytes one rank sends for the output gather at the model's end: (P-1) x this rank's chunk
    [B, ceil(N/P), width] (DSP gathers frames: N = T', width = S x the per-token output)."""
    P = sp_size
    return (P - 1) * batch * (padded_len(seq_len, P) // P) * width * elem_bytes * (2 if backward else 1)


def validate_sp(world_size: int, sp_size: int, kind: str, num_heads: int, kinds=HEAD_KINDS) -> str:
    """Check a sequence-parallel setup before any work starts; returns the method to use.

    kind: one of `kinds` (the methods the model supports: ("fastseq", "ulysses") for DiT and VDiT, ("dsp",)
    for Latte; a model class names them in its `parallel_plan`) or "auto" (default_sp_kind). sp_size 1 means off.
    """
    if not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"--sequence_parallel_size must be a positive integer; got {sp_size!r}")
    if kind not in KINDS + ("auto",):
        raise ValueError(f"--sequence_parallel_type {kind!r} is unknown; choose one of {KINDS + ('auto',)}")
    if kind not in tuple(kinds) + ("auto",):
        raise ValueError(f"--sequence_parallel_type {kind} does not apply to this model; it supports "
                         f"{tuple(kinds) + ('auto',)}")
    if world_size % sp_size:
        raise ValueError(f"--sequence_parallel_size {sp_size} does not divide the world size {world_size}; "
                         f"launch a multiple of {sp_size} processes or pick a divisor of {world_size}")
    if not kinds:  # the model's sequence cannot be split
        if sp_size > 1:
            raise ValueError(f"--sequence_parallel_size {sp_size}: this model implements no sequence parallelism; "
                             f"use 1 (the default)")
        return kind
    kind = default_sp_kind(sp_size, tuple(kinds)) if kind == "auto" else kind
    if kind in HEAD_KINDS and num_heads % sp_size:
        divisors = [p for p in range(1, num_heads + 1) if num_heads % p == 0 and world_size % p == 0]
        raise ValueError(f"--sequence_parallel_size {sp_size} does not divide the model's {num_heads} attention "
                         f"heads (both FastSeq and Ulysses give each rank whole heads); use one of {divisors}")
    return kind
