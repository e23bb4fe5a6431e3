"""Datasets (digits demo, ImageNet-style folders, cached latents, videos from a CSV, the moving-digits video
demo, captioned images and the captioned-digits demo), the resumable DP sampler, the loader builder, and PyAV
video helpers; count_skipped totals the unreadable files skipped by all DataLoader workers and ranks."""
from opendit.data.captions import (DIGIT_CAPTION_WORDS, DIGIT_WORDS, CaptionedDigitsDataset, CaptionedImageDataset,
                                   digit_caption)
from opendit.data.digits import DigitsDataset, digits_split
from opendit.data.image_folder import ImageFolderDataset
from opendit.data.latents import LatentDataset, read_manifest
from opendit.data.loader import DATASETS, ResumableDataLoader, build_dataloader, build_dataset
from opendit.data.moving_digits import MovingDigitsDataset
from opendit.data.sampler import ResumableDistributedSampler
from opendit.data.skipped import count_skipped
from opendit.data.transforms import center_crop_arr
from opendit.data.video_csv import VideoCSVDataset, read_video_csv
from opendit.data.video_io import VideoReadError, read_clip, video_frame_count, write_gif, write_mp4

__all__ = ["DATASETS", "DIGIT_CAPTION_WORDS", "DIGIT_WORDS", "CaptionedDigitsDataset", "CaptionedImageDataset",
           "DigitsDataset", "ImageFolderDataset", "LatentDataset", "MovingDigitsDataset", "ResumableDataLoader",
           "ResumableDistributedSampler", "VideoCSVDataset", "VideoReadError", "build_dataloader", "build_dataset",
           "center_crop_arr", "count_skipped", "digit_caption", "digits_split", "read_clip", "read_manifest",
           "read_video_csv", "video_frame_count", "write_gif", "write_mp4"]
