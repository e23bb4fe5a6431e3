"""Aspect-ratio buckets: train on photos and videos in their own shape instead of a square center crop.

A bucket is a training size (width x height pixels, and frames for video) whose sides are multiples of the model's
size step (the VAE's downsampling x the patch size) and whose area is about --bucket_area. Each item goes to the
bucket nearest its aspect ratio (in log space, so 2:1 and 1:2 are equally far from 1:1), is resized until the
bucket fits inside it and center-cropped to the bucket. A video goes to the longest frame count it has enough
frames for, then to the nearest aspect ratio among the buckets of that length.

Every micro-batch holds items of one bucket: `ResumableDistributedSampler(groups=...)` forms global batches within
buckets (opendit/data/sampler.py). A dataset that buckets has a `buckets` attribute (a BucketAssignment).
"""
import logging
import math
from dataclasses import dataclass

import numpy as np
from torch.utils.data import Subset

logger = logging.getLogger(__name__)

MAX_RATIO = 4.0  # aspect ratios from 1:4 to 4:1


@dataclass(frozen=True)
class Bucket:
    width: int
    height: int
    frames: int | None = None  # video buckets only

    def __str__(self) -> str:
        return f"{self.width}x{self.height}" + (f"x{self.frames}" if self.frames else "")

    @property
    def log_ratio(self) -> float:
        return math.log(self.width / self.height)


