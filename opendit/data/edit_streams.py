"""Editing pairs from a sharded stream: `--dataset edit_webdataset | edit_parquet | edit_hf` give items as
EditPairsDataset does for folders, (target, controls [K, C, H, W], instruction). The target and the instruction are
found as a caption stream finds its image and caption (opendit/data/streaming.py), the controls by --control_key (see
EditStreamDataset)."""
import functools
import logging
from collections import Counter

import torch

from opendit.data.edit_pairs import numbered
from opendit.data.shard_sources import SOURCES, HFSource, ParquetShards, as_bytes
from opendit.data.spec import DatasetSpec
from opendit.data.streaming import PATHS, STREAM_SETTINGS, StreamDataset, Unusable, key_list, probe_channels

logger = logging.getLogger(__name__)

CONTROL_KEYS = "control.jpg,control.jpeg,control.png,control.webp,control_image,control_images,control"
PROBED = 32  # samples holding controls whose commonest count is a run's controls per target
PROBE_LIMIT = 1000  # samples read at most to find them


class EditStreamDataset(StreamDataset):
    """Editing pairs from a stream (kind: webdataset, parquet or hf): item = (target [C, H, W], controls [K, C, H, W],
    instruction), the target and the instruction found as a caption stream finds its image and caption.

    The controls are in the first of `control_key`'s candidates (comma-separated) a sample has: a field holding one
    encoded image (a tar member, an Image column) is one control, a list of them (a Parquet or datasets list column)
    several in its order; the numbered form of a candidate STEM.EXT (members or columns STEM_0.EXT, STEM_1.EXT, ...,
    any extension the candidates give STEM) is several in their numbers' order. A control is resized and cropped to
    its target's size (its bucket), at the target's crop position, and flipped with it; the size filters look at the
    target only. K (`controls_per_target`) is the commonest count among the first PROBED samples holding controls,
    read when the dataset is built; a sample without a control, or with another count, is skipped and counted."""

    def __init__(self, kind: str, spec: str, image_size: int, control_key: str | None = None, **options):
        self.control_keys = key_list(control_key, CONTROL_KEYS)
        self.stems: dict[str, set[str]] = {}  # a candidate's stem -> the extensions the candidates give it
        for key in self.control_keys:
            stem, _, ext = key.partition(".")
            self.stems.setdefault(stem, set()).add(ext)
        super().__init__(kind, spec, image_size, item="caption", **options)
        self._read_controls_encoded()
        self.controls_per_target = self._count_controls()

    def _number(self, name: str, stem: str) -> int:
        """name's number when it is the numbered form of a candidate of `stem` (STEM_N or STEM_N.EXT), else -1."""
        base, _, ext = name.partition(".")
        of, number = numbered(base)
        return number if of == stem and ext in self.stems[stem] else -1

    def _read_controls_encoded(self) -> None:
        """Parquet reads the columns named by the keys: add the candidates' numbered columns. A datasets table's
        lists of images are read as encoded bytes, as the source reads its Image columns."""
        if isinstance(self.source, ParquetShards):
            self.source.columns += tuple(name for name in self.source.schema_names
                                         if any(self._number(name, stem) >= 0 for stem in self.stems))
        if isinstance(self.source, HFSource):
            import datasets

            for name, feature in self.source.table.features.items():
                if name in self.control_keys and isinstance(feature, (datasets.List, datasets.LargeList)) and \
                        isinstance(feature.feature, datasets.Image):
                    self.source.table = self.source.table.cast_column(
                        name, type(feature)(datasets.Image(decode=False)))

    def _controls(self, fields: dict) -> list:
        """A sample's control values (encoded images or datasets' {"bytes", "path"}) in order; [] when it has none."""
        for key in self.control_keys:
            value = fields.get(key)
            found = list(value) if isinstance(value, (list, tuple)) else [] if value is None else [value]
            if not found:
                stem = key.partition(".")[0]
                found = [fields[name] for n, name in sorted((self._number(name, stem), name) for name in fields)
                         if n >= 0 and fields[name] is not None]
            if found:
                return found
        return []

    def _count_controls(self) -> int:
        counts = []
        for i in range(min(len(self), PROBE_LIMIT)):
            try:
                found = self._controls(self.source.fields(i))
            except Exception:  # noqa: BLE001 - an unreadable sample is skipped and counted when met in training
                continue
            counts += [len(found)] if found else []
            if len(counts) == PROBED:
                break
        if not counts:
            raise ValueError(f"{self.format} {self.data_path!r}: none of its first {min(len(self), PROBE_LIMIT)} "
                             f"samples holds a control (looked for {', '.join(self.control_keys)} and their numbered "
                             f"forms, e.g. control_0.png); set --control_key to the member extensions or columns "
                             f"holding them")
        count, seen = Counter(counts).most_common(1)[0]
        logger.info("%s %s: %d control(s) per target (%d of its first %d samples with controls have as many; others "
                    "are skipped)", self.format, self.data_path, count, seen, len(counts))
        return count

    def _item(self, fields: dict, i: int, index: int):
        controls = self._controls(fields)
        if not controls:
            raise Unusable(f"no control (looked for {', '.join(self.control_keys)} and their numbered forms; set "
                           f"--control_key)")
        if len(controls) != self.controls_per_target:
            raise Unusable(f"{len(controls)} controls where this run's samples have {self.controls_per_target} (a "
                           f"batch holds as many of each; give every sample as many)")
        data = [as_bytes(c) for c in controls]
        if any(d is None for d in data):
            raise Unusable("a control field holds no bytes")
        target, caption = super()._item(fields, i, index)
        return target, torch.stack([self._image(d, i, index, check=False) for d in data]), caption

    def _all_unreadable(self, n: int) -> str:
        return self.skips.all_unreadable(f"all {n} samples of {self.format} {self.data_path!r}", "edit_digits")


EDIT_HELPS = {"webdataset": "editing pairs in WebDataset tar shards: KEY.jpg the target, KEY.txt the instruction, "
                            "KEY.control.png (or KEY.control_0.png, KEY.control_1.png, ...) the controls",
              "parquet": "editing pairs in Parquet files: target image, instruction and control image (or list of "
                         "images) columns",
              "hf": "editing pairs in a Hugging Face datasets table: target Image, instruction and control Image (or "
                    "list of Image) columns"}
EDIT_STREAMS = tuple(DatasetSpec(f"edit_{kind}", EDIT_HELPS[kind], functools.partial(EditStreamDataset, kind),
                                 path=PATHS[kind], demo="edit_digits", settings=STREAM_SETTINGS + ("control_key",),
                                 pattern=True, probe=functools.partial(probe_channels, kind), pairs=True)
                     for kind in SOURCES)
