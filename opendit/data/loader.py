"""build_dataset / build_dataloader: the one place train.py and the booster get data from."""
import torch
from torch.utils.data import DataLoader, Dataset

from opendit.data.captions import CaptionedDigitsDataset, CaptionedImageDataset
from opendit.data.digits import DigitsDataset
from opendit.data.image_folder import ImageFolderDataset
from opendit.data.latents import LatentDataset
from opendit.data.moving_digits import MovingDigitsDataset
from opendit.data.sampler import ResumableDistributedSampler
from opendit.data.transforms import check_image_size
from opendit.data.video_csv import VideoCSVDataset
from opendit.seeding import mix_seed

DATASETS = ("digits", "folder", "latents", "video_csv", "moving_digits", "captioned_digits", "captions")


def build_dataset(name: str, data_path=None, image_size=None, **kwargs) -> Dataset:
    """name "digits" (built-in demo, data_path unused), "folder" (ImageNet-style class folders), "latents"
    (a cache written by preprocess.py; image_size may be None, else it must match the cache), "video_csv"
    (data_path: a CSV of videos, see VideoCSVDataset), "moving_digits" (built-in video demo, data_path unused),
    "captioned_digits" (built-in text-to-image demo, data_path unused) or "captions" (data_path: a folder of
    images with .txt captions, or a .csv / .jsonl of path,caption; see CaptionedImageDataset).

    kwargs go to the dataset: digits -> channels, split; folder and latents -> random_flip, seed;
    video_csv -> num_frames, frame_interval, seed, channels; moving_digits -> those and split;
    captioned_digits -> channels, seed, split; captions -> channels, random_flip, seed.
    Image datasets give (image [C, S, S], label); video datasets give (video [C, T, S, S], label, caption);
    captioned image datasets give (image [C, S, S], caption)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    if name == "latents":
        return LatentDataset(data_path, image_size, **kwargs)
    image_size = check_image_size(image_size)
    if name == "digits":
        return DigitsDataset(image_size, **kwargs)
    if name == "moving_digits":
        return MovingDigitsDataset(image_size, **kwargs)
    if name == "captioned_digits":
        return CaptionedDigitsDataset(image_size, **kwargs)
    if name == "captions":
        if data_path is None:
            raise ValueError("dataset 'captions' needs a data path; pass --data_path <folder of images with "
                             ".txt captions, or a .csv / .jsonl of path,caption> or use --dataset "
                             "captioned_digits for the built-in demo")
        return CaptionedImageDataset(data_path, image_size, **kwargs)
    if name == "video_csv":
        if data_path is None:
            raise ValueError("dataset 'video_csv' needs a data path; pass --data_path <CSV of path,caption or "
                             "path,label rows> or use --dataset moving_digits for the built-in video demo")
        return VideoCSVDataset(data_path, image_size, **kwargs)
    if data_path is None:
        raise ValueError("dataset 'folder' needs a data path; pass --data_path <folder of class folders> "
                         "or use --dataset digits for the built-in demo set")
    return ImageFolderDataset(data_path, image_size, **kwargs)


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
    """Per-rank batches of global_batch_size / dp_size from this DP rank's shard of each global batch."""
    if global_batch_size <= 0 or global_batch_size % dp_size != 0:
        raise ValueError(
            f"global batch size {global_batch_size} is not divisible by the data-parallel size {dp_size}; "
            f"pick a global batch that is a multiple of {dp_size}")
    sampler = ResumableDistributedSampler(len(dataset), dp_size, dp_rank, shuffle=shuffle, seed=seed,
                                          drop_last=drop_last, global_batch_size=global_batch_size)
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