def auto_buckets(area: int, step: int, max_ratio: float = MAX_RATIO) -> list[Bucket]:
    """The widest set of sizes of about `area` pixels with sides multiples of `step` and aspect ratios within
    [1/max_ratio, max_ratio]: for each width, the tallest height that keeps width x height <= area (kohya's and
    SimpleTuner's construction), ordered from the tallest to the widest. For area = S**2 (S a multiple of step), the
    S x S square is one of them."""
    if area < step * step:
        raise ValueError(f"--bucket_area {area} is smaller than one {step}x{step} step; use at least {step * step}")
    sizes = set()
    for width in range(step, area // step + 1, step):
        height = (area // width) // step * step
        if height >= step and 1 / max_ratio <= width / height <= max_ratio:
            sizes.add((width, height))
    # a wider bucket with the same height adds nothing when a narrower one of larger area exists: keep, per
    # height, the widest width (the largest area), and per width the tallest height
    best_per_height: dict[int, int] = {}
    for width, height in sizes:
        best_per_height[height] = max(best_per_height.get(height, 0), width)
    return sorted((Bucket(w, h) for h, w in best_per_height.items()), key=lambda b: b.log_ratio)


def parse_buckets(spec: str, area: int, step: int, frames: tuple[int, ...] = ()) -> list[Bucket]:
    """--buckets "auto" or "WxH,WxH,..." -> buckets (one per frame count in `frames` for video)."""
    if spec.strip().lower() == "auto":
        sizes = auto_buckets(area, step)
    else:
        sizes = []
        for part in (p.strip() for p in spec.split(",") if p.strip()):
            try:
                width, height = (int(v) for v in part.lower().split("x"))
            except ValueError:
                raise ValueError(f"--buckets: {part!r} is not WIDTHxHEIGHT; pass e.g. --buckets 512x768,768x512 or "
                                 f"--buckets auto") from None
            if width <= 0 or height <= 0 or width % step or height % step:
                raise ValueError(f"--buckets: {part} must have sides that are positive multiples of {step} (the "
                                 f"VAE's downsampling x the patch size); e.g. {max(1, width // step) * step}x"
                                 f"{max(1, height // step) * step}")
            sizes.append(Bucket(width, height))
        if not sizes:
            raise ValueError("--buckets is empty; pass auto or a list such as 512x768,768x512")
        sizes = sorted(set(sizes), key=lambda b: b.log_ratio)
    if not frames:
        return sizes
    return [Bucket(b.width, b.height, f) for f in sorted(set(frames), reverse=True) for b in sizes]


def nearest_bucket(buckets: list[Bucket], width: int, height: int, frames: int | None = None) -> int:
    """Index of the bucket for an item of width x height (and `frames` available frames for video): the longest
    frame count that fits, then the nearest aspect ratio (ties: the first); -1 when too few frames for any."""
    candidates = range(len(buckets))
    if frames is not None:
        fitting = [b.frames for b in buckets if b.frames is not None and b.frames <= frames]
        if not fitting:
            return -1
        candidates = [i for i in candidates if buckets[i].frames == max(fitting)]
    ratio = math.log(width / height)
    return min(candidates, key=lambda i: abs(buckets[i].log_ratio - ratio))


@dataclass
class BucketAssignment:
    """buckets: the sizes; ids: int64 [num_items], each item's bucket (-1: left out, e.g. an unreadable header or
    a video shorter than every bucket)."""
    buckets: list[Bucket]
    ids: np.ndarray

    def size_of(self, index: int) -> Bucket:
        return self.buckets[int(self.ids[index])]

    def members(self, index: int) -> np.ndarray:
        """The items of index's bucket, ascending (where an unreadable item's replacement is drawn from)."""
        return np.flatnonzero(self.ids == self.ids[index])

    def counts(self) -> dict[str, int]:
        return {str(b): int((self.ids == k).sum()) for k, b in enumerate(self.buckets)}


def assign_buckets(sizes: list[tuple[int, int, int | None] | None], buckets: list[Bucket]) -> BucketAssignment:
    """Item sizes (width, height, frames or None; None: unreadable) -> their buckets."""
    ids = np.array([-1 if s is None else nearest_bucket(buckets, *s) for s in sizes], dtype=np.int64)
    return BucketAssignment(list(buckets), ids)


class Bucketable:
    """What a dataset that can bucket adds: `item_size(i)` (its subclass's: the file's width, height and frames
    read from its header, None when unreadable) and, once `use_buckets` ran, each item's target size."""
    buckets: BucketAssignment | None = None

    def item_size(self, index: int) -> tuple[int, int, int | None] | None:
        raise NotImplementedError

    def use_buckets(self, buckets: list[Bucket]) -> BucketAssignment:
        """Assign every item to its bucket (reads each file's header once) -> the assignment, also kept."""
        self.buckets = assign_buckets([self.item_size(i) for i in range(len(self))], buckets)
        return self.buckets

    def target_size(self, index: int, default: int) -> tuple[int, int]:
        """(width, height) item `index` is cropped to: its bucket's, else default x default."""
        if self.buckets is None:
            return default, default
        bucket = self.buckets.size_of(index)
        return bucket.width, bucket.height


def bucket_assignment(dataset) -> BucketAssignment | None:
    """The buckets of a dataset, or of the dataset it wraps (a Subset, a wrapper adding fields), None if none."""
    while dataset is not None:
        if getattr(dataset, "buckets", None) is not None:
            return dataset.buckets
        dataset = getattr(dataset, "dataset", None)
    return None


def bucket_ids(dataset) -> np.ndarray | None:
    """Per-item bucket ids of a dataset (of a Subset of one, e.g. the training part: its items'), None when not
    bucketed."""
    if isinstance(dataset, Subset):
        ids = bucket_ids(dataset.dataset)
        return None if ids is None else ids[np.asarray(dataset.indices, dtype=np.int64)]
    assignment = bucket_assignment(dataset)
    return None if assignment is None else assignment.ids


def bucket_summary(ids: np.ndarray, buckets: list[Bucket], batch: int) -> str:
    """A table for the log: items per bucket, the items each epoch leaves out (a bucket's remainder of whole global
    batches) and the items never used (left out when assigned)."""
    rows = [f"{'bucket':>14} {'items':>7} {'batches/epoch':>13} {'left out/epoch':>14}"]
    for k, bucket in enumerate(buckets):
        n = int((ids == k).sum())
        if n:
            rows.append(f"{str(bucket):>14} {n:>7} {n // batch:>13} {n % batch:>14}")
    unused = int((ids < 0).sum())
    used = sum(int((ids == k).sum()) // batch * batch for k in range(len(buckets)))
    rows.append(f"{len(ids)} items, {used} trained per epoch in global batches of {batch}"
                + (f", {unused} never (unreadable, or too few frames)" if unused else ""))
    return "\n".join(rows)
