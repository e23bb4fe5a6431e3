"""What sampling writes, per kind of sample: images (PNG each, a grid, an npz) and clips (MP4 and a lossless
PNG strip each, a grid, an animated GIF, an npz). Each process writes its own samples with write(index,
sample); rank 0 calls finish(num, conditions) once all have. Sample i is conditioned on
conditions[i % len(conditions)] (a class label, a prompt, None), so the grids put equal conditions together;
grid.png is at the samples' resolution and grid_large.png, when the tiles are under LARGE_TILE_PX, the same
grid upscaled (nearest neighbour, an integer factor) to be seen."""
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


GRID_COLS, GRID_ROWS, GRID_TILES = 16, 32, 256  # at most per row, rows, tiles in grid.png
LARGE_TILE_PX, LARGE_MAX_PX = 128, 8192  # grid_large.png: tiles upscaled to >= 128 px, sides kept <= 8192 px


def _key(condition):
    return condition if isinstance(condition, (int, float, str, type(None))) else repr(condition)


def group_by_condition(indices, conditions: list) -> dict:
    """Sample indices -> {condition: its indices in order}, the conditions in order of first appearance."""
    groups = {}
    for i in indices:
        groups.setdefault(_key(conditions[i % len(conditions)]), []).append(i)
    return groups


def grid_rows(num: int, conditions: list) -> list[list[int]]:
    """The sample indices grid.png shows, row by row: one row per condition (up to GRID_COLS of its samples,
    up to GRID_ROWS conditions, GRID_TILES in all). Where that says nothing (a single condition, or one sample
    per condition), samples in index order fill rows: a square-ish grid, or a row of up to GRID_COLS."""
    groups = list(group_by_condition(range(num), conditions).values())
    width = max(len(g) for g in groups)
    if len(groups) == 1 or width == 1:
        shown = min(num, GRID_TILES)
        ncol = math.ceil(math.sqrt(shown)) if len(groups) == 1 else min(len(groups), GRID_COLS)
        return [list(range(r, min(r + ncol, shown))) for r in range(0, shown, ncol)]
    width = min(width, GRID_COLS)
    return [g[:width] for g in groups[:min(GRID_ROWS, GRID_TILES // width)]]


def large_factor(tile_px: int, grid_px: int) -> int:
    """The integer upscale of grid_large.png: tiles to at least LARGE_TILE_PX (1: they are already), the grid's
    longer side kept under LARGE_MAX_PX."""
    want = math.ceil(LARGE_TILE_PX / max(tile_px, 1))
    return max(1, min(want, LARGE_MAX_PX // max(grid_px, 1)))


def save_grid(grid: np.ndarray, out: Path, tile_px: int) -> list[str]:
    """grid.png in out; grid_large.png next to it when the tiles are small -> the names written."""
    Image.fromarray(grid).save(out / "grid.png")
    factor = large_factor(tile_px, max(grid.shape[:2]))
    if factor == 1:
        return ["grid.png"]
    Image.fromarray(grid.repeat(factor, axis=0).repeat(factor, axis=1)).save(out / "grid_large.png")
    return ["grid.png", "grid_large.png"]


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
        written = save_grid(_tile_rows(rows), self.out, tile_px=min(rows[0][0].shape[:2])) + ["images/"]
        if self.npz:  # uint8 [N, H, W, 3], the layout of ADM's evaluation suite
            arr = np.stack([_read_rgb(p) for p in paths])
            np.savez(self.out / "samples.npz", arr_0=arr)
            written.append("samples.npz")
        return written


def _rgb(frames: np.ndarray) -> np.ndarray:
    """uint8 [..., 1 or 3] -> [..., 3]."""
    return np.repeat(frames, 3, axis=-1) if frames.shape[-1] == 1 else frames


class VideoWriter:
    """videos/NNNNNN.mp4 and strips/NNNNNN.png (the frames side by side, lossless) per clip; then grid.png (one
    strip per row: the first 16 clips, those of one condition together), grid_large.png (that grid upscaled,
    when the frames are under 128 px), grid.gif (the first 16 clips tiled, animated) and with npz samples.npz
    (uint8 [N, T, H, W, 3], read back from the lossless strips)."""

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
        strip = _read_rgb(self.strip_path(index))  # [H, T*W, 3]
        return np.stack(np.split(strip, frames, axis=1))

    def finish(self, num: int, conditions: list) -> list[str]:
        height, width = np.asarray(Image.open(self.strip_path(0))).shape[:2]
        frames = width // height  # frames are square (center-cropped to --image_size): T = width / height
        shown = [i for group in group_by_condition(range(min(num, 16)), conditions).values() for i in group]
        grid = save_grid(_tile_rows([[_read_rgb(self.strip_path(i))] for i in shown]), self.out, tile_px=height)
        clips = [self._clip(i, frames) for i in range(min(num, 16))]
        ncol = math.ceil(math.sqrt(len(clips)))
        tiles = np.stack([_tile([c[t] for c in clips], ncol) for t in range(frames)])  # [T, H', W', 3]
        write_gif(self.out / "grid.gif", tiles, fps=self.fps)
        written = (["videos/"] if self.mp4 else []) + ["strips/"] + grid + ["grid.gif"]
        if self.npz:
            np.savez(self.out / "samples.npz", arr_0=np.stack([self._clip(i, frames) for i in range(num)]))
            written.append("samples.npz")
        return written


def _tile(images: list[np.ndarray], ncol: int) -> np.ndarray:
    """Equal-sized uint8 [H, W, 3] images, ncol a row -> one grid (see _tile_rows)."""
    return _tile_rows([images[r:r + ncol] for r in range(0, len(images), ncol)])


def _tile_rows(rows: list[list[np.ndarray]]) -> np.ndarray:
    """Rows of equal-sized uint8 [H, W, 3] images -> one [rows*(H+2)+2, ncol*(W+2)+2, 3] grid on white (ncol:
    the longest row; shorter rows end in white)."""
    h, w, _ = rows[0][0].shape
    ncol = max(len(row) for row in rows)
    grid = np.full((len(rows) * (h + 2) + 2, ncol * (w + 2) + 2, 3), 255, np.uint8)
    for r, row in enumerate(rows):
        for c, im in enumerate(row):
            grid[2 + r * (h + 2): 2 + r * (h + 2) + h, 2 + c * (w + 2): 2 + c * (w + 2) + w] = im
    return grid
