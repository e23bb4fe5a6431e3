"""Several datasets in one run: `train.py --dataset_config data.toml`.

The file lists datasets as `[[datasets]]` tables, each with its kind (a --dataset name of the model's family),
its path, how often it repeats per epoch, its own data settings (image size, buckets, frames, digits) and caption
options:

    [[datasets]]
    kind = "captions"                 # a --dataset name of the model's family
    path = "data/subject"             # what --data_path would be (built-in data: none)
    repeats = 10                      # times each item is seen per epoch (default 1)
    buckets = "auto"                  # any of DATA_SETTINGS, for this dataset only; the run's flags otherwise
    trigger = "sks dog"               # put first in every caption
    shuffle_tags = true               # shuffle the comma-separated tags of a caption ...
    keep_tags = 1                     # ... keeping the first N where they are
    caption_dropout = 0.1             # a caption is left empty this often (an unconditional sample)
    prior = true                      # class images (python -m opendit.prior): loss weighted by --prior_loss_weight

An epoch holds every item of every dataset `repeats` times. Each global batch comes from one dataset and one of
its buckets (a dataset without buckets is one bucket at its image size): the items of a (dataset, bucket) pair
are shuffled and cut into global batches, and the batches of all pairs are shuffled together, all from (seed,
epoch) (opendit/data/sampler.py). So the mixture is a pure function of seed and epoch, and a run resumes exactly,
also at another world size. The caption options are drawn per (seed, epoch, item), the same in every process.
"""
import dataclasses
import typing
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from opendit.config_files import fits, nearest, read_file, type_name
from opendit.data.buckets import Bucket, BucketAssignment, bucket_assignment
from opendit.options import check_value
from opendit.seeding import mix_seed

# the run's settings a dataset may set for itself (those of them its config class has)
DATA_SETTINGS = ("image_size", "buckets", "bucket_area", "bucket_frames", "digits", "frame_interval",
                 "caption_extension", "image_key", "caption_key", "label_key", "hf_args", "min_image_size",
                 "max_aspect", "min_caption_chars", "max_caption_chars", "crop", "control_directory", "control_key")
CAPTION_OPTIONS = {"trigger": str, "shuffle_tags": bool, "keep_tags": int, "caption_dropout": float}
ENTRY_KEYS = {"kind": str, "path": str, "repeats": int, "name": str, "prior": bool, **CAPTION_OPTIONS}


@dataclasses.dataclass(frozen=True)
class CaptionOptions:
    trigger: str = ""
    shuffle_tags: bool = False
    keep_tags: int = 0
    caption_dropout: float = 0.0

    def __bool__(self) -> bool:
        return self != CaptionOptions()

    def apply(self, caption: str, seed: int) -> str:
        """The caption as this item sees it this epoch (seed: from (run seed, epoch, item))."""
        rng = np.random.default_rng(seed)
        if self.caption_dropout and rng.random() < self.caption_dropout:
            return ""
        if self.shuffle_tags:
            tags = [t.strip() for t in caption.split(",") if t.strip()]
            kept, rest = tags[:self.keep_tags], tags[self.keep_tags:]
            caption = ", ".join(kept + [rest[i] for i in rng.permutation(len(rest))])
        if self.trigger and not caption.startswith(self.trigger):
            caption = f"{self.trigger}, {caption}" if caption else self.trigger
        return caption


@dataclasses.dataclass(frozen=True)
class DatasetEntry:
    """One [[datasets]] table: name (for the log), the settings it replaces in the run's config, repeats, caption
    options and the weight of its batches' loss (--prior_loss_weight for a prior dataset, else 1)."""
    name: str
    settings: dict
    repeats: int
    captions: CaptionOptions
    loss_weight: float = 1.0


