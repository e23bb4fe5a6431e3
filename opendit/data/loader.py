"""build_dataloader: the resumable, data-parallel loader the booster makes of a dataset."""
import torch
from torch.utils.data import DataLoader, Dataset

from opendit.data.buckets import bucket_ids
from opendit.data.sampler import ResumableDistributedSampler
from opendit.data.streaming import stream_order_of
from opendit.seeding import mix_seed


class ResumableDataLoader(DataLoader):
    """A DataLoader over a ResumableDistributedSampler that keeps the dataset's epoch in step.

    Call `set_epoch(e)` before each epoch, `advance()` after each consumed batch, and save
    `state_dict()` in checkpoints; `load_state_dict` restores the position (and dataset epoch).
    """

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        self._sync_epoch()

    def _sync_epoch(self) -> None:
        epoch = self.sampler.epoch
        if hasattr(self.dataset, "set_epoch"):  # flips depend on the epoch; workers copy it at iter()
            self.dataset.set_epoch(epoch)
        # worker base seeds per (seed, epoch), so a resumed epoch's workers match the uninterrupted run's
        self.generator.manual_seed(mix_seed(self.sampler.seed, epoch))

    def advance(self, num_batches: int = 1) -> None:
        self.sampler.advance(num_batches)

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self._sync_epoch()


def build_dataloader(dataset: Dataset, global_batch_size: int, dp_size: int, dp_rank: int, seed: int,
                     num_workers: int = 0, shuffle: bool = True, drop_last: bool = True) -> ResumableDataLoader:
    """Per-rank batches of global_batch_size / dp_size from this DP rank's shard of each global batch; a dataset
    with aspect-ratio buckets (opendit.data.buckets) gets batches of one bucket each, a sharded stream
    (opendit.data.streaming) its stream order."""
    if global_batch_size <= 0 or global_batch_size % dp_size != 0:
        raise ValueError(
            f"global batch size {global_batch_size} is not divisible by the data-parallel size {dp_size}; "
            f"pick a global batch that is a multiple of {dp_size}")
    order = stream_order_of(dataset)  # a stream's order forms its bucketed batches itself
    sampler = ResumableDistributedSampler(len(dataset), dp_size, dp_rank, shuffle=shuffle, seed=seed,
                                          drop_last=drop_last, global_batch_size=global_batch_size,
                                          groups=bucket_ids(dataset) if order is None else None, order=order)
    loader = ResumableDataLoader(
        dataset,
        batch_size=global_batch_size // dp_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        # False: each epoch's workers must copy the dataset with its new epoch (flips)
        persistent_workers=False,
        # the sampler already yields whole batches (dropped or padded per global batch)
        drop_last=False,
        # a private generator for worker base seeds: iter() would otherwise draw from the global
        # torch RNG, and a resumed run (one extra iter()) would drift from an uninterrupted one
        generator=torch.Generator(),
    )
    loader.set_epoch(sampler.epoch)
    return loader
