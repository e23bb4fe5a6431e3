"""Captioned images for text-to-image training: item = (float32 [C, S, S] in [-1, 1], str caption).

CaptionedImageDataset reads either
  - a folder of images, each with a same-stem `.txt` caption beside it (the kohya convention:
    photo.jpg + photo.txt), searched recursively; an image without a .txt is skipped (and counted), an
    empty .txt is an empty caption (an unconditional sample); or
  - a `.csv` (header `path,caption`) or `.jsonl` (one object per line with "path" or "file_name" and
    "caption" or "text") whose relative paths resolve against the file's folder.
Listed files that do not exist are skipped (and counted) when the dataset is built; corrupt images are
skipped when read, as in ImageFolderDataset: logged once, counted in `num_skipped`, their slot filled by the
next readable index.

CaptionedDigitsDataset is the built-in demo: scikit-learn's real digits, each captioned in words
("a handwritten seven", "the digit seven", ...).
"""
import csv
import json
import logging
import os

import numpy as np
import torch
from PIL import Image

from opendit.data.digits import DigitsDataset
from opendit.data.image_folder import IMAGE_EXTENSIONS, ImageFolderDataset, _unlistable
from opendit.data.spec import DatasetSpec
from opendit.data.skipped import SkipLog
from opendit.data.transforms import check_image_size
from opendit.seeding import mix_seed

logger = logging.getLogger(__name__)

PATH_KEYS = ("path", "file_name")
CAPTION_KEYS = ("caption", "text")
LAYOUT_HINT = ("expected a folder of images each with a same-stem .txt caption beside it (photo.jpg + photo.txt, "
               "subfolders searched), a .csv with the header `path,caption`, or a .jsonl of "
               "{\"path\" or \"file_name\": ..., \"caption\" or \"text\": ...} objects (relative paths resolve "
               "against the file's folder)")

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# "{a}" is the article that fits the word ("an eight"); variant v of a caption uses DIGIT_TEMPLATES[v]
DIGIT_TEMPLATES = ("a handwritten {w}", "the digit {w}", "{a} {w}", "a picture of the number {w}")
# every word the digit captions use: what a tiny word-level tokenizer must know
DIGIT_CAPTION_WORDS = ("a", "an", "handwritten", "the", "digit", "picture", "of", "number") + DIGIT_WORDS


def _clean(text: str) -> str:
    """Whitespace collapsed to single spaces (a multi-line caption becomes one line)."""
    return " ".join(str(text).split())


def scan_caption_folder(root: str, extension: str = ".txt") -> tuple[list[tuple[str, str]], int]:
    """-> ([(image path, caption)] sorted by path, number of images without a caption file (`extension`))."""
    samples, uncaptioned = [], 0
    walk = sorted(os.walk(root, onerror=_unlistable, followlinks=True), key=lambda entry: entry[0])  # same order
    for dirpath, _, filenames in walk:
        if any(part.startswith(".") for part in os.path.relpath(dirpath, root).split(os.sep) if part != "."):
            continue  # hidden folders (.git, .cache, ...) hold no training images
        for fname in sorted(filenames):
            if not fname.lower().endswith(IMAGE_EXTENSIONS) or fname.startswith("."):
                continue
            path = os.path.join(dirpath, fname)
            txt = os.path.splitext(path)[0] + extension
            if not os.path.isfile(txt):
                uncaptioned += 1
                continue
            try:
                with open(txt, encoding="utf-8", errors="replace") as f:
                    samples.append((path, _clean(f.read())))
            except OSError as err:  # permission denied, an I/O error: the image is left out, as without a .txt
                logger.warning("skipping image %s: cannot read its caption %s (%s: %s)", path, txt,
                               type(err).__name__, err.strerror or err)
                uncaptioned += 1
    return samples, uncaptioned


def _pick(record: dict, keys: tuple[str, ...], where: str):
    for key in keys:
        if key in record and record[key] is not None:
            return record[key]
    raise ValueError(f"{where} has no {' or '.join(repr(k) for k in keys)} field (it has {sorted(record)}); "
                     f"{LAYOUT_HINT}")


