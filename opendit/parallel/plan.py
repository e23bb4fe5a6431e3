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
"""
KINDS = ("fastseq", "ulysses")


def default_sp_kind(sp_size: int) -> str:
    """The method with the smaller communication volume at this group size (see the module doc)."""
    return "fastseq" if sp_size <= 2 else "ulysses"


def padded_len(seq_len: int, sp_size: int) -> int:
    """The sequence length rounded up to a multiple of sp_size (the extra tokens are masked out of attention)."""
    return -(-seq_len // sp_size) * sp_size


def comm_bytes_per_layer(kind: str, sp_size: int, seq_len, hidden: int, batch: int = 1,
                         elem_bytes: int = 4, backward: bool = True) -> int:
    """Analytic bytes one rank sends for one attention layer (forward, plus backward when asked).

    seq_len: N, or the lengths of a joint sequence's streams ([N_txt, N_img]), each padded separately.
    """
    lens = [seq_len] if isinstance(seq_len, int) else list(seq_len)
    P, N, D = sp_size, sum(padded_len(n, sp_size) for n in lens), hidden
    if kind == "fastseq":  # both terms divide exactly: N is a multiple of P, D of the head count's P
        fwd = (P - 1) * (batch * N * D) // P + (P - 1) * (batch * N * D) // (P * P)
    elif kind == "ulysses":
        fwd = 4 * (P - 1) * (batch * N * D) // (P * P)
    else:
        raise ValueError(f"sequence parallel type {kind!r} is unknown; choose one of {KINDS}")
    return fwd * elem_bytes * (2 if backward else 1)


def validate_sp(world_size: int, sp_size: int, kind: str, num_heads: int) -> str:
    """Check a sequence-parallel setup before any work starts; returns the method to use.

    kind: "fastseq", "ulysses" or "auto" (the default for sp_size, see default_sp_kind). sp_size 1 means off.
    """
    if not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"--sequence_parallel_size must be a positive integer; got {sp_size!r}")
    if kind not in KINDS + ("auto",):
        raise ValueError(f"--sequence_parallel_type {kind!r} is unknown; choose one of {KINDS + ('auto',)}")
    if world_size % sp_size:
        raise ValueError(f"--sequence_parallel_size {sp_size} does not divide the world size {world_size}; "
                         f"launch a multiple of {sp_size} processes or pick a divisor of {world_size}")
    if num_heads % sp_size:
        divisors = [p for p in range(1, num_heads + 1) if num_heads % p == 0 and world_size % p == 0]
        raise ValueError(f"--sequence_parallel_size {sp_size} does not divide the model's {num_heads} attention "
                         f"heads (both FastSeq and Ulysses give each rank whole heads); use one of {divisors}")
    return default_sp_kind(sp_size) if kind == "auto" else kind
