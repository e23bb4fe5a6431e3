"""What sampling writes, per kind of sample: images (PNG each, a grid, an npz) and clips (MP4 and a lossless
PNG strip each, a grid, an animated GIF, an npz). Each process writes its own samples with write(index,
sample); rank 0 calls finish(num, conditions) once all have. Sample i is conditioned on
conditions[i % len(conditions)] (a class label, a prompt, None), so the grids put equal conditions together
(the grid layout and grid_large.png: opendit.images)."""
import importlib.util
import logging
import math
from pathlib import Path

import numpy as np
from PIL import Image

from opendit.data.video_io import write_gif, write_mp4
from opendit.images import grid_rows, group_by_condition, rgb, save_grid, tile, tile_rows

logger = logging.getLogger("opendit")


def save_png(image: np.ndarray, path: Path) -> None:
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(path)


def _read_rgb(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


class ImageWriter:
    """images/NNNNNN.png per sample; then grid.png (one row per condition, up to 16 of its samples a row, up to
    32 rows; see grid_rows), grid_large.png (the grid upscaled, when the images are under 128 px) and with npz
    samples.npz (uint8 [N, H, W, 3], all samples in index order)."""

    def __init__(self, out: Path, npz: bool = False):
        self.out, self.npz = out, npz
        (out / "images").mkdir(parents=True, exist_ok=True)

    def path(self, index: int) -> Path:
        return self.out / "images" / f"{index:06d}.png"

    def write(self, index: int, image: np.ndarray) -> None:
        save_png(image, self.path(index))

    def finish(self, num: int, conditions: list) -> list[str]:
        paths = [self.path(i) for i in range(num)]
        rows = [[_read_rgb(paths[i]) for i in row] for row in grid_rows(num, conditions)]
        written = save_grid(tile_rows(rows), self.out, tile_px=min(rows[0][0].shape[:2])) + ["images/"]
        if self.npz:  # uint8 [N, H, W, 3], the layout of ADM's evaluation suite
            arr = np.stack([_read_rgb(p) for p in paths])
            np.savez(self.out / "samples.npz", arr_0=arr)
            written.append("samples.npz")
        return written


class VideoWriter:
    """videos/NNNNNN.mp4 and strips/NNNNNN.png (the frames side by side, lossless) per clip; then grid.png (one
    strip per row: the first 16 clips, those of one condition together), grid_large.png (that grid upscaled,
    when the frames are under 128 px), grid.gif (the first 16 clips tiled, animated) and with npz samples.npz
    (uint8 [N, T, H, W, 3], read back from the lossless strips). frames: T, needed when frames are not square."""

    def __init__(self, out: Path, npz: bool = False, fps: int = 8, frames: int | None = None):
        self.out, self.npz, self.fps, self.frames = out, npz, fps, frames
        self.mp4 = importlib.util.find_spec("av") is not None
        if not self.mp4:  # the lossless strips, the grids and the npz need no PyAV
            logger.warning("PyAV is not installed: no MP4s, only strips/, grid.png and grid.gif (pip install av)")

    def write_animation(self, path: Path, frames: np.ndarray) -> None:
        """frames uint8 [T, H, W, 3] -> path.gif, and path.mp4 with PyAV, at this writer's fps (training's
        previews of clips)."""
        write_gif(path.with_suffix(".gif"), frames, fps=self.fps)
        if self.mp4:
            write_mp4(path.with_suffix(".mp4"), frames, fps=self.fps)

    def strip_path(self, index: int) -> Path:
        return self.out / "strips" / f"{index:06d}.png"

    def write(self, index: int, clip: np.ndarray) -> None:
        """clip uint8 [T, H, W, C]."""
        for sub in ("videos", "strips"):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
        frames = rgb(clip)
        if self.mp4:
            write_mp4(self.out / "videos" / f"{index:06d}.mp4", frames, fps=self.fps)
        Image.fromarray(np.concatenate(list(frames), axis=1)).save(self.strip_path(index))

    def _clip(self, index: int, frames: int) -> np.ndarray:
        strip = _read_rgb(self.strip_path(index))  # [H, T*W, 3]
        return np.stack(np.split(strip, frames, axis=1))

    def finish(self, num: int, conditions: list) -> list[str]:
        height, width = np.asarray(Image.open(self.strip_path(0))).shape[:2]
        frames = self.frames or width // height  # unless told, frames are square: T = width / height
        shown = [i for group in group_by_condition(range(min(num, 16)), conditions).values() for i in group]
        grid = save_grid(tile_rows([[_read_rgb(self.strip_path(i))] for i in shown]), self.out, tile_px=height)
        clips = [self._clip(i, frames) for i in range(min(num, 16))]
        ncol = math.ceil(math.sqrt(len(clips)))
        tiles = np.stack([tile([c[t] for c in clips], ncol) for t in range(frames)])  # [T, H', W', 3]
        write_gif(self.out / "grid.gif", tiles, fps=self.fps)
        written = (["videos/"] if self.mp4 else []) + ["strips/"] + grid + ["grid.gif"]
        if self.npz:
            np.savez(self.out / "samples.npz", arr_0=np.stack([self._clip(i, frames) for i in range(num)]))
            written.append("samples.npz")
        return written
