"""Stateless seeds: one well-mixed seed from a tuple of non-negative ints.

Randomness that a resumed run must repeat is derived from its coordinates instead of drawn from a global
RNG: data flips and epoch permutations from (seed, epoch, index), so a resumed run, a run with more
DataLoader workers and an uninterrupted run all see the same data and the training loop's own RNG stream is
never touched by data loading; stochastic-rounding noise from (seed, parameter index, step); the RNG of a
rank that a checkpoint has no state for from (step, rank).
"""
import numpy as np


def mix_seed(*values: int) -> int:
    """Hash non-negative ints into one well-mixed 63-bit seed (fits torch.Generator.manual_seed).

    SeedSequence spreads entropy over all output bits, so (seed=0, epoch=1) and (seed=1, epoch=0)
    give unrelated streams, unlike the common `seed + epoch`; and unlike Python's hash() its output is
    fixed by its algorithm, not by the interpreter version.
    """
    for v in values:
        if int(v) < 0:
            raise ValueError(f"mix_seed takes non-negative ints, got {values}; pass seeds >= 0")
    state = np.random.SeedSequence([int(v) for v in values]).generate_state(1, dtype=np.uint64)
    return int(state[0] >> np.uint64(1))
