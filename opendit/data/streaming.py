"""Sharded streams as datasets: `--dataset webdataset | parquet | hf`, decoded, filtered and cropped on the fly.

A StreamDataset reads its samples from a shard source (opendit/data/shard_sources.py) and gives the items of the
family's other datasets: (image, caption) for text-to-image families, (image, label) for class-conditional ones,
(clip, label, caption) for video. Its order is the stream's (opendit/data/stream_order.py): shards shuffled, read
through a shuffle window, dealt to partitions, a pure function of (seed, epoch) that the resumable sampler cuts into
global batches, so a stream resumes exactly, and at another world size sees each sample of the epoch once.

Fields are found by key: a tar member's extension (`jpg`, `txt`, `cls`), a column name (Parquet, datasets), or
`json:FIELD`, a field of the sample's `.json` member (img2dataset's metadata) or of a struct column. Each key option
lists candidates, the first present wins. A sample that cannot be used (an undecodable image or clip, no caption, a
corrupt member, or one of the filters: --min_image_size, --max_aspect, --min_caption_chars, --max_caption_chars) is
skipped and counted like an unreadable file (opendit/data/skipped.py): its slot is filled by the next usable sample,
the reason is logged once per kind and the run's skipped count includes it.

Editing pairs stream through a subclass (opendit/data/edit_streams.py).
"""
import functools
import io
import json
import logging
import warnings

import torch
from PIL import Image
from torch.utils.data import Dataset, Subset

from opendit.data.buckets import Bucketable
from opendit.data.shard_sources import SOURCES, as_bytes, as_stream, expand_parquet, expand_shards, open_source
from opendit.data.skipped import SkipLog, first_readable
from opendit.data.spec import DatasetSpec
from opendit.data.stream_order import check_layout, check_ranks, layout_fingerprint, stream_order
from opendit.data.transforms import check_image_size, resize_crop, to_signed_tensor
from opendit.data.video_csv import clip_tensor
from opendit.data.video_io import video_geometry
from opendit.seeding import mix_seed

logger = logging.getLogger(__name__)

DEFAULT_KEYS = {
    "image": "jpg,jpeg,png,webp,image,img",
    "video": "mp4,webm,mkv,avi,mov,video",
    "caption": "txt,caption,text,json:caption,json:text",
    "label": "cls,label,json:label,json:cls",
}
ITEMS = ("caption", "label", "clip")  # what an item is: (image, caption), (image, label), (clip, label, caption)


class Unusable(ValueError):
    """A sample left out on purpose (a filter, a missing field): skipped and counted like an unreadable file."""


class StreamOrder:
    """The sampler's view of a stream: its epoch order and what a resume must share (opendit/data/stream_order.py)."""

    def __init__(self, sizes, partitions: int = 1, buffer: int = 10_000):
        self.sizes, self.partitions, self.buffer = list(sizes), int(partitions), int(buffer)
        self.groups = None  # each sample's aspect-ratio bucket, once the dataset was bucketed

    def epoch_order(self, seed: int, epoch: int, global_batch: int, shuffle: bool = True) -> torch.Tensor:
        return stream_order(self.sizes, seed, epoch, global_batch, self.partitions, self.buffer, shuffle, self.groups)

    def fingerprint(self, global_batch: int, shuffle: bool = True) -> str:
        return layout_fingerprint(self.sizes, global_batch, self.partitions, self.buffer, shuffle, self.groups)

    def check(self, global_batch: int, dp_size: int) -> None:
        check_layout(len(self.sizes), global_batch, self.partitions, self.buffer)
        check_ranks(self.partitions, dp_size)
        if self.groups is not None and self.partitions > 1:
            raise ValueError(f"--buckets on a stream takes one partition; leave --stream_partitions {self.partitions} "
                             f"out")


class SubsetOrder:
    """A stream's order restricted to a Subset's items (training data with validation items held out), in subset
    positions. One partition only: holding items out of partitions would unbalance them."""

    def __init__(self, order: StreamOrder, indices):
        if order.partitions > 1 or order.groups is not None:
            raise ValueError("--val_samples holds items out of a stream with --stream_partitions > 1 or --buckets; "
                             "pass --val_data_path (a held-out stream) instead")
        self.base, self.partitions = order, 1
        self.indices = torch.as_tensor(list(indices), dtype=torch.int64)

    def epoch_order(self, seed, epoch, global_batch, shuffle=True):
        position = torch.full((sum(self.base.sizes),), -1, dtype=torch.int64)
        position[self.indices] = torch.arange(len(self.indices))
        mapped = position[self.base.epoch_order(seed, epoch, global_batch, shuffle)]
        return mapped[mapped >= 0]

    def fingerprint(self, global_batch, shuffle=True):
        return self.base.fingerprint(global_batch, shuffle) + f"-{len(self.indices)}"

    def check(self, global_batch, dp_size):
        self.base.check(global_batch, dp_size)


