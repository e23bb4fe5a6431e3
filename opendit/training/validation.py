"""Validation loss that is comparable across steps and runs, and the training loss by noise level.

The same samples are scored every time (a held-out part of the training data, or --val_data_path), each at a
fixed noise level and with fixed noise: sample i (in the validation set's order) sits in bucket i % B of the
noise levels [0, 1/B), [1/B, 2/B), ... at the bucket's middle, and its noise is drawn from a generator seeded by
(global_seed, i). So the number depends only on the weights: not on the step, the world size or the batch size.
With --val_timesteps N every sample is instead scored at each of the N equidistant noise levels k/N (k = 0..N-1)
with its one fixed noise, and the loss is their mean: the definition of the MLPerf Training FLUX.1 benchmark's
validation loss (N = 8). It costs N forward passes per sample.
Validation runs inside torch.random.fork_rng: the training RNG stream, and with it exact resume, is unchanged.

Both losses are also reported per bucket (val_loss_t0 ... and loss_t0 ...): a diffusion loss is dominated by
its noisiest timesteps, so an improvement at low noise hides in the mean.
"""
import logging

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from opendit.data.buckets import bucket_ids
from opendit.seeding import mix_seed

logger = logging.getLogger("opendit")

BUCKETS = 4  # noise-level buckets of the per-bucket losses


def bucket_of(t: torch.Tensor) -> torch.Tensor:
    """Noise level(s) in [0, 1] -> bucket index (long)."""
    return (t * BUCKETS).long().clamp(0, BUCKETS - 1)


def holdout(num_items: int, num_val: int, seed: int) -> tuple[list[int], list[int]]:
    """(training indices, validation indices): num_val items drawn by a seeded permutation (so every class is
    represented whatever the data's order), the rest kept for training, both sorted."""
    if num_val >= num_items:
        raise ValueError(f"--val_samples {num_val}: the data has only {num_items} items; hold out fewer, or pass "
                         f"--val_data_path")
    order = torch.randperm(num_items, generator=torch.Generator().manual_seed(mix_seed(seed, 1))).tolist()
    return sorted(order[num_val:]), sorted(order[:num_val])


class TrainingPart(torch.utils.data.Subset):
    """The training data less the held-out items; passes set_epoch on (random flips depend on the epoch)."""

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


def spread(num_items: int, num_val: int) -> list[int]:
    """num_val indices spread evenly over a separate validation set (its first items may all be one class)."""
    if num_val >= num_items:
        return list(range(num_items))
    return [round(i * num_items / num_val) for i in range(num_val)]


class BucketSums:
    """Per-bucket sums and counts of per-sample losses, kept on the device (no host sync until read)."""

    def __init__(self, device):
        self.sums = torch.zeros(2, BUCKETS, dtype=torch.float64, device=device)

    def add(self, losses: torch.Tensor, t: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        w = torch.ones_like(losses, dtype=torch.float64) if weight is None else weight.double()
        index = bucket_of(t.detach())
        self.sums[0].index_add_(0, index, losses.detach().double() * w)
        self.sums[1].index_add_(0, index, w)

    def read(self, prefix: str) -> tuple[float, dict]:
        """(mean over all, {prefix + "_t0": mean of bucket 0, ...}) over all ranks (a collective), then reset.
        Ranks of a sequence-parallel group count their shared samples alike: the means are unchanged."""
        sums = self.sums.to("cpu", copy=True)  # a copy also on the CPU: self.sums is zeroed below
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        self.sums.zero_()
        mean = (sums[0].sum() / sums[1].sum()).item() if sums[1].sum() > 0 else float("nan")
        return mean, {f"{prefix}_t{k}": (sums[0, k] / sums[1, k]).item() for k in range(BUCKETS) if sums[1, k] > 0}


class Validator:
    """The validation loss of a model over fixed samples of `dataset` (indices), split over data-parallel ranks
    (dp_rank of dp_size; ranks of one sequence-parallel group share a dp_rank and score the same samples)."""

    def __init__(self, dataset, indices: list[int], objective, booster, micro_batch: int, seed: int, device,
                 timesteps: int = 0):
        if timesteps < 0:
            raise ValueError(f"--val_timesteps {timesteps} must be >= 0 (0: one stratified noise level per sample)")
        self.dataset, self.indices, self.objective, self.booster = dataset, indices, objective, booster
        self.micro_batch, self.seed, self.device, self.timesteps = micro_batch, seed, device, timesteps

    def _noise_levels(self, position: int) -> list[float]:
        """The noise levels sample `position` is scored at: its stratum's middle, or all N equidistant k/N."""
        if not self.timesteps:
            return [(position % BUCKETS + 0.5) / BUCKETS]
        return [k / self.timesteps for k in range(self.timesteps)]

    def _shard(self) -> list[list[tuple[int, float]]]:
        """Per aspect-ratio bucket (one list without buckets): (position in the validation set, weight) for this
        rank, padded with weight-0 repeats so every rank runs the same number of forward passes (sharded models
        gather weights in each). Items left out of the buckets (unreadable) are not scored."""
        ids = bucket_ids(self.dataset)
        by_bucket: dict[int, list[int]] = {}
        for p, i in enumerate(self.indices):
            by_bucket.setdefault(0 if ids is None else int(ids[i]), []).append(p)
        shards = []
        for bucket in sorted(b for b in by_bucket if b >= 0):
            positions = by_bucket[bucket]
            mine = positions[self.booster.dp_rank::self.booster.dp_size]
            per_rank = -(-len(positions) // self.booster.dp_size)
            padding = [(mine[-1] if mine else positions[0], 0.0)] * (per_rank - len(mine))
            shards.append([(p, 1.0) for p in mine] + padding)
        return shards

    @torch.no_grad()
    def __call__(self, model) -> dict:
        """{"val_loss": mean, "val_loss_t0": ..., ...}: a collective, call on every rank."""
        devices = [self.device] if self.device.type == "cuda" else []
        sums = BucketSums(self.device)
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(mix_seed(self.seed, 2))  # draws inside prepare (a cached posterior sample)
                for bucket in self._shard():  # a micro-batch holds one bucket's items
                    part = [(p, t, w) for p, w in bucket for t in self._noise_levels(p)]
                    for start in range(0, len(part), self.micro_batch):
                        self._score(model, part[start:start + self.micro_batch], sums)
        finally:
            model.train(was_training)
        mean, by_bucket = sums.read("val_loss")
        return {"val_loss": mean, **by_bucket}

    def _score(self, model, part: list[tuple[int, float, float]], sums: BucketSums) -> None:
        """part: (position in the validation set, noise level, weight) of each item of one micro-batch."""
        positions = [p for p, _, _ in part]
        batch = default_collate([self.dataset[self.indices[p]] for p in positions])
        x, cond = self.objective.prepare(batch, self.device, train=False)
        t_frac = torch.tensor([t for _, t, _ in part])
        noise = torch.stack([torch.randn(x.shape[1:], generator=torch.Generator().manual_seed(mix_seed(self.seed, p)))
                             for p in positions]).to(self.device, x.dtype)
        with self.booster.autocast():
            losses, t = self.objective.losses(model, x, cond, t_frac=t_frac, noise=noise)
        sums.add(losses, t, torch.tensor([w for _, _, w in part], device=self.device))
