"""Videos listed in a CSV: item = (float32 [C, T, S, S] in [-1, 1], int label, str caption).

The CSV has two columns, `path,caption` or `path,label` (a header row naming them, or none, as in OpenDiT:
then the second column holds labels when every value is an integer, else captions). Relative paths resolve
against the CSV's folder. Each item is num_frames frames, frame_interval apart, from a start drawn per
(seed, epoch, index); each frame gets the ADM center crop of the image datasets.

Missing, zero-byte, corrupt, truncated and too-short videos never stop an epoch: as in ImageFolderDataset, a bad
file is logged once, counted, and its slot is filled by the next readable index (opendit/data/skipped.py).
"""
import csv
import logging
import os

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from opendit.data.buckets import Bucketable
from opendit.data.spec import DatasetSpec
from opendit.data.skipped import SkipLog, first_readable
from opendit.data.transforms import check_image_size, resize_crop
from opendit.data.video_io import clip_span, read_clip, require_av, video_geometry
from opendit.seeding import mix_seed

logger = logging.getLogger(__name__)

CSV_HINT = ("expected a CSV with two columns and the header `path,caption` or `path,label` "
            "(or no header: `path,<caption or integer label>` per row); relative paths resolve against "
            "the CSV's folder")
HEADERS = {("path", "caption"): "caption", ("path", "label"): "label"}


def read_video_csv(csv_path: str):
    """-> (kind "label" or "caption", [(absolute path, label or -1, caption or "")]) in file order."""
    if not os.path.isfile(csv_path):
        raise FileNotFoundError(f"video CSV {csv_path!r} does not exist or is not a file; pass --data_path "
                                f"pointing to it ({CSV_HINT}), or use --dataset moving_digits for the "
                                f"built-in video demo")
    with open(csv_path, newline="", encoding="utf-8-sig") as f:  # -sig: drops the BOM spreadsheets write
        rows = [(line, row) for line, row in enumerate(csv.reader(f), start=1) if any(c.strip() for c in row)]
    if rows and tuple(c.strip().lower() for c in rows[0][1]) in HEADERS:
        kind = HEADERS[tuple(c.strip().lower() for c in rows[0][1])]
        rows = rows[1:]
    elif rows and rows[0][1][0].strip().lower() == "path":
        raise ValueError(f"{csv_path!r} has the header {','.join(rows[0][1])!r}; {CSV_HINT}")
    else:
        kind = None
    if not rows:
        raise ValueError(f"{csv_path!r} has no rows of videos; {CSV_HINT}")
    for line, row in rows:
        if len(row) != 2 or not row[0].strip():
            raise ValueError(f"{csv_path!r} line {line} has {len(row)} column(s) {row!r}; {CSV_HINT}")
    if kind is None:
        kind = "label" if all(_is_int(row[1]) for _, row in rows) else "caption"
    folder = os.path.dirname(os.path.abspath(csv_path))
    samples = []
    for line, (path, value) in rows:
        path = os.path.join(folder, os.path.expanduser(path.strip()))  # an absolute path stays as it is
        if kind == "caption":
            samples.append((path, -1, value.strip()))
            continue
        if not _is_int(value) or int(value) < 0:
            raise ValueError(f"{csv_path!r} line {line}: label {value!r} is not a non-negative integer; "
                             f"labels are class indices 0..N-1 (use the header `path,caption` for text)")
        samples.append((path, int(value), ""))
    return kind, samples


def _is_int(text: str) -> bool:
    try:
        int(text.strip())
    except ValueError:
        return False
    return True


def clip_tensor(path, num_frames: int, frame_interval: int, seed: int, width: int, height: int,
                channels: int) -> torch.Tensor:
    """A clip of `path` (a file name or object; its start drawn by `seed`), each frame ADM-cropped to width x height
    -> float32 [channels, num_frames, height, width] in [-1, 1]."""
    frames = read_clip(path, num_frames, frame_interval, seed=seed)  # uint8 [T, H, W, 3]
    mode = "L" if channels == 1 else "RGB"
    crops = [np.asarray(resize_crop(Image.fromarray(f), width, height).convert(mode)) for f in frames]
    clip = torch.from_numpy(np.stack(crops)).reshape(num_frames, height, width, channels)  # [T, H, W, C]
    return clip.permute(3, 0, 1, 2).float().div_(127.5).sub_(1.0)  # [C, T, H, W] in [-1, 1]