def read_dataset_config(path, cfg, kinds) -> list[DatasetEntry]:
    """The datasets a --dataset_config file lists, checked against the run's config `cfg` and the family's
    dataset names `kinds` (each problem a ValueError naming the file, the dataset and the key)."""
    data = read_file(path)
    unknown = sorted(set(data) - {"datasets"})
    if unknown or not isinstance(data.get("datasets"), list) or not data["datasets"]:
        raise ValueError(f"{path}: a dataset config is a list of [[datasets]] tables"
                         + (f"; unknown top-level key {unknown[0]!r}" if unknown else ""))
    fields, hints = {f.name: f for f in dataclasses.fields(cfg)}, typing.get_type_hints(type(cfg))
    own = [s for s in DATA_SETTINGS if s in fields]
    entries = []
    for i, table in enumerate(data["datasets"]):
        where = f"{path}: dataset {i + 1}"
        if not isinstance(table, dict):
            raise ValueError(f"{where}: must be a table of kind, path, repeats, ...")
        for key, value in table.items():
            kind = ENTRY_KEYS.get(key)
            if kind is None and key not in own:
                raise ValueError(f"{where}: unknown key {key!r}{nearest(key, [*ENTRY_KEYS, *own])} (keys: "
                                 f"{', '.join([*ENTRY_KEYS, *own])})")
            if kind is None:  # one of the run's settings: its flag's type and range
                kind = hints[key]
                try:
                    check_value(fields[key], value if fits(value, kind) else None)
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
            if not fits(value, kind):
                raise ValueError(f"{where}: {key} = {value!r} must be of type {type_name(kind)}")
        if table.get("kind") not in kinds:
            raise ValueError(f"{where}: kind = {table.get('kind')!r}; {cfg.model} trains on: {', '.join(kinds)}")
        spec = kinds[table["kind"]]
        if spec.path and not table.get("path"):
            raise ValueError(f"{where}: kind {spec.name!r} needs a path: <{spec.path}>")
        if not spec.path and table.get("path"):
            raise ValueError(f"{where}: kind {spec.name!r} is built in and takes no path; leave path out")
        if table.get("path") and not spec.pattern and not Path(table["path"]).exists():
            raise FileNotFoundError(f"{where}: path {table['path']!r} does not exist")
        repeats = table.get("repeats", 1)
        if repeats < 1:
            raise ValueError(f"{where}: repeats = {repeats}; must be an integer >= 1 (leave the dataset out instead)")
        captions = CaptionOptions(**{k: table[k] for k in CAPTION_OPTIONS if k in table})
        if not 0 <= captions.caption_dropout <= 1 or captions.keep_tags < 0:
            raise ValueError(f"{where}: caption_dropout must be in [0, 1] and keep_tags >= 0")
        if captions and spec.cache:
            raise ValueError(f"{where}: a latent cache holds encoded captions; caption options need the captions "
                             "themselves (a captioned folder or table)")
        settings = {"dataset": spec.name, "data_path": table.get("path"), **{k: table[k] for k in own if k in table}}
        weight = cfg.prior_loss_weight if table.get("prior") else 1.0
        entries.append(DatasetEntry(table.get("name") or table.get("path") or spec.name, settings, repeats,
                                    captions, weight))
    if len({kinds[e.settings["dataset"]].cache for e in entries}) > 1:
        raise ValueError(f"{path}: latent caches and raw data in one run; cache every dataset (preprocess.py) or none")
    if len({kinds[e.settings["dataset"]].pairs for e in entries}) > 1:
        raise ValueError(f"{path}: editing pairs and single images in one run; a batch holds one kind (list the "
                         f"pairs in a dataset config of their own)")
    return entries


def to_channels(x, channels: int):
    """Pixels [C, ...] in [-1, 1] with 1 or 3 channels -> `channels`: grey by ITU-R 601 luma, or grey repeated."""
    if x.shape[0] == channels:
        return x
    if channels == 1:
        return (0.299 * x[0] + 0.587 * x[1] + 0.114 * x[2]).unsqueeze(0)
    return x.expand(channels, *x.shape[1:]).clone()


def _controls_to(x, channels: int):
    """An editing pair's controls [K, C, H, W] in `channels` (to_channels each); anything else as it is."""
    return torch.stack([to_channels(c, channels) for c in x]) if isinstance(x, torch.Tensor) and x.ndim == 4 else x