def read_caption_table(path: str) -> list[tuple[str, str]]:
    """A .csv or .jsonl of (path, caption) -> [(absolute image path, caption)] in file order."""
    folder = os.path.dirname(os.path.abspath(path))
    records = []
    if path.lower().endswith(".csv"):
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: drops the BOM spreadsheets write
            reader = csv.DictReader(f)
            fields = [(name or "").strip().lower() for name in (reader.fieldnames or [])]
            if not any(k in fields for k in PATH_KEYS) or not any(k in fields for k in CAPTION_KEYS):
                raise ValueError(f"{path!r} has the header {','.join(reader.fieldnames or [])!r}; {LAYOUT_HINT}")
            for line, row in enumerate(reader, start=2):
                row = {(k or "").strip().lower(): v for k, v in row.items()}
                if any((v or "").strip() for v in row.values() if isinstance(v, str)):
                    records.append((f"{path!r} line {line}", row))
    else:
        with open(path, encoding="utf-8-sig") as f:
            for line, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path!r} line {line} is not a JSON object ({err}); {LAYOUT_HINT}") from err
                if not isinstance(obj, dict):
                    raise ValueError(f"{path!r} line {line} is a {type(obj).__name__}, not an object; {LAYOUT_HINT}")
                records.append((f"{path!r} line {line}", obj))
    samples = []
    for where, record in records:
        image = str(_pick(record, PATH_KEYS, where)).strip()
        if not image:
            raise ValueError(f"{where} has an empty image path; {LAYOUT_HINT}")
        samples.append((os.path.join(folder, os.path.expanduser(image)), _clean(_pick(record, CAPTION_KEYS, where))))
    return samples


class CaptionedImageDataset(ImageFolderDataset):
    """item = (float32 [channels, S, S] in [-1, 1], str caption), ADM center crop, optional deterministic flip;
    with aspect-ratio buckets [channels, H, W] of the item's bucket (see ImageFolderDataset).

    data_path: a folder of images with .txt captions, or a .csv / .jsonl listing (see the module doc).
    channels=1 converts to grey (ITU-R 601 luma). The flip of item i in epoch e is a pure function of
    (seed, e, i): call `set_epoch(e)` before iterating. `num_uncaptioned` counts images of a folder without
    a .txt (or whose .txt cannot be read), `num_missing` listed files that do not exist (both skipped when built),
    `num_skipped` distinct unreadable images seen by this process (each DataLoader worker has its own;
    `count_skipped(dataset)` counts all workers' and ranks'). num_classes = 0: captions condition, not labels.
    """

    num_classes = 0

    def __init__(self, data_path: str, image_size: int, channels: int = 3, random_flip: bool = False,
                 seed: int = 0, caption_extension: str = ".txt"):
        self.data_path = self.root = os.fspath(data_path)  # (not ImageFolderDataset's __init__: no class folders)
        self.image_size = check_image_size(image_size)
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {channels!r}")
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed!r}")
        self.channels, self.random_flip, self.seed, self.epoch = channels, bool(random_flip), int(seed), 0
        self.num_uncaptioned = self.num_missing = 0
        if not caption_extension.startswith(".") or len(caption_extension) < 2:
            raise ValueError(f"caption_extension {caption_extension!r}: the caption file's extension, with its dot "
                             "(.txt, .caption)")
        if os.path.isdir(self.data_path):
            samples, self.num_uncaptioned = scan_caption_folder(self.data_path, caption_extension)
        elif os.path.isfile(self.data_path) and self.data_path.lower().endswith((".csv", ".jsonl")):
            listed = read_caption_table(self.data_path)
            samples = [(p, c) for p, c in listed if os.path.isfile(p)]
            self.num_missing = len(listed) - len(samples)
        elif os.path.isfile(self.data_path):
            raise ValueError(f"captioned data {self.data_path!r} is neither a folder, a .csv nor a .jsonl; "
                             f"{LAYOUT_HINT}")
        else:
            raise FileNotFoundError(f"captioned data {self.data_path!r} does not exist; pass --data_path pointing "
                                    f"to it ({LAYOUT_HINT}), or use --dataset captioned_digits for the built-in "
                                    f"demo")
        if self.num_uncaptioned:
            logger.warning("%s: skipping %d image(s) without a same-stem %s caption", self.data_path,
                           self.num_uncaptioned, caption_extension)
        if self.num_missing:
            logger.warning("%s: skipping %d listed image(s) that do not exist", self.data_path, self.num_missing)
        if not samples:
            raise ValueError(
                f"no captioned images in {self.data_path!r} ({self.num_uncaptioned} image(s) without a "
                f"{caption_extension}, "
                f"{self.num_missing} listed file(s) missing); {LAYOUT_HINT}. A folder with a metadata.jsonl / "
                f"metadata.csv instead of .txt files: pass that file as --data_path")
        self.samples = samples
        self.skips = SkipLog(self.skipped_kind, logger)

    @property
    def captions(self) -> list[str]:
        return [caption for _, caption in self.samples]

    def caption(self, index: int) -> str:
        return self.samples[index][1]

    def _load(self, path: str, width: int, height: int) -> Image.Image:
        image = super()._load(path, width, height)
        return image.convert("L") if self.channels == 1 else image

    def _all_unreadable(self, n: int) -> str:
        return self.skips.all_unreadable(f"all {n} captioned images of {self.data_path!r}", "captioned_digits")


