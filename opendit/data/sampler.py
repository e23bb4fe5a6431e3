"""A distributed sampler that shards by data-parallel rank and resumes mid-epoch, at any DP size.

Layout. An epoch is one permutation `perm` of the dataset, from (seed, epoch). It is cut into global
batches of G = global_batch_size samples; global batch k is perm[k*G : (k+1)*G]. Data-parallel rank
r of D takes the contiguous slice [k*G + r*b, k*G + (r+1)*b) of it, with b = G / D:

    perm:    | g0: r0 r0 r1 r1 | g1: r0 r0 r1 r1 | ...      (G = 4, D = 2, b = 2)

So the set of samples in global batch k does not depend on D, and the position in an epoch is one
number every rank agrees on: `consumed`, the count of *global* samples already trained on. A
checkpoint written at D ranks therefore resumes at D' ranks with the same global batches, as long as
G is unchanged (a different G also resumes, from the same sample position).

Ranks are DP ranks, not world ranks: all ranks of one sequence-parallel group pass the same DP rank
and get the same indices.

Counting. DataLoader workers prefetch ahead, so the sampler cannot tell which batches were really
trained on; the training loop calls `advance()` once per batch it consumed (before checkpointing).
"""
import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from opendit.seeding import mix_seed


class ResumableDistributedSampler(Sampler[int]):
    def __init__(self, dataset_len: int, num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True, global_batch_size: int | None = None):
        if dataset_len <= 0:
            raise ValueError(f"dataset_len must be positive, got {dataset_len}; the dataset is empty")
        if num_replicas <= 0 or not 0 <= rank < num_replicas:
            raise ValueError(f"need 0 <= rank < num_replicas, got rank={rank}, num_replicas={num_replicas}")
        # default: one sample per rank per global batch (DistributedSampler's interleaved layout)
        global_batch_size = num_replicas if global_batch_size is None else global_batch_size
        if global_batch_size <= 0 or global_batch_size % num_replicas != 0:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by the data-parallel size "
                f"{num_replicas}; pick a global batch that is a multiple of {num_replicas}")
        if drop_last and dataset_len < global_batch_size:
            raise ValueError(
                f"the dataset has {dataset_len} samples, fewer than one global batch of {global_batch_size}, "
                f"so an epoch would be empty; lower the global batch size or set drop_last=False")
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // num_replicas
        self.epoch = 0
        self.consumed = 0  # global samples of this epoch already trained on (same on every rank)

    # ---- epoch and position -------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Move to `epoch`. Setting the current epoch again keeps the position, so the usual
        `for epoch in range(start_epoch, ...): sampler.set_epoch(epoch)` works after a resume."""
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self.consumed = 0

    def advance(self, num_batches: int = 1) -> None:
        """Record that `num_batches` batches (each one global batch across the DP ranks) were used."""
        self.consumed = min(self.consumed + num_batches * self.global_batch_size, self.epoch_samples())

    def epoch_samples(self, start: int | None = None) -> int:
        """Global position at which this epoch ends, when iteration starts at `start` (default: now).

        drop_last drops a final partial global batch; otherwise it is padded by wrapping around
        the permutation, so every rank gets full batches."""
        start = self.consumed if start is None else start
        remaining = max(self.dataset_len - start, 0)
        rounding = math.floor if self.drop_last else math.ceil
        return start + rounding(remaining / self.global_batch_size) * self.global_batch_size

    @property
    def epoch_finished(self) -> bool:
        return self.consumed >= self.epoch_samples()

    # ---- iteration ----------------------------------------------------------------------------
    def permutation(self, epoch: int | None = None) -> torch.Tensor:
        """The epoch's global order: int64 [dataset_len], identical on every rank."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
        return torch.randperm(self.dataset_len, generator=generator)

    def _rank_indices(self) -> torch.Tensor:
        start, end = self.consumed, self.epoch_samples()
        perm = self.permutation()
        if end > self.dataset_len:  # pad by wrapping (drop_last=False only)
            perm = perm.repeat(math.ceil(end / self.dataset_len))
        # [num_global_batches, D, b] -> this rank's [num_global_batches, b], flattened in order
        batches = perm[start:end].view(-1, self.num_replicas, self.local_batch_size)
        return batches[:, self.rank].reshape(-1)

    def __iter__(self) -> Iterator[int]:
        return iter(self._rank_indices().tolist())

    def __len__(self) -> int:
        """Indices this rank gets from the next iter(): the rest of the epoch from the position."""
        return (self.epoch_samples() - self.consumed) // self.num_replicas

    # ---- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Identical on every DP rank for a given step; independent of the DP size."""
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed,
                "dataset_len": self.dataset_len}

    def load_state_dict(self, state: dict) -> None:
        missing = {"epoch", "consumed"} - set(state)
        if missing:
            raise KeyError(f"sampler state is missing {sorted(missing)}; expected a dict from state_dict()")
        saved_len = state.get("dataset_len", self.dataset_len)
        if saved_len != self.dataset_len:
            raise ValueError(
                f"the checkpoint's data position is for a dataset of {saved_len} samples, this one has "
                f"{self.dataset_len}; resume with the same data, or start the data order afresh by not "
                f"loading the sampler state")
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"the checkpoint's data order used seed {state['seed']}, this run uses {self.seed}; "
                f"resume with seed {state['seed']} to continue the same order")
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
