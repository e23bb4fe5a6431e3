"""The order of a sharded stream in one epoch: a pure function of (seed, epoch), the same at every world size.

A stream is a list of shards (tar files, Parquet files, chunks of an Arrow table) holding `sizes[s]` samples each;
sample i of the stream is the i-th sample of the shards laid end to end. An epoch reads it as

    1. the shards dealt round-robin to P partitions (P = --stream_partitions; 1 by default), in a shard order
       shuffled by (seed, epoch);
    2. each partition's samples, in its shard order, cut into windows of B samples (B = --shuffle_buffer), and
       each window shuffled by (seed, epoch, partition, window): a reader only ever needs the few shards of one
       window at a time (a shuffle buffer, as WebDataset's, but one whose content is known in advance);
    3. the global batches of G samples, each G / P samples from every partition: rank r of D data-parallel ranks
       takes the contiguous G / D slice of each global batch (opendit/data/sampler.py), which is the samples of
       partitions r * P/D .. (r+1) * P/D - 1. So with P = D each rank reads its own shards only.

Nothing here depends on D or on the DataLoader workers: a checkpoint's position (global samples consumed) names the
same samples at any world size, and a run resumed at D' (P % D' == 0) sees every sample of the epoch exactly once.
With P > 1 the epoch ends when the shortest partition runs out (the rest of the others waits for the next epoch's
deal); with P = 1 an epoch is every sample once, the last partial global batch dropped like drop_last.

Aspect-ratio buckets (one partition): the shuffled stream is read in order and each sample joins its bucket's
queue; a bucket's queue becomes a global batch when it holds G samples, and the batches follow in the order they
filled up. So a batch is of one bucket, the shuffle window still bounds what is read at a time (plus each bucket's
partial queue), and each bucket's last partial batch of the epoch waits for the next.
"""
import hashlib

import numpy as np
import torch

from opendit.seeding import mix_seed


def _generator(*keys: int) -> torch.Generator:
    return torch.Generator().manual_seed(mix_seed(*keys))


def partition_streams(sizes, seed: int, epoch: int, partitions: int, buffer: int) -> list[torch.Tensor]:
    """Each partition's samples in this epoch's order: [int64 [n_p]] (stream indices)."""
    sizes = torch.as_tensor(np.asarray(sizes, dtype=np.int64))
    starts = torch.cumsum(sizes, 0) - sizes
    shard_order = torch.randperm(len(sizes), generator=_generator(seed, epoch))
    streams = []
    for p in range(partitions):
        mine = shard_order[p::partitions]
        if len(mine) == 0:
            streams.append(torch.zeros(0, dtype=torch.int64))
            continue
        samples = torch.cat([torch.arange(int(starts[s]), int(starts[s] + sizes[s])) for s in mine.tolist()])
        # shuffle within windows of `buffer` samples: sort by (window, random key)
        keys = torch.rand(len(samples), generator=_generator(seed, epoch, p + 1), dtype=torch.float64)
        window = torch.div(torch.arange(len(samples)), buffer, rounding_mode="floor").double()
        streams.append(samples[torch.argsort(window + keys)])
    return streams


def stream_order(sizes, seed: int, epoch: int, global_batch: int, partitions: int = 1,
                 buffer: int = 10_000, shuffle: bool = True, groups: np.ndarray | None = None) -> torch.Tensor:
    """int64 [epoch length]: the stream indices of this epoch in global-batch order (see the module doc); groups:
    each sample's bucket (-1: never used), for batches of one bucket each."""
    check_layout(len(sizes), global_batch, partitions, buffer)
    if groups is not None and partitions > 1:
        raise ValueError(f"aspect-ratio buckets on a stream take one partition; leave --stream_partitions "
                         f"{partitions} out (or --buckets)")
    if not shuffle:  # in stream order (partition p: its shards in file order)
        streams = [_in_order(sizes, p, partitions) for p in range(partitions)]
    else:
        streams = partition_streams(sizes, seed, epoch, partitions, buffer)
    if groups is not None:
        return bucketed(streams[0], groups, global_batch)
    if partitions == 1:
        return streams[0]
    share = global_batch // partitions
    batches = min(len(s) for s in streams) // share
    # [P, batches, share] -> [batches, P, share]: each global batch takes `share` from every partition
    return torch.stack([s[: batches * share].view(batches, share) for s in streams], 1).reshape(-1)


def bucketed(stream: torch.Tensor, groups: np.ndarray, global_batch: int) -> torch.Tensor:
    """The stream cut into global batches of one bucket each, in the order their bucket queues filled up."""
    groups = np.asarray(groups)[stream.numpy()]
    batches, completed = [], []
    for bucket in np.unique(groups[groups >= 0]):
        positions = np.flatnonzero(groups == bucket)  # where this bucket's samples are in the stream
        whole = len(positions) // global_batch * global_batch
        if whole:
            chunks = positions[:whole].reshape(-1, global_batch)
            batches.append(chunks)
            completed.append(chunks[:, -1])  # a batch is ready when its last sample has been read
    if not batches:
        return torch.zeros(0, dtype=torch.int64)
    chunks = np.concatenate(batches)[np.argsort(np.concatenate(completed), kind="stable")]
    return stream[torch.from_numpy(chunks.reshape(-1))]


def _in_order(sizes, p: int, partitions: int) -> torch.Tensor:
    starts = np.cumsum(sizes) - np.asarray(sizes)
    parts = [torch.arange(int(starts[s]), int(starts[s] + sizes[s])) for s in range(p, len(sizes), partitions)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def check_layout(num_shards: int, global_batch: int, partitions: int, buffer: int) -> None:
    if buffer <= 0:
        raise ValueError(f"--shuffle_buffer {buffer}: the samples shuffled together; pass a positive count")
    if partitions <= 0:
        raise ValueError(f"--stream_partitions {partitions}: pass a positive count (1: one stream for all ranks)")
    if partitions > num_shards:
        raise ValueError(f"--stream_partitions {partitions} is more than the {num_shards} shard(s) of the data; pass "
                         f"at most {num_shards}, or split the data into more shards")
    if global_batch % partitions:
        raise ValueError(f"--batch_size {global_batch} is not a multiple of --stream_partitions {partitions} (each "
                         f"global batch takes the same count from every partition); pass a batch that is")


def check_ranks(partitions: int, dp_size: int) -> None:
    """Each data-parallel rank reads whole partitions: P must be a multiple of the data-parallel size."""
    if partitions > 1 and partitions % dp_size:
        raise ValueError(f"--stream_partitions {partitions} is not a multiple of the data-parallel size {dp_size}; "
                         f"pass a multiple of it (or 1), so each rank reads whole partitions")


def layout_fingerprint(sizes, global_batch: int, partitions: int, buffer: int, shuffle: bool,
                       groups: np.ndarray | None = None) -> str:
    """What a resumed run must share for the saved position to name the same samples (not the world size)."""
    parts = [np.asarray(sizes, dtype=np.int64).tobytes(), f"{partitions}/{buffer}/{shuffle}".encode()]
    if groups is not None:  # buckets: the assignment and the batch decide the order
        parts += [np.ascontiguousarray(groups, dtype=np.int64).tobytes(), str(global_batch).encode()]
    if partitions > 1:  # the global batch decides how partitions interleave
        parts.append(str(global_batch).encode())
    return hashlib.sha256(b"|".join(parts)).hexdigest()[:16]