class VideoCSVDataset(Bucketable, Dataset):
    """item = (float32 [channels, num_frames, S, S] in [-1, 1], int label (-1 without labels),
    str caption ("" without captions)); with aspect-ratio buckets (`use_buckets`) [channels, F, H, W] of the item's
    bucket (F frames, each resized to cover H x W and center-cropped).

    The clip start of item i in epoch e is a pure function of (seed, e, i): call `set_epoch(e)` before
    iterating. channels=1 converts frames to grey (ITU-R 601 luma). `num_classes` is max label + 1
    (0 for a caption CSV); `classes` names them "0".."N-1". `num_skipped` counts distinct unreadable
    videos seen by this process (each DataLoader worker has its own; `count_skipped(dataset)` counts all
    workers' and ranks').
    """

    def __init__(self, csv_path: str, image_size: int, num_frames: int = 16, frame_interval: int = 1,
                 seed: int = 0, channels: int = 3):
        self.csv_path = os.fspath(csv_path)
        self.image_size = check_image_size(image_size)
        clip_span(num_frames, frame_interval)  # validates both
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {channels!r}")
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed!r}")
        self.num_frames, self.frame_interval = int(num_frames), int(frame_interval)
        self.channels = channels
        self.seed = int(seed)
        self.epoch = 0
        self.kind, self.samples = read_video_csv(self.csv_path)
        require_av()  # fail here without PyAV, not by skipping every video as unreadable
        self.num_classes = max(label for _, label, _ in self.samples) + 1 if self.kind == "label" else 0
        self.classes = [str(i) for i in range(self.num_classes)]
        self.skips = SkipLog("video", logger)

    @property
    def _bad(self) -> set:
        """Indices this process found unreadable: skipped without re-reading or re-warning."""
        return self.skips.bad

    @property
    def num_skipped(self) -> int:
        return len(self.skips.bad)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def caption(self, index: int) -> str | None:
        """Item index's caption without decoding its video (None: a CSV of labels)."""
        return self.samples[index][2] if self.kind == "caption" else None

    def __len__(self) -> int:
        return len(self.samples)

    def item_size(self, index: int) -> tuple[int, int, int] | None:
        """(width, height, longest clip in frames at --frame_interval) from the video's header; None: unreadable."""
        try:
            width, height, frames = video_geometry(self.samples[index][0])
        except Exception:  # noqa: BLE001 - any unreadable video: left out of the buckets, as a bad file is skipped
            return None
        return width, height, (frames - 1) // self.frame_interval + 1 if frames > 0 else 0

    def _clip(self, path: str, index: int, width: int, height: int, num_frames: int) -> torch.Tensor:
        # the start keys on the requested index, so a replacement does not shift other items' starts
        return clip_tensor(path, num_frames, self.frame_interval, mix_seed(self.seed, self.epoch, index), width,
                           height, self.channels)

    def _read(self, i: int, index: int):
        path, label, caption = self.samples[i]
        width, height = self.target_size(i, self.image_size)
        frames = self.num_frames if self.buckets is None else self.buckets.size_of(i).frames
        return self._clip(path, index, width, height, frames), label, caption

    def __getitem__(self, index: int):
        # FileNotFoundError, VideoReadError (zero bytes, corrupt, truncated, too short) and whatever else FFmpeg or
        # PIL raise for one bad file are skipped
        return first_readable(self, index, lambda i: self._read(i, index))

    def _all_unreadable(self, n: int) -> str:
        return self.skips.all_unreadable(
            f"all {n} videos listed in {self.csv_path!r} (relative paths resolve against the CSV's folder)",
            "moving_digits")


VIDEO_CSV = DatasetSpec("video_csv", "a CSV of videos with a path,label or path,caption header (PyAV decodes)",
                        lambda path, size, **kw: VideoCSVDataset(path, size, **kw),
                        path="CSV of path,caption or path,label rows", demo="moving_digits")
