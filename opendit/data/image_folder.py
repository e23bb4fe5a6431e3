"""ImageNet-style class folders: root/<class_name>/<image>, labels = sorted class names.

Corrupt files never stop an epoch: a bad file (unreadable, truncated, zero bytes, not an image, permission
denied, or over PIL's decompression-bomb limit) is logged once, counted, and its slot is filled by the next
readable index, so every batch keeps its full size (see opendit/data/skipped.py; `count_skipped(dataset)` totals
the skips of all DataLoader workers and ranks). Images over PIL.Image.MAX_IMAGE_PIXELS pixels are skipped even
in the range where PIL only warns (up to twice the limit): decoding them could take gigabytes per worker.
Class folders without images keep their label (labels stay the sorted class names) and are named in a warning.
"""
import logging
import os
import warnings

from PIL import Image
from torch.utils.data import Dataset

from opendit.data.buckets import Bucketable
from opendit.data.spec import DatasetSpec
from opendit.data.skipped import SkipLog, first_readable
from opendit.data.transforms import check_image_size, resize_crop, to_signed_tensor
from opendit.seeding import mix_seed

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
LAYOUT_HINT = "expected layout: <data_path>/<class_name>/<image>.jpg|jpeg|png|bmp|webp, one folder per class"


def scan_image_folder(root: str):
    """-> (class_names sorted, [(path, label)] sorted by class then file name)."""
    if not os.path.isdir(root):
        raise FileNotFoundError(
            f"data path {root!r} does not exist or is not a folder; pass --data_path pointing to an "
            f"ImageNet-style folder ({LAYOUT_HINT}), or use --dataset digits for the built-in demo set")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise FileNotFoundError(f"no class folders found in {root!r}; {LAYOUT_HINT}")
    samples, empty = [], []
    for label, name in enumerate(classes):
        count = len(samples)
        # walk recursively, like torchvision's ImageFolder; sort so the order is the same on every rank
        walk = sorted(os.walk(os.path.join(root, name), onerror=_unlistable, followlinks=True),
                      key=lambda entry: entry[0])
        for dirpath, _, filenames in walk:
            for fname in sorted(filenames):
                if fname.lower().endswith(IMAGE_EXTENSIONS):
                    samples.append((os.path.join(dirpath, fname), label))
        if len(samples) == count:
            empty.append(name)
    if not samples:
        raise FileNotFoundError(f"no images found under {root!r} ({len(classes)} class folders); {LAYOUT_HINT}")
    if empty:
        shown = ", ".join(repr(name) for name in empty[:20]) + (f" and {len(empty) - 20} more" * (len(empty) > 20))
        logger.warning("%s: %d of %d class folders hold no images (%s); they keep their labels (labels are the "
                       "sorted folder names) but no sample has them: add images or remove the folders", root,
                       len(empty), len(classes), shown)
    return classes, samples


def _unlistable(err: OSError) -> None:
    """os.walk's onerror: a folder that cannot be listed (permissions) is named, not silently left out."""
    logger.warning("skipping folder %s: cannot list it (%s: %s); check its permissions", err.filename,
                   type(err).__name__, err.strerror or err)


class ImageFolderDataset(Bucketable, Dataset):
    """item = (float32 [3, S, S] in [-1, 1], int label), ADM center crop, optional deterministic flip; with
    aspect-ratio buckets (`use_buckets`) [3, H, W] of the item's bucket, resized to cover it and center-cropped.

    The flip of item i in epoch e is a pure function of (seed, e, i): call `set_epoch(e)` before
    iterating (non-persistent DataLoader workers copy the dataset, epoch included, at each iter()).
    `num_skipped` counts distinct unreadable files seen by this process (each worker has its own copy);
    `count_skipped(dataset)` (opendit.data.skipped) counts those of all workers and ranks.
    """

    skipped_kind = "image"  # the noun of the skip warnings

    def __init__(self, root: str, image_size: int, random_flip: bool = True, seed: int = 0):
        self.root = root
        self.image_size = check_image_size(image_size)
        self.random_flip = random_flip
        self.seed = int(seed)
        self.epoch = 0
        self.classes, self.samples = scan_image_folder(root)
        self.num_classes = len(self.classes)
        self.channels = 3
        self.skips = SkipLog(self.skipped_kind, logger)

    @property
    def _bad(self) -> set:
        """Indices this process found unreadable: skipped without re-reading or re-warning."""
        return self.skips.bad

    @property
    def num_skipped(self) -> int:
        return len(self.skips.bad)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.samples)

    def item_size(self, index: int) -> tuple[int, int, None] | None:
        """(width, height, None) from the file's header (nothing decoded); None when it cannot be read."""
        try:
            with Image.open(self.samples[index][0]) as image:
                return image.size[0], image.size[1], None
        except Exception:  # noqa: BLE001 - any unreadable file: left out of the buckets, as a bad file is skipped
            return None

    def _load(self, path: str, width: int, height: int) -> Image.Image:
        with warnings.catch_warnings():
            # PIL warns (does not raise) between MAX_IMAGE_PIXELS and twice that: skip those too
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                image.load()  # decode now so truncated files fail here, not later
                image = image.convert("RGB")
        return resize_crop(image, width, height)

    def _flip(self, index: int) -> bool:
        return self.random_flip and mix_seed(self.seed, self.epoch, index) & 1 == 1

    def _read(self, i: int, index: int):
        path, label = self.samples[i]
        image = self._load(path, *self.target_size(i, self.image_size))
        # the flip keys on the requested index, so a replacement does not shift other items' flips
        if self._flip(index):
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return to_signed_tensor(image), label

    def __getitem__(self, index: int):
        return first_readable(self, index, lambda i: self._read(i, index))

    def _all_unreadable(self, n: int) -> str:
        return self.skips.all_unreadable(f"all {n} images under {self.root!r}", "digits")


FOLDER = DatasetSpec("folder", "ImageNet-style class folders (ADM center crop, random flip)",
                     lambda path, size, **kw: ImageFolderDataset(path, size, **kw),
                     path="folder of class folders", demo="digits")