def digit_caption(label: int, variant: int = 0) -> str:
    """The caption of a digit: label 0..9, variant indexes DIGIT_TEMPLATES (modulo its length).
    digit_caption(7, 0) == "a handwritten seven", digit_caption(8, 2) == "an eight"."""
    if not 0 <= int(label) < len(DIGIT_WORDS):
        raise ValueError(f"digit label must be in 0..9, got {label!r}")
    word = DIGIT_WORDS[int(label)]
    template = DIGIT_TEMPLATES[int(variant) % len(DIGIT_TEMPLATES)]
    return template.format(w=word, a="an" if word == "eight" else "a")  # by sound: "a one", "an eight"


class CaptionedDigitsDataset(DigitsDataset):
    """The digits demo with captions: item = (float32 [channels, S, S] in [-1, 1], str caption).

    Item i's caption uses template mix_seed(seed, i) % len(DIGIT_TEMPLATES): the same in every epoch and
    process. `labels` (int64 [N]) keeps the digit of each item for the quality benchmark's classifier; digits
    (e.g. (5, 6, 7, 8, 9)) keeps only those. num_classes = 0: captions condition, not labels.
    """

    num_classes = 0

    def __init__(self, image_size: int, channels: int = 1, seed: int = 0, split: str = "all", digits=None):
        super().__init__(image_size, channels=channels, split=split, digits=digits)
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed!r}")
        self.seed = int(seed)
        self.variants = np.array([mix_seed(self.seed, i) % len(DIGIT_TEMPLATES) for i in range(len(self))])
        self.captions = [digit_caption(label, v) for label, v in zip(self._labels, self.variants)]

    @property
    def labels(self) -> np.ndarray:
        return self._labels

    def caption(self, index: int) -> str:
        return self.captions[index]

    def preview_prompts(self, k: int) -> list[str]:
        """One caption per digit, the same template for all ("a handwritten zero", ...): the first k digits (of
        the subset it holds)."""
        return [digit_caption(d) for d in self.digits[:k]]

    def __getitem__(self, index: int):
        x, _ = super().__getitem__(index)
        return x, self.captions[index]


CAPTIONED_DIGITS = DatasetSpec("captioned_digits", "built in text-to-image demo: the digits captioned \"a handwritten "
                                                   "seven\", \"the digit seven\", ...",
                               lambda path, size, **kw: CaptionedDigitsDataset(size, **kw), channels=1)
CAPTIONS = DatasetSpec("captions", "images with a same-name .txt caption beside each (kohya's layout), or a CSV / "
                                   "JSONL of path,caption",
                       lambda path, size, **kw: CaptionedImageDataset(path, size, **kw),
                       path="folder of images with .txt captions, or a .csv / .jsonl of path,caption",
                       settings=("caption_extension",),
                       demo="captioned_digits")


CAPTION_SCAN = 2048  # items distinct_captions looks at


def distinct_captions(dataset, k: int) -> list[tuple[int, str]]:
    """The first k distinct non-empty captions of `dataset` among its first CAPTION_SCAN items, as (index,
    caption); [] when it has none (its caption(i) is missing or returns None)."""
    found: dict[str, int] = {}
    caption_of = getattr(dataset, "caption", None)
    if not callable(caption_of):
        return []
    for i in range(min(len(dataset), CAPTION_SCAN)):
        caption = caption_of(i)
        if caption is None:
            return []
        if caption.strip() and caption not in found:
            found[caption] = i
            if len(found) == k:
                break
    return [(i, c) for c, i in found.items()]


class LabelledCaptions(torch.utils.data.Dataset):
    """(image, caption) items -> (image, label, caption), the layout preprocess.py stores (label: the digit of
    the captioned digits, else 0)."""

    def __init__(self, dataset):
        self.dataset, self.labels = dataset, getattr(dataset, "labels", None)
        self.num_classes = 0

    @property
    def _bad(self):  # indices the dataset replaced because their file was unreadable
        return getattr(self.dataset, "_bad", ())

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        image, caption = self.dataset[i]
        return image, int(self.labels[i]) if self.labels is not None else 0, caption
