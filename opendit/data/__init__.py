"""Datasets (digits demo, ImageNet-style folders, cached latents, videos from a CSV, the moving-digits video
demo, captioned images and the captioned-digits demo, editing pairs and the edit-digits demo; sharded streams of
images, clips or editing pairs: WebDataset tars, Parquet, Hugging Face datasets), each with its DatasetSpec (what
--dataset names and a model family offers), the resumable DP sampler and loader, and PyAV video helpers;
count_skipped totals the unreadable files skipped by all DataLoader workers and ranks."""
from opendit.data.captions import (CAPTIONED_DIGITS, CAPTIONS, DIGIT_CAPTION_WORDS, DIGIT_WORDS, CaptionedDigitsDataset,
                                   CaptionedImageDataset, digit_caption, distinct_captions)
from opendit.data.digits import DIGITS, DigitsDataset, digits_split
from opendit.data.edit_pairs import EDIT_DIGITS, EDIT_PAIRS, EditDigitsDataset, EditPairsDataset
from opendit.data.image_folder import FOLDER, ImageFolderDataset
from opendit.data.latent_shards import LATENTS
from opendit.data.latents import LatentDataset, read_manifest
from opendit.data.loader import ResumableDataLoader, build_dataloader
from opendit.data.moving_digits import MOVING_DIGITS, MovingDigitsDataset
from opendit.data.sampler import ResumableDistributedSampler
from opendit.data.skipped import count_skipped
from opendit.data.spec import DatasetSpec, dataset_map
from opendit.data.edit_streams import EDIT_STREAMS, EditStreamDataset
from opendit.data.streaming import CAPTIONED_STREAMS, CLIP_STREAMS, LABELLED_STREAMS, StreamDataset
from opendit.data.transforms import center_crop_arr
from opendit.data.video_csv import VIDEO_CSV, VideoCSVDataset, read_video_csv
from opendit.data.video_io import VideoReadError, read_clip, video_frame_count, write_gif, write_mp4

__all__ = ["CAPTIONED_STREAMS", "CLIP_STREAMS", "EDIT_STREAMS", "LABELLED_STREAMS", "EditStreamDataset",
           "StreamDataset",
           "CAPTIONED_DIGITS", "CAPTIONS", "DIGITS", "EDIT_DIGITS", "EDIT_PAIRS", "EditDigitsDataset",
           "EditPairsDataset", "DIGIT_CAPTION_WORDS", "DIGIT_WORDS", "FOLDER", "LATENTS",
           "MOVING_DIGITS", "VIDEO_CSV", "CaptionedDigitsDataset", "CaptionedImageDataset", "DatasetSpec",
           "DigitsDataset", "ImageFolderDataset", "LatentDataset", "MovingDigitsDataset", "ResumableDataLoader",
           "ResumableDistributedSampler", "VideoCSVDataset", "VideoReadError", "build_dataloader", "center_crop_arr",
           "count_skipped", "dataset_map", "digit_caption", "digits_split", "distinct_captions", "read_clip",
           "read_manifest", "read_video_csv", "video_frame_count", "write_gif", "write_mp4"]
