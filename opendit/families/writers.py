"""What sampling writes, per kind of sample: images (PNG each, a grid, an npz) and clips (MP4 and a lossless
PNG strip each, a grid, an animated GIF, an npz). Each process writes its own samples with write(index,
sample); rank 0 calls finish(num, conditions) once all have."""
import importlib.util
import logging
import math
from pathlib import Path

import numpy as np
from PIL import Image

from opendit.data.video_io import write_gif, write_mp4

logger = logging.getLogger("opendit")


def save_png(image: np.ndarray, path: Path) -> None:
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(path)


def write_grid(paths: list[Path], out: Path, ncol: int) -> None:
    Image.fromarray(_tile([np.asarray(Image.open(p).convert("RGB")) for p in paths], ncol)).save(out)


class ImageWriter:
    """images/NNNNNN.png per sample; then grid.png (one column per condition, up to 16) and samples.npz."""

    def __init__(self, out: Path, npz: bool = False):
        self.out, self.npz = out, npz
        (out / "images").mkdir(parents=True, exist_ok=True)

    def path(self, index: int) -> Path:
        return self.out / "images" / f"{index:06d}.png"

    def write(self, index: int, image: np.ndarray) -> None:
        save_png(image, self.path(index))

    def finish(self, num: int, conditions: list) -> list[str]:
        paths = [self.path(i) for i in range(num)]
        ncol = min(len(conditions), 16) if len(conditions) > 1 else math.isqrt(num)
        write_grid(paths[:256], self.out / "grid.png", ncol=max(ncol, 1))
        written = ["grid.png", "images/"]
        if self.npz:  # uint8 [N, H, W, 3], the layout of ADM's evaluation suite
            arr = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in paths])
            np.savez(self.out / "samples.npz", arr_0=arr)
            written.append("samples.npz")
        return written


def _rgb(frames: np.ndarray) -> np.ndarray:
    """uint8 [..., 1 or 3] -> [..., 3]."""
    return np.repeat(frames, 3, axis=-1) if frames.shape[-1] == 1 else frames


class VideoWriter:
    """videos/NNNNNN.mp4 and strips/NNNNNN.png (the frames side by side, lossless) per clip; then grid.png (one
    strip per row, up to 16), grid.gif (up to 16 clips tiled, animated) and with npz samples.npz (uint8
    [N, T, H, W, 3], read back from the lossless strips)."""

    def __init__(self, out: Path, npz: bool = False, fps: int = 8):
        self.out, self.npz, self.fps = out, npz, fps
        self.mp4 = importlib.util.find_spec("av") is not None
        if not self.mp4:  # the lossless strips, the grids and the npz need no PyAV
            logger.warning("PyAV is not installed: no MP4s, only strips/, grid.png and grid.gif (pip install av)")
        for sub in ("videos", "strips"):
            (out / sub).mkdir(parents=True, exist_ok=True)

    def strip_path(self, index: int) -> Path:
        return self.out / "strips" / f"{index:06d}.png"

    def write(self, index: int, clip: np.ndarray) -> None:
        """clip uint8 [T, H, W, C]."""
        frames = _rgb(clip)
        if self.mp4:
            write_mp4(self.out / "videos" / f"{index:06d}.mp4", frames, fps=self.fps)
        Image.fromarray(np.concatenate(list(frames), axis=1)).save(self.strip_path(index))

    def _clip(self, index: int, frames: int) -> np.ndarray:
        strip = np.asarray(Image.open(self.strip_path(index)).convert("RGB"))  # [H, T*W, 3]
        return np.stack(np.split(strip, frames, axis=1))

    def finish(self, num: int, conditions: list) -> list[str]:
        height, width = np.asarray(Image.open(self.strip_path(0))).shape[:2]
        frames = width // height  # frames are square (center-cropped to --image_size): T = width / height
        write_grid([self.strip_path(i) for i in range(min(num, 16))], self.out / "grid.png", ncol=1)
        clips = [self._clip(i, frames) for i in range(min(num, 16))]
        ncol = math.ceil(math.sqrt(len(clips)))
        tiles = np.stack([_tile([c[t] for c in clips], ncol) for t in range(frames)])  # [T, H', W', 3]
        write_gif(self.out / "grid.gif", tiles, fps=self.fps)
        written = (["videos/"] if self.mp4 else []) + ["strips/", "grid.png", "grid.gif"]
        if self.npz:
            np.savez(self.out / "samples.npz", arr_0=np.stack([self._clip(i, frames) for i in range(num)]))
            written.append("samples.npz")
        return written


def _tile(images: list[np.ndarray], ncol: int) -> np.ndarray:
    """Equal-sized uint8 [H, W, 3] images -> one [rows*(H+2)+2, ncol*(W+2)+2, 3] grid on white."""
    h, w, _ = images[0].shape
    rows = math.ceil(len(images) / ncol)
    grid = np.full((rows * (h + 2) + 2, ncol * (w + 2) + 2, 3), 255, np.uint8)
    for i, im in enumerate(images):
        r, c = divmod(i, ncol)
        grid[2 + r * (h + 2): 2 + r * (h + 2) + h, 2 + c * (w + 2): 2 + c * (w + 2) + w] = im
    return grid
