"""Stateless seeds: one well-mixed seed from a tuple of non-negative ints.

Randomness that a resumed run must repeat is derived from its coordinates instead of drawn from a global
RNG: data flips and epoch permutations from (seed, epoch, index), so a resumed run, a run with more
DataLoader workers and an uninterrupted run all see the same data and the training loop's own RNG stream is
never touched by data loading; stochastic-rounding noise from (seed, parameter index, step); the RNG of a
rank that a checkpoint has no state for from (step, rank); sampling noise from (seed, first sample index).

Also here: the global RNGs' states as checkpoint-safe values (rng_state / set_rng_state), and seeding them all.
"""
import random

import numpy as np
import torch


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


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's (CPU and CUDA) global RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def sampling_generator(seed: int, first_index: int) -> torch.Generator:
    """The CPU generator of a sampling batch that starts at global sample index first_index: its noise depends
    only on (seed, first_index), so N processes draw what one process would."""
    return torch.Generator().manual_seed(seed * 1_000_003 + first_index)


def rng_state() -> dict:
    """This process's torch (CPU and current CUDA device), numpy and python RNG states, as tensors and plain
    Python values only, so a checkpoint loads with torch.load(weights_only=True) (no code runs on load)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, py_gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
             "python": [version, torch.tensor(internal, dtype=torch.int64), py_gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's current device
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, py_gauss = state["python"]
    random.setstate((version, tuple(int(v) for v in internal.tolist()), py_gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def seed_from_coordinates(step: int, rank: int) -> None:
    """Seed every global RNG from (step, rank): a rank that a checkpoint has no state for (resumed at a larger
    world size) still draws deterministically."""
    seed = mix_seed(step, rank) % 2**32  # np.random.seed takes at most 32 bits
    torch.manual_seed(seed)  # seeds CUDA too
    np.random.seed(seed)
    random.seed(seed)

