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


def sincos_2d(dim: int, grid_size: int) -> torch.Tensor:
    """[grid_size**2, dim]; half the channels encode the column (w), half the row (h), as DiT does."""
    if dim % 4:
        raise ValueError(f"2-D sin-cos embedding dim must be divisible by 4, got {dim}")
    coords = np.arange(grid_size, dtype=np.float64)
    grid_w, grid_h = np.meshgrid(coords, coords)  # DiT: w goes first
    emb = np.concatenate([sincos_1d(dim // 2, grid_w), sincos_1d(dim // 2, grid_h)], axis=1)
    return torch.from_numpy(emb).float()


def sincos_temporal(dim: int, length: int) -> torch.Tensor:
    """[length, dim]: frames 0..length-1 by sincos_1d (Latte's get_1d_sincos_temp_embed, OpenDiT's temporal
    position embedding)."""
    return torch.from_numpy(sincos_1d(dim, np.arange(length, dtype=np.float64))).float()
