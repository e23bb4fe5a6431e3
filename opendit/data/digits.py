"""scikit-learn's handwritten digits (1,797 real 8x8 scans, 10 classes) as a tiny demo dataset.

It ships inside scikit-learn, so the demo and the quality benchmark run offline on a laptop.
"""
import gzip
import importlib.util
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from opendit.data.spec import DatasetSpec
from opendit.data.transforms import check_image_size, to_signed_tensor

NUM_DIGITS = 1797
SPLITS = ("all", "train", "held_out")
DIGITS_HELP = "e.g. 0-4 or 5,7,9"


def parse_digits(spec: str) -> tuple[int, ...]:
    """A digit subset: "0-4" -> (0, 1, 2, 3, 4), "5,7-9" -> (5, 7, 8, 9); ValueError naming the spec otherwise."""
    found = set()
    for part in str(spec).replace(" ", "").split(","):
        first, dash, last = part.partition("-")
        if not (first.isdigit() and len(first) == 1 and (not dash or (last.isdigit() and len(last) == 1))):
            raise ValueError(f"--digits {spec}: must list digits 0..9 and ranges, {DIGITS_HELP}")
        low, high = int(first), int(last) if dash else int(first)
        if low > high:
            raise ValueError(f"--digits {spec}: the range {part} is empty; write it low-high, {DIGITS_HELP}")
        found.update(range(low, high + 1))
    return tuple(sorted(found))


def _load_raw():
    """-> images float32 [1797, 8, 8] (ink counts 0..16), labels int64 [1797] (0..9): scikit-learn's digits.csv.gz
    (64 pixels and the label per row) read directly, without importing scikit-learn (1.3 s per process: every
    launched worker of a demo run paid it); load_digits reads the same file, and serves where it moved."""
    package = importlib.util.find_spec("sklearn")
    csv = Path(package.submodule_search_locations[0], "datasets", "data", "digits.csv.gz") if package else None
    if csv is None or not csv.is_file():
        from sklearn.datasets import load_digits
        bunch = load_digits()
        return bunch.images.astype(np.float32), bunch.target.astype(np.int64)
    with gzip.open(csv, "rt") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.float32)
    return rows[:, :-1].reshape(-1, 8, 8).copy(), rows[:, -1].astype(np.int64)


def digits_split(held_out_fraction: float = 0.2, seed: int = 0):
    """Deterministic stratified split of the raw digits for the quality benchmark's classifier.

    Returns ((train_images, train_labels), (held_out_images, held_out_labels)); images are float32
    [N, 8, 8] with values 0..16, labels int64 [N]. Same (fraction, seed) -> same split everywhere.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    from sklearn.model_selection import train_test_split

    images, labels = _load_raw()
    x_train, x_held, y_train, y_held = train_test_split(
        images, labels, test_size=held_out_fraction, random_state=seed, stratify=labels)
    return (x_train, y_train), (x_held, y_held)


class DigitsDataset(Dataset):
    """Digits upscaled to image_size: item = (float32 [channels, S, S] in [-1, 1], int label).

    Ink is white on black (0 -> -1, 16 -> 1). channels=3 repeats the grey plane so RGB models
    (and a VAE) can use it. split="train"/"held_out" use `digits_split`'s default split. digits: keep only
    these digits (e.g. (0, 1, 2, 3, 4)); labels stay the digits and num_classes 10. No flips: a mirrored digit
    is a different (or no) digit.
    """

    num_classes = 10

    def __init__(self, image_size: int, channels: int = 1, split: str = "all", digits=None):
        self.image_size = check_image_size(image_size)
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {channels!r}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.channels = channels
        if split == "all":
            images, labels = _load_raw()
        else:
            train, held = digits_split()
            images, labels = train if split == "train" else held
        if digits is not None:
            self.digits = tuple(sorted({int(d) for d in digits}))
            if not self.digits or not all(0 <= d <= 9 for d in self.digits):
                raise ValueError(f"digits must be a non-empty subset of 0..9, got {digits!r}")
            keep = np.isin(labels, self.digits)
            images, labels = images[keep], labels[keep]
        else:
            self.digits = tuple(range(10))
        # 0..16 -> 0..255 uint8 once; upscaling happens per item (8x8 sources are cheap to resize)
        self._images = np.round(images * (255.0 / 16.0)).astype(np.uint8)  # [N, 8, 8]
        self._labels = labels

    def __len__(self) -> int:
        return len(self._labels)

    def __getitem__(self, index: int):
        image = Image.fromarray(self._images[index])  # 2-D uint8 -> mode "L"
        image = image.resize((self.image_size, self.image_size), resample=Image.BICUBIC)
        x = to_signed_tensor(image)  # [1, S, S]
        if self.channels == 3:
            x = x.expand(3, -1, -1).contiguous()
        return x, int(self._labels[index])


DIGITS = DatasetSpec("digits", "built in, no download: scikit-learn's 1,797 real 8x8 scans of handwritten digits, "
                               "10 classes", lambda path, size, **kw: DigitsDataset(size, **kw), channels=1)
