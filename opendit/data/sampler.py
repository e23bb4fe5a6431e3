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

Buckets. With `groups` (each item's aspect-ratio bucket, opendit/data/buckets.py; -1: never used) an epoch's
order is built of whole global batches from one bucket each: every bucket's items are shuffled and cut into
global batches (the remainder is left out this epoch), and the batches are shuffled, all from (seed, epoch). So
each rank's micro-batch holds one bucket, every rank gets the same number of items (of the same size) per step,
and resuming at another DP size works as above.

Streams. A sharded stream (opendit/data/streaming.py) passes `order`: its epoch order (opendit/data/stream_order.py,
shards shuffled and read through a window-sized shuffle buffer, a pure function of (seed, epoch)) replaces the
permutation; it is cut into global batches in the same way, so a stream resumes like any dataset.

Counting. DataLoader workers prefetch ahead, so the sampler cannot tell which batches were really
trained on; the training loop calls `advance()` once per batch it consumed (before checkpointing).
"""
import hashlib
import math
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

from opendit.seeding import mix_seed


class ResumableDistributedSampler(Sampler[int]):
    def __init__(self, dataset_len: int, num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True, global_batch_size: int | None = None,
                 groups: np.ndarray | None = None, order=None):
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
        self.groups = None if groups is None else np.asarray(groups, dtype=np.int64)
        self.order, self._cached = order, (None, None)  # a stream's order (see the module doc), (epoch, order)
        if order is not None:
            if groups is not None:
                raise ValueError("a stream's order forms its bucketed batches itself: pass no groups with it")
            order.check(global_batch_size, num_replicas)
        elif self.groups is not None:
            _check_groups(self.groups, dataset_len, global_batch_size, drop_last)
        elif drop_last and dataset_len < global_batch_size:
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
        if order is not None and self.epoch_samples(0) == 0:
            raise ValueError(
                f"the stream's first epoch holds no whole global batch of {global_batch_size} ({dataset_len} samples"
                f"{'' if order.partitions == 1 else f' in {order.partitions} partitions'}); lower the global batch "
                f"size or --stream_partitions, or add data")

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
        if self.order is not None:  # whole global batches of the stream's order
            return len(self.permutation()) // self.global_batch_size * self.global_batch_size
        if self.groups is not None:  # whole batches only, by construction
            return self._grouped_length()
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
        if self.order is not None:
            if self._cached[0] != epoch:
                self._cached = (epoch, self.order.epoch_order(self.seed, epoch, self.global_batch_size, self.shuffle))
            return self._cached[1]
        if self.groups is not None:
            return self._grouped_permutation(epoch)
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
        return torch.randperm(self.dataset_len, generator=generator)

    def _grouped_length(self) -> int:
        counts = np.bincount(self.groups[self.groups >= 0])
        return int((counts // self.global_batch_size).sum()) * self.global_batch_size

    def _grouped_permutation(self, epoch: int) -> torch.Tensor:
        """int64 [epoch length]: global batches of one group each (see the module doc)."""
        generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
        g = self.global_batch_size
        batches = []
        for group in np.unique(self.groups[self.groups >= 0]):
            members = torch.from_numpy(np.flatnonzero(self.groups == group))
            if self.shuffle:
                members = members[torch.randperm(len(members), generator=generator)]
            batches += list(members[: len(members) // g * g].view(-1, g))
        if not batches:
            return torch.zeros(0, dtype=torch.int64)
        order = torch.randperm(len(batches), generator=generator) if self.shuffle else torch.arange(len(batches))
        return torch.cat([batches[i] for i in order.tolist()])

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
        state = {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "dataset_len": self.dataset_len}
        if self.groups is not None:
            state["groups"] = groups_fingerprint(self.groups)
        if self.order is not None:
            state["stream"] = self.order.fingerprint(self.global_batch_size, self.shuffle)
        return state

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
        mine = None if self.groups is None else groups_fingerprint(self.groups)
        if state.get("groups") != mine:
            def told(fingerprint):
                return f"aspect-ratio buckets {fingerprint}" if fingerprint else "unbucketed data"
            raise ValueError(
                f"the checkpoint's data position is for {told(state.get('groups'))}, this run has {told(mine)}; "
                f"resume with the same --buckets, --bucket_area and data, or start the data order afresh by not "
                f"loading the sampler state")
        stream = None if self.order is None else self.order.fingerprint(self.global_batch_size, self.shuffle)
        if state.get("stream") != stream:
            raise ValueError(
                "the checkpoint's data position is for " + ("a sharded stream of another layout (other shards or "
                "sample counts, --stream_partitions, --shuffle_buffer, or --batch_size with partitions)"
                if state.get("stream") and stream else "another kind of data (a stream against a map-style dataset)")
                + "; resume with the same data and stream options, or start the data order afresh by not loading the "
                "sampler state")
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"the checkpoint's data order used seed {state['seed']}, this run uses {self.seed}; "
                f"resume with seed {state['seed']} to continue the same order")
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])


def groups_fingerprint(groups: np.ndarray) -> str:
    """A short hash of the items' buckets: a resume must see the same assignment to continue the same order."""
    return hashlib.sha256(np.ascontiguousarray(groups, dtype=np.int64).tobytes()).hexdigest()[:16]


def _check_groups(groups: np.ndarray, dataset_len: int, global_batch_size: int, drop_last: bool) -> None:
    if len(groups) != dataset_len:
        raise ValueError(f"groups has {len(groups)} entries for a dataset of {dataset_len} items; give one per item")
    if not drop_last:
        raise ValueError("bucketed batches drop each bucket's remainder; drop_last=False is not supported with groups")
    counts = np.bincount(groups[groups >= 0]) if (groups >= 0).any() else np.zeros(0, dtype=np.int64)
    if not (counts >= global_batch_size).any():
        raise ValueError(
            f"no aspect-ratio bucket holds a whole global batch of {global_batch_size} (the largest holds "
            f"{int(counts.max()) if len(counts) else 0} items), so an epoch would be empty; lower --batch_size, pass "
            f"fewer --buckets, or add data")
