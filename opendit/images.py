"""Pixels out: model outputs in [-1, 1] to uint8 images, and the grids that show many samples at once.

A grid tiles equal-sized uint8 [H, W, 3] images row by row on white, 2 px apart. Sampling (opendit.families.
writers) puts one condition per row (grid_rows); training previews lay out their own rows the same way. grid.png
is at the samples' resolution; grid_large.png, when the tiles are under LARGE_TILE_PX, the same grid upscaled
(nearest neighbour, an integer factor) to be seen.
"""
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")  # what sample.py's --image reads
GRID_COLS, GRID_ROWS, GRID_TILES = 16, 32, 256  # at most per row, rows, tiles in grid.png
LARGE_TILE_PX, LARGE_MAX_PX = 128, 8192  # grid_large.png: tiles upscaled to >= 128 px, sides kept <= 8192 px


def image_paths(path: str) -> list[Path]:
    """sample.py's --image: one image file (every prompt's), or a folder of them (one per prompt, in name order) ->
    their paths."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ValueError(f"--image {path}: the folder holds no image ({', '.join(IMAGE_SUFFIXES)})")
        return files
    if not p.is_file():
        raise ValueError(f"--image {path}: no such file or folder (give an image, or a folder of them, one per prompt "
                         f"in name order)")
    return [p]


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """Samples in [-1, 1], [n, C, ...] (images [n, C, H, W], clips [n, C, T, H, W]) -> uint8 numpy with the
    channels last ([n, H, W, C], [n, T, H, W, C])."""
    return ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).movedim(1, -1).cpu().numpy()


def rgb(x: np.ndarray) -> np.ndarray:
    """uint8 [..., 1, 3 or 4] -> [..., 3] (an alpha channel dropped: RGBA pipelines', Qwen-Image 2.1's)."""
    return np.repeat(x, 3, axis=-1) if x.shape[-1] == 1 else x[..., :3]


def upscale(x: np.ndarray, factor: int) -> np.ndarray:
    """Nearest-neighbour upscaling of [..., H, W, C] by an integer factor."""
    return x if factor == 1 else x.repeat(factor, axis=-3).repeat(factor, axis=-2)


def tile_rows(rows: list[list[np.ndarray]], gap: int = 2) -> np.ndarray:
    """Rows of equal-sized uint8 [H, W, 3] images -> one [rows*(H+gap)+gap, ncol*(W+gap)+gap, 3] grid on white
    (ncol: the longest row; shorter rows end in white)."""
    h, w, _ = rows[0][0].shape
    ncol = max(len(row) for row in rows)
    grid = np.full((len(rows) * (h + gap) + gap, ncol * (w + gap) + gap, 3), 255, np.uint8)
    for r, row in enumerate(rows):
        for c, im in enumerate(row):
            grid[gap + r * (h + gap): gap + r * (h + gap) + h, gap + c * (w + gap): gap + c * (w + gap) + w] = im
    return grid


def tile(images: list[np.ndarray], ncol: int, gap: int = 2) -> np.ndarray:
    """Equal-sized uint8 [H, W, 3] images in row-major order, ncol a row -> one grid (see tile_rows)."""
    return tile_rows([images[r:r + ncol] for r in range(0, len(images), ncol)], gap)


def strip(frames: list[np.ndarray], gap: int = 2) -> np.ndarray:
    """Frames [H, W, 3] side by side, gap px of white between them (none around)."""
    return tile(frames, len(frames), gap)[gap:-gap, gap:-gap]


def _condition_key(condition):
    return condition if isinstance(condition, (int, float, str, type(None))) else repr(condition)


def group_by_condition(indices, conditions: list) -> dict:
    """Sample indices -> {condition: its indices in order}, the conditions in order of first appearance."""
    groups = {}
    for i in indices:
        groups.setdefault(_condition_key(conditions[i % len(conditions)]), []).append(i)
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