def stream_order_of(dataset):
    """The order of a stream dataset (or of a Subset of one), None for map-style data."""
    if isinstance(dataset, Subset):
        inner = stream_order_of(dataset.dataset)
        return None if inner is None else SubsetOrder(inner, dataset.indices)
    order = getattr(dataset, "__dict__", {}).get("order")  # not through a mixture's __getattr__
    return order if isinstance(order, StreamOrder) else None


def key_list(text: str | None, default: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in (text or default).split(",") if k.strip())


def field(fields: dict, keys: tuple[str, ...]):
    """The first of `keys` present in a sample's fields (json:NAME looks into its .json member or struct column)."""
    for key in keys:
        if key.startswith("json:"):
            name = key[5:]
            for holder in ("json", "metadata"):
                meta = fields.get(holder)
                if isinstance(meta, (bytes, bytearray, str)):
                    try:
                        meta = json.loads(meta)
                    except ValueError:
                        continue
                if isinstance(meta, dict) and meta.get(name) is not None:
                    return meta[name]
        elif fields.get(key) is not None:
            return fields[key]
    return None


def as_text(value) -> str:
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", errors="replace")
    return " ".join(str(value).split())


class _Names:
    """samples[i][0]: how skip warnings name sample i (its shard and key)."""

    def __init__(self, source):
        self.source = source

    def __len__(self):
        return len(self.source)

    def __getitem__(self, i):
        return (self.source.where(i),)