class MixedDataset(Dataset):
    """The datasets of a dataset config as one: item i of the epoch is item j of part k (each part's items
    `repeats` times in a row), its caption options applied, in the first part's pixel channels (grey digits beside
    RGB images: luma). `buckets` gives every (part, bucket) pair its own bucket id, which the sampler forms global
    batches within. Other attributes (num_classes, latent_shape, embeddings, ...) are the first part's: a
    mixture's parts are data of one kind."""

    def __init__(self, parts: list[Dataset], entries: list[DatasetEntry], image_sizes: list[int], seed: int):
        self.parts, self.entries, self.seed, self.epoch = parts, entries, int(seed), 0
        self.channels = getattr(parts[0], "channels", None)  # pixel data: every part's items get the first's
        lengths = np.array([len(p) * e.repeats for p, e in zip(parts, entries)], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        buckets, ids = [], []
        for part, entry, size in zip(parts, entries, image_sizes):
            own = bucket_assignment(part)
            part_ids = own.ids if own is not None else np.zeros(len(part), dtype=np.int64)
            sizes = own.buckets if own is not None else [Bucket(size, size)]
            ids.append(np.tile(np.where(part_ids >= 0, part_ids + len(buckets), -1), entry.repeats))
            buckets += sizes
        self.buckets = BucketAssignment(buckets, np.concatenate(ids))

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """-> (part, index in the part)."""
        k = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return k, (index - int(self.offsets[k])) % len(self.parts[k])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        for part in self.parts:
            if hasattr(part, "set_epoch"):
                part.set_epoch(epoch)

    def __getitem__(self, index: int):
        k, j = self.locate(index)
        item = self.parts[k][j]
        if self.channels is not None and getattr(self.parts[k], "channels", None) not in (None, self.channels):
            item = (to_channels(item[0], self.channels), *(_controls_to(x, self.channels) for x in item[1:]))
        options = self.entries[k].captions
        if options and isinstance(item, tuple) and len(item) > 1 and isinstance(item[-1], str):  # its caption
            item = (*item[:-1], options.apply(item[-1], mix_seed(self.seed, self.epoch, index)))
        return item

    @property
    def weighted(self) -> bool:
        """Whether any dataset's batches weigh other than 1 in the loss."""
        return any(e.loss_weight != 1.0 for e in self.entries)

    def loss_weight(self, index: int) -> float:
        return self.entries[self.locate(index)[0]].loss_weight

    def caption(self, index: int):
        """Item index's caption with its dataset's trigger (what previews and validation show), None if none."""
        k, j = self.locate(index)
        caption_of = getattr(self.parts[k], "caption", None)
        caption = caption_of(j) if callable(caption_of) else None
        if caption is None or not self.entries[k].captions.trigger:
            return caption
        return CaptionOptions(trigger=self.entries[k].captions.trigger).apply(caption, 0)

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "parts":
            raise AttributeError(name)
        return getattr(self.parts[0], name)

    def summary(self, batch: int) -> str:
        """A table for the log: each dataset's items, repeats, share of an epoch and buckets."""
        total = max(len(self), 1)
        rows = [f"{'dataset':>24} {'kind':>16} {'items':>7} {'repeats':>7} {'share':>6} {'loss x':>6}  buckets (items)"]
        for k, (part, entry) in enumerate(zip(self.parts, self.entries)):
            ids = self.buckets.ids[self.offsets[k]:self.offsets[k + 1]]
            counts = {str(self.buckets.buckets[b]): int((ids == b).sum()) for b in np.unique(ids[ids >= 0])}
            shown = ", ".join(f"{size} ({n})" for size, n in counts.items())
            rows.append(f"{entry.name[-24:]:>24} {entry.settings['dataset']:>16} {len(part):>7} {entry.repeats:>7} "
                        f"{len(ids) / total:>6.1%} {entry.loss_weight:>6g}  {shown}")
        rows.append(f"{len(self)} items an epoch, in global batches of {batch} from one dataset bucket each")
        return "\n".join(rows)


def first_dataset(cfg, entries: list[DatasetEntry]):
    """cfg with --dataset and --data_path of the first dataset: what the family resolves the run's settings from
    (a latent cache's image size and VAE) before the data is loaded."""
    first = entries[0].settings
    return dataclasses.replace(cfg, dataset=first["dataset"], data_path=first["data_path"])


def load_mixture(cfg, entries: list[DatasetEntry], family, encoders) -> tuple[MixedDataset, object]:
    """The datasets `entries` (of cfg.dataset_config), each loaded by the family, mixed -> (the mixture, the run's
    cfg with the settings the data decides). Every dataset must decide them alike."""
    path = cfg.dataset_config
    parts, decided, sizes = [], None, []
    for entry in entries:
        part, settled = family.load_data(dataclasses.replace(cfg, **entry.settings), encoders)
        parts.append(part)
        sizes.append(settled.image_size)
        common = dataclasses.replace(settled, **{k: getattr(cfg, k) for k in entry.settings})
        if decided is not None and common != decided:
            differ = [f.name for f in dataclasses.fields(cfg) if getattr(common, f.name) != getattr(decided, f.name)]
            raise ValueError(f"{path}: dataset {entry.name!r} decides {', '.join(differ)} unlike the first dataset "
                             f"({', '.join(f'{k}={getattr(common, k)!r}' for k in differ)} against "
                             f"{', '.join(repr(getattr(decided, k)) for k in differ)}); mix data of one kind")
        decided = common
    return MixedDataset(parts, entries, sizes, cfg.global_seed), decided
