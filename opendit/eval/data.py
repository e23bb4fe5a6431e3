"""What the metrics read: a samples / reference `.npz` (sample.py's and ADM's layout: uint8 images under `arr_0`,
[N, H, W, C] or video [N, T, H, W, C]; ADM's reference batches also carry precomputed `mu` / `sigma`) or a folder
of images. Arrays are streamed from the npz in batches, never loaded whole (50,000 256x256 images are 9.8 GB)."""
import zipfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator

import numpy as np
from PIL import Image

STATS_KEYS = ("mu", "sigma", "mu_s", "sigma_s", "num_images")  # reference statistics, not images
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")


class UserError(ValueError):
    """A bad path, file or flag: the CLI prints it as one `error:` line and exits with status 2."""


def _rgb(batch: np.ndarray) -> np.ndarray:
    """uint8 [B, H, W] / [B, H, W, 1] / [B, H, W, 3] / [B, H, W, 4] -> [B, H, W, 3]."""
    if batch.ndim == 3:
        batch = batch[..., None]
    if batch.shape[-1] == 1:
        return np.repeat(batch, 3, axis=-1)
    return batch[..., :3]


class _NpyMember:
    """One array of an .npz read sequentially from its zip member (stored or deflated), a few rows at a time."""

    def __init__(self, path: Path, key: str):
        self.path, self.key = path, key
        with zipfile.ZipFile(path) as archive, archive.open(f"{key}.npy") as f:
            self.shape, self.fortran, self.dtype = self._header(f)

    @staticmethod
    def _header(f):
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        return read(f)

    def rows(self, batch: int) -> Iterator[np.ndarray]:
        if self.fortran:  # np.savez never writes one; read it whole
            with np.load(self.path) as data:
                array = data[self.key]
            yield from (array[i:i + batch] for i in range(0, len(array), batch))
            return
        row_shape = self.shape[1:]
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * self.dtype.itemsize
        with zipfile.ZipFile(self.path) as archive, archive.open(f"{self.key}.npy") as f:
            self._header(f)
            for start in range(0, self.shape[0], batch):
                n = min(batch, self.shape[0] - start)
                data = f.read(n * row_bytes)
                if len(data) != n * row_bytes:
                    raise UserError(f"{self.path}: {self.key} is truncated")
                yield np.frombuffer(data, self.dtype).reshape(n, *row_shape)


@dataclass
class Images:
    """A set of images to take features of: `count` images (video frames flattened: clips * frames)."""
    path: Path
    count: int
    frames: int | None  # frames per clip for a video npz, else None
    _member: _NpyMember | None = None
    _files: list | None = None

    @property
    def num_samples(self) -> int:
        return self.count // (self.frames or 1)

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        """uint8 [B, H, W, 3] batches in order (a video's frames clip by clip); a folder's batches hold images of
        one size (a batch ends early where the size changes)."""
        if self._member is not None:
            per_row = self.frames or 1
            for rows in self._member.rows(max(1, batch_size // per_row)):
                frames = rows.reshape(-1, *rows.shape[2:]) if self.frames else rows
                yield _rgb(frames)
            return
        pending: list[np.ndarray] = []
        for file in self._files:
            try:
                image = np.asarray(Image.open(file).convert("RGB"))
            except OSError as e:
                raise UserError(f"{file}: not a readable image ({e})") from None
            if pending and (image.shape != pending[0].shape or len(pending) == batch_size):
                yield np.stack(pending)
                pending = []
            pending.append(image)
        if pending:
            yield np.stack(pending)


def npz_keys(path: Path) -> list[str]:
    try:
        with zipfile.ZipFile(path) as archive:
            return [n[:-4] for n in archive.namelist() if n.endswith(".npy")]
    except (zipfile.BadZipFile, OSError) as e:
        raise UserError(f"{path}: not a readable .npz ({e})") from None


def _image_key(path: Path, keys: list[str]) -> str | None:
    """The images' key: arr_0 (np.savez's first positional array: sample.py's and ADM's), else the only array
    that is not statistics."""
    if "arr_0" in keys:
        return "arr_0"
    rest = [k for k in keys if k not in STATS_KEYS]
    return rest[0] if len(rest) == 1 else None


def open_images(path, what: str = "--samples") -> Images:
    """An npz's images (arr_0) or a folder's image files (recursively, sorted)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        if not files:
            raise UserError(f"{what} {path}: no images ({', '.join(IMAGE_EXTENSIONS)}) in the folder")
        return Images(path, len(files), None, _files=files)
    if not path.exists():
        raise UserError(f"{what} {path}: no such file or folder")
    if path.suffix != ".npz":
        raise UserError(f"{what} {path}: expected a .npz (sample.py --npz writes samples.npz) or a folder of images")
    keys = npz_keys(path)
    key = _image_key(path, keys)
    if key is None:
        raise UserError(f"{what} {path}: no image array in it (keys: {', '.join(keys) or 'none'}; expected arr_0)")
    member = _NpyMember(path, key)
    shape = member.shape
    if len(shape) not in (3, 4, 5) or (len(shape) >= 4 and shape[-1] not in (1, 3, 4)) or member.dtype != np.uint8:
        raise UserError(f"{what} {path}: {key} is {member.dtype} {list(shape)}; expected uint8 [N, H, W, 3] "
                        "(or video [N, T, H, W, 3])")
    frames = shape[1] if len(shape) == 5 else None
    count = shape[0] * (frames or 1)
    if count < 1:
        raise UserError(f"{what} {path}: {key} holds no images")
    return Images(path, count, frames, _member=member)


@dataclass
class RefStats:
    """Precomputed reference statistics (ADM's reference batch layout: `mu` [D], `sigma` [D, D])."""
    path: Path
    mu: np.ndarray
    sigma: np.ndarray


def open_ref_stats(path) -> RefStats | None:
    """The `mu` / `sigma` of an .npz that has them, else None."""
    path = Path(path)
    if path.is_dir() or path.suffix != ".npz" or not path.exists():
        return None
    keys = npz_keys(path)
    if "mu" not in keys or "sigma" not in keys:
        return None
    with np.load(path) as data:
        mu, sigma = data["mu"].astype(np.float64), data["sigma"].astype(np.float64)
    if mu.ndim != 1 or sigma.shape != (len(mu), len(mu)):
        raise UserError(f"--ref {path}: mu {list(mu.shape)} / sigma {list(sigma.shape)} are not [D] / [D, D]")
    return RefStats(path, mu, sigma)


def save_stats(path, mu: np.ndarray, sigma: np.ndarray, **extra) -> None:
    """Write `mu` / `sigma` (and any extra arrays) in the reference-batch layout --ref reads."""
    np.savez(path, mu=mu, sigma=sigma, **extra)