class StreamDataset(Bucketable, Dataset):
    """A sharded stream (kind: webdataset, parquet or hf; spec: what --data_path gives) as items of `item` kind.

    The crop of item i in epoch e (its position with crop="random", its flip with random_flip, a clip's start) is a
    pure function of (seed, e, i): call `set_epoch(e)` before iterating. num_classes: labelled items' class count
    (given: a stream is not read through to count its labels); 0 for captioned items."""

    skipped_kind = "sample"
    control_keys: tuple[str, ...] = ()  # where an editing pair's controls may be (EditStreamDataset)

    def __init__(self, kind: str, spec: str, image_size: int, item: str = "caption", channels: int = 3,
                 seed: int = 0, num_frames: int = 16, frame_interval: int = 1, random_flip: bool = False,
                 crop: str = "center", image_key: str | None = None, caption_key: str | None = None,
                 label_key: str | None = None, num_classes: int | None = None, shuffle_buffer: int = 10_000,
                 stream_partitions: int = 1, min_image_size: int = 0, max_aspect: float = 0.0,
                 min_caption_chars: int = 0, max_caption_chars: int = 0, shard_cache: str | None = None,
                 hf_args: str | None = None):
        if item not in ITEMS:
            raise ValueError(f"item {item!r}: one of {', '.join(ITEMS)}")
        if crop not in ("center", "random"):
            raise ValueError(f"--crop {crop!r}: center or random")
        self.image_size, self.item, self.channels = check_image_size(image_size), item, channels
        self.seed, self.epoch, self.random_flip, self.crop = int(seed), 0, bool(random_flip), crop
        self.num_frames, self.frame_interval = int(num_frames), int(frame_interval)
        self.media_keys = key_list(image_key, DEFAULT_KEYS["video" if item == "clip" else "image"])
        self.caption_keys = key_list(caption_key, DEFAULT_KEYS["caption"])
        self.label_keys = key_list(label_key, DEFAULT_KEYS["label"])
        self.filters = dict(min_image_size=min_image_size, max_aspect=max_aspect, min_caption_chars=min_caption_chars,
                            max_caption_chars=max_caption_chars)
        if item == "label" and not num_classes:
            raise ValueError(f"--dataset {kind} with class labels: pass --num_classes (a stream is not read through "
                             f"to count its labels)")
        self.num_classes = int(num_classes or 0) if item != "caption" else 0
        keys = self.media_keys + self.caption_keys + self.label_keys + self.control_keys
        columns = tuple("json" if k.startswith("json:") else k for k in keys) + ("metadata", "width", "height")
        self.source = open_source(kind, spec, shard_cache, hf_args, columns)
        self.format, self.data_path = kind, str(spec)
        self.order = StreamOrder(self.source.sizes, stream_partitions, shuffle_buffer)
        self.samples = _Names(self.source)
        self.skips = SkipLog(self.skipped_kind, logger)
        logger.info("%s %s: %d samples in %d shards", kind, spec, len(self.source), len(self.source.sizes))

    # ---- the Dataset protocol -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.source)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    @property
    def num_skipped(self) -> int:
        return len(self.skips.bad)

    @property
    def _bad(self) -> set:
        return self.skips.bad

    def __getitem__(self, index: int):
        return first_readable(self, index, lambda i: self._read(i, index))

    def _all_unreadable(self, n: int) -> str:
        return self.skips.all_unreadable(f"all {n} samples of {self.format} {self.data_path!r}",
                                         "captioned_digits" if self.item == "caption" else "digits")

    @property
    def kind(self) -> str:
        """What conditions the items, as the video CSV names it: "label" or "caption"."""
        return "label" if self.num_classes else "caption"

    # ---- fields -----------------------------------------------------------------------------------------------
    def caption(self, index: int) -> str | None:
        """Item index's caption (None: labelled items), without decoding its image."""
        if self.item == "label":
            return None
        try:
            value = field(self.source.fields(index), self.caption_keys)
        except Exception:  # noqa: BLE001 - an unreadable sample has no caption to show
            return ""
        return "" if value is None else as_text(value)

    def _caption(self, fields: dict, required: bool) -> str:
        value = field(fields, self.caption_keys)
        if value is None:
            if required:
                raise Unusable(f"no caption (looked for {', '.join(self.caption_keys)}; set --caption_key)")
            return ""
        caption = as_text(value)
        low, high = self.filters["min_caption_chars"], self.filters["max_caption_chars"]
        if len(caption) < low or (high and len(caption) > high):
            raise Unusable(f"caption of {len(caption)} characters is outside --min_caption_chars {low} / "
                           f"--max_caption_chars {high}")
        return caption

    def _label(self, fields: dict, required: bool) -> int:
        value = field(fields, self.label_keys)
        if value is None:
            if required:
                raise Unusable(f"no label (looked for {', '.join(self.label_keys)}; set --label_key)")
            return -1
        label = int(as_text(value)) if not isinstance(value, int) else value
        if required and not 0 <= label < self.num_classes:
            raise Unusable(f"label {label} is outside 0..{self.num_classes - 1} (--num_classes {self.num_classes})")
        return label

    def _media(self, fields: dict):
        for key in self.media_keys:
            if fields.get(key) is not None:
                return fields[key]
        raise Unusable(f"no {'video' if self.item == 'clip' else 'image'} (looked for {', '.join(self.media_keys)};"
                       f" set --image_key)")

    def _check_shape(self, width: int, height: int) -> None:
        low, aspect = self.filters["min_image_size"], self.filters["max_aspect"]
        if min(width, height) < low:
            raise Unusable(f"{width}x{height} is below --min_image_size {low}")
        if aspect and max(width / height, height / width) > aspect:
            raise Unusable(f"{width}x{height} is beyond --max_aspect {aspect:g}")

    # ---- aspect-ratio buckets ---------------------------------------------------------------------------------
    def item_size(self, index: int) -> tuple[int, int, int | None] | None:
        """(width, height, frames or None) of sample index: from its metadata (a .json member's or the columns'
        width and height, as img2dataset writes them), else from the image's or clip's header; None: unreadable."""
        try:
            fields = self.source.fields(index)
            if self.item == "clip":
                width, height, frames = video_geometry(as_stream(self._media(fields)))
                return width, height, (frames - 1) // self.frame_interval + 1 if frames > 0 else 0
            width, height = field(fields, ("json:width", "width")), field(fields, ("json:height", "height"))
            if width and height:
                return int(width), int(height), None
            with Image.open(io.BytesIO(as_bytes(self._media(fields)))) as image:
                return image.size[0], image.size[1], None
        except Exception:  # noqa: BLE001 - an unreadable sample is left out of the buckets, as a bad file is skipped
            return None

    def use_buckets(self, buckets):
        assignment = super().use_buckets(buckets)
        self.order.groups = assignment.ids  # the stream's batches: one bucket each
        return assignment

    # ---- decoding -----------------------------------------------------------------------------------------------
    def _position(self, index: int):
        if self.crop == "center":
            return None
        mixed = mix_seed(self.seed, self.epoch, index, 1)
        return (mixed % 1001) / 1000, (mixed // 1001 % 1001) / 1000

    def _image(self, data, i: int, index: int, check: bool = True) -> torch.Tensor:
        """Encoded image -> [C, H, W] in [-1, 1] at item i's size, cropped and flipped as item `index` of the epoch;
        check: skip it by --min_image_size and --max_aspect."""
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                image.load()
                image = image.convert("L" if self.channels == 1 else "RGB")
        if check:
            self._check_shape(*image.size)
        image = resize_crop(image, *self.target_size(i, self.image_size), self._position(index))
        if self.random_flip and mix_seed(self.seed, self.epoch, index) & 1:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return to_signed_tensor(image)

    def _read(self, i: int, index: int):
        return self._item(self.source.fields(i), i, index)

    def _item(self, fields: dict, i: int, index: int):
        media = self._media(fields)
        if self.item == "clip":
            caption = self._caption(fields, required=not self.num_classes)
            label = self._label(fields, required=bool(self.num_classes))
            data = as_stream(media)
            if data is None:
                raise Unusable("the video field holds no bytes")
            frames = self.num_frames if self.buckets is None else self.buckets.size_of(i).frames
            clip = clip_tensor(data, frames, self.frame_interval, mix_seed(self.seed, self.epoch, index),
                               *self.target_size(i, self.image_size), self.channels)
            return clip, label, caption
        data = as_bytes(media)
        if data is None:
            raise Unusable("the image field holds no bytes")
        if self.item == "label":
            label = self._label(fields, required=True)
            return self._image(data, i, index), label
        caption = self._caption(fields, required=True)
        return self._image(data, i, index), caption


STREAM_SETTINGS = ("image_key", "caption_key", "label_key", "shuffle_buffer", "stream_partitions", "min_image_size",
                   "max_aspect", "min_caption_chars", "max_caption_chars", "crop", "shard_cache", "hf_args")
PATHS = {"webdataset": "tar shards: a .tar, a pattern such as shards/{00000..00099}.tar, a folder, http(s) URLs, or a "
                       "wids .json shard list",
         "parquet": "a .parquet file, a glob or a folder of them",
         "hf": "a folder written by datasets' save_to_disk, a folder of data files, or a hub name (--hf_args)"}
HELPS = {"webdataset": "WebDataset tar shards (KEY.jpg + KEY.txt / KEY.json / KEY.cls ...), local or http(s), streamed",
         "parquet": "Parquet files with encoded images and caption / label columns (Hugging Face's layout), streamed",
         "hf": "a Hugging Face datasets table (save_to_disk or load_dataset), streamed"}
DEMOS = {"caption": "captioned_digits", "label": "digits", "clip": "moving_digits"}


def stream_specs(item: str) -> tuple[DatasetSpec, ...]:
    """The three streamed --dataset kinds, giving items of `item` kind (see ITEMS)."""
    extra = ("num_classes",) if item != "caption" else ()
    return tuple(DatasetSpec(kind, HELPS[kind], _builder(kind, item), path=PATHS[kind], demo=DEMOS[item],
                             settings=STREAM_SETTINGS + extra, pattern=True,
                             probe=None if item == "clip" else functools.partial(probe_channels, kind))
                 for kind in SOURCES)


def probe_channels(kind: str, data_path: str, cfg) -> int:
    """1 when the stream's first image is grey (mode L, as the demo shards write it), else 3; reads one sample of the
    first shard only."""
    first = data_path
    if kind == "webdataset" and not str(data_path).endswith(".json"):
        first = expand_shards(data_path)[0]
    elif kind == "parquet":
        first = expand_parquet(data_path)[0]
    try:
        source = open_source(kind, first, getattr(cfg, "shard_cache", None), getattr(cfg, "hf_args", None))
        value = field(source.fields(0), key_list(getattr(cfg, "image_key", None), DEFAULT_KEYS["image"]))
        with Image.open(io.BytesIO(as_bytes(value))) as image:
            return 1 if image.mode in ("L", "LA", "1", "I;16") else 3
    except Exception:  # noqa: BLE001 - an unreadable first sample: the build names the problem; RGB meanwhile
        return 3


def _builder(kind: str, item: str):
    def build(path, size, **options):
        return StreamDataset(kind, path, size, item=item, **options)
    return build


CAPTIONED_STREAMS, LABELLED_STREAMS, CLIP_STREAMS = (stream_specs(item) for item in ITEMS)
