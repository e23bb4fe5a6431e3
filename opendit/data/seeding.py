"""Stateless seeds for data randomness.

Flips and epoch permutations are derived from (seed, epoch, index) rather than drawn from a global
RNG, so a resumed run, a run with more DataLoader workers and an uninterrupted run all see the same
data, and the training loop's own RNG stream is never touched by data loading.
"""
import numpy as np


def mix_seed(*values: int) -> int:
    """Hash non-negative ints into one well-mixed 63-bit seed (fits torch.Generator.manual_seed).

    SeedSequence spreads entropy over all output bits, so (seed=0, epoch=1) and (seed=1, epoch=0)
    give unrelated streams, unlike the common `seed + epoch`.
    """
    for v in values:
        if int(v) < 0:
            raise ValueError(f"mix_seed takes non-negative ints, got {values}; pass seeds >= 0")
    state = np.random.SeedSequence([int(v) for v in values]).generate_state(1, dtype=np.uint64)
    return int(state[0] >> np.uint64(1))
