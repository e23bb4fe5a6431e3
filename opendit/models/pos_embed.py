"""Fixed sin-cos position embeddings (MAE / DiT layout), computed in float64 then cast."""
import numpy as np
import torch


def sincos_1d(dim: int, pos: np.ndarray) -> np.ndarray:
    """pos [M] -> [M, dim]: first half sin, second half cos (DiT's get_1d_sincos_pos_embed_from_grid)."""
    if dim % 2:
        raise ValueError(f"sin-cos embedding dim must be even, got {dim}")
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
    out = np.einsum("m,d->md", pos.reshape(-1).astype(np.float64), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def sincos_2d(dim: int, h: int, w: int | None = None) -> torch.Tensor:
    """[h*w, dim] for an h x w grid (w None: square), tokens in row-major (h, w) order; half the channels encode
    the column (w), half the row (h), as DiT and MAE's get_2d_sincos_pos_embed do. A token's embedding depends
    only on its (row, column), so an h x w table is the top-left crop of a larger square's."""
    if dim % 4:
        raise ValueError(f"2-D sin-cos embedding dim must be divisible by 4, got {dim}")
    w = h if w is None else w
    grid_w, grid_h = np.meshgrid(np.arange(w, dtype=np.float64), np.arange(h, dtype=np.float64))  # DiT: w first
    emb = np.concatenate([sincos_1d(dim // 2, grid_w), sincos_1d(dim // 2, grid_h)], axis=1)
    return torch.from_numpy(emb).float()


def sincos_temporal(dim: int, length: int) -> torch.Tensor:
    """[length, dim]: frames 0..length-1 by sincos_1d (Latte's get_1d_sincos_temp_embed, OpenDiT's temporal
    position embedding)."""
    return torch.from_numpy(sincos_1d(dim, np.arange(length, dtype=np.float64))).float()


class GridTables:
    """Sin-cos tables of grids other than the one a model stores (a frozen parameter with the official key),
    made once per (grid, device, dtype) and kept in a plain dict: nothing joins the state dict. make(*grid) ->
    the float32 table on the CPU."""

    def __init__(self, make):
        self.make, self.tables = make, {}

    def get(self, *grid: int, device, dtype) -> torch.Tensor:
        key = (*grid, torch.device(device), dtype)
        if key not in self.tables:
            self.tables[key] = self.make(*grid).to(device, dtype)
        return self.tables[key]
