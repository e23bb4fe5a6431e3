"""ImageNet-style class folders: root/<class_name>/<image>, labels = sorted class names.

Corrupt files never stop an epoch: a bad file is logged once, counted in `num_skipped`, and its
slot is filled by the next readable index, so every batch keeps its full size.
"""
import logging
import os

from PIL import Image
from torch.utils.data import Dataset

from opendit.data.transforms import center_crop_arr, check_image_size, to_signed_tensor
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
    samples = []
    for label, name in enumerate(classes):
        # walk recursively, like torchvision's ImageFolder; sort so the order is the same on every rank
        walk = sorted(os.walk(os.path.join(root, name), followlinks=True), key=lambda entry: entry[0])
        for dirpath, _, filenames in walk:
            for fname in sorted(filenames):
                if fname.lower().endswith(IMAGE_EXTENSIONS):
                    samples.append((os.path.join(dirpath, fname), label))
    if not samples:
        raise FileNotFoundError(f"no images found under {root!r} ({len(classes)} class folders); {LAYOUT_HINT}")
    return classes, samples


class ImageFolderDataset(Dataset):
    """item = (float32 [3, S, S] in [-1, 1], int label), ADM center crop, optional deterministic flip.

    The flip of item i in epoch e is a pure function of (seed, e, i): call `set_epoch(e)` before
    iterating (non-persistent DataLoader workers copy the dataset, epoch included, at each iter()).
    `num_skipped` counts distinct unreadable files seen by this process (each worker has its own).
    """

    def __init__(self, root: str, image_size: int, random_flip: bool = True, seed: int = 0):
        self.root = root
        self.image_size = check_image_size(image_size)
        self.random_flip = random_flip
        self.seed = int(seed)
        self.epoch = 0
        self.classes, self.samples = scan_image_folder(root)
        self.num_classes = len(self.classes)
        self.channels = 3
        self._bad = set()  # indices already found unreadable: skipped without re-reading or re-warning

    @property
    def num_skipped(self) -> int:
        return len(self._bad)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.samples)

    def _load(self, path: str) -> Image.Image:
        with Image.open(path) as image:
            image.load()  # decode now so truncated files fail here, not later
            image = image.convert("RGB")
        return center_crop_arr(image, self.image_size)

    def _flip(self, index: int) -> bool:
        return self.random_flip and mix_seed(self.seed, self.epoch, index) & 1 == 1

    def __getitem__(self, index: int):
        n = len(self.samples)
        for offset in range(n):
            i = (index + offset) % n
            if i in self._bad:
                continue
            path, label = self.samples[i]
            try:
                image = self._load(path)
            # PIL raises many types for bad bytes (OSError, SyntaxError, ValueError, zlib.error,
            # DecompressionBombError...); any failure to decode one file must not end the epoch.
            except Exception as err:  # noqa: BLE001
                self._bad.add(i)
                logger.warning("skipping unreadable image %s: %s: %s", path, type(err).__name__, err)
                continue
            # the flip keys on the requested index, so a replacement does not shift other items' flips
            if self._flip(index):
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            return to_signed_tensor(image), label
        raise RuntimeError(self._all_unreadable(n))

    def _all_unreadable(self, n: int) -> str:
        return (f"all {n} images under {self.root!r} are unreadable (see the warnings above); "
                f"check the files, or use --dataset digits for the built-in demo set")
