"""Datasets (digits demo, ImageNet-style folders), the resumable DP sampler, and the loader builder."""
from opendit.data.digits import DigitsDataset, digits_split
from opendit.data.image_folder import ImageFolderDataset
from opendit.data.latents import LatentDataset, read_manifest
from opendit.data.loader import DATASETS, ResumableDataLoader, build_dataloader, build_dataset
from opendit.data.sampler import ResumableDistributedSampler
from opendit.data.transforms import center_crop_arr

__all__ = ["DATASETS", "DigitsDataset", "ImageFolderDataset", "LatentDataset", "ResumableDataLoader",
           "ResumableDistributedSampler", "build_dataloader", "build_dataset", "center_crop_arr",
           "digits_split", "read_manifest"]
