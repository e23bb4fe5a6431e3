"""How a frozen diffusers VAE (AutoencoderKL, AutoencoderKLWan) decodes: its own tiling at a chosen tile size, a
bounded number of rows (images, frames, clips) per decoder call, and the work split over the ranks that hold the same
latents (the ranks of one of sample.py's sequence- or CFG-parallel groups).

Tiling is diffusers' `tiled_decode`: the latent is cut into overlapping square tiles, each decoded alone, and the
overlaps are blended linearly. The decoder's activations are then one tile's, but a pixel near a seam sees less
context than in one pass, so a tiled decode differs from the plain one (tests/test_vae_decode.py states by how much);
a latent that fits one tile is decoded whole.

Splitting over a group gives what one process decoding the same way gives: rows are independent (SD's VAE decodes a
clip frame by frame), and so are tiles, which every rank then blends with diffusers' own tiled_decode. Wan's causal
3-D VAE is never split in time: each latent frame's decode reads the cached features of the frames before it.
"""
import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DecodeOptions:
    """tiling: diffusers' tiled decode of latents larger than a tile; tile_size: a tile's side in pixels (None: the
    VAE's own: its config's sample_size for AutoencoderKL, 256 for Wan); batch: rows per decoder call; group: the
    ranks holding the same latents, which split the work (None: this process decodes everything)."""
    tiling: bool = False
    tile_size: int | None = None
    batch: int = 64
    group: Any = None


def _is_wan(vae) -> bool:
    return type(vae).__name__ == "AutoencoderKLWan"


def _downsampling(vae) -> int:
    return vae.spatial_compression_ratio if _is_wan(vae) else 2 ** (len(vae.config.block_out_channels) - 1)


def check_tile_size(vae, size: int) -> None:
    """ValueError naming --vae_tile_size unless `size` is a multiple of 4 x the VAE's downsampling: tiles overlap by
    a quarter of their side, which must be whole latent pixels (else diffusers' tiles leave seams of gaps)."""
    step = 4 * _downsampling(vae)
    if size % step:
        raise ValueError(f"--vae_tile_size {size}: must be a multiple of {step} (tiles overlap by a quarter of their "
                         f"side, in whole latent pixels of the VAE's {step // 4}x downsampling); use "
                         f"{max(step, size // step * step)}")


def _tile_settings(vae, size: int) -> dict:
    """diffusers' attributes for tiles of size x size pixels, a quarter overlapping (its defaults' proportions)."""
    if _is_wan(vae):
        return {"tile_sample_min_height": size, "tile_sample_min_width": size,
                "tile_sample_stride_height": size * 3 // 4, "tile_sample_stride_width": size * 3 // 4}
    return {"tile_sample_min_size": size, "tile_latent_min_size": size // _downsampling(vae)}


@contextlib.contextmanager
def tiling(vae, options: DecodeOptions):
    """Within: diffusers' tiling switched on as `options` say (nothing changes without options.tiling); the VAE's
    own settings come back after."""
    settings = {"use_tiling": True, **(_tile_settings(vae, options.tile_size) if options.tile_size else {})}
    saved = {name: getattr(vae, name) for name in settings} if options.tiling else {}
    try:
        for name in saved:
            setattr(vae, name, settings[name])
        yield
    finally:
        for name, value in saved.items():
            setattr(vae, name, value)


def tile_grid(vae, z: torch.Tensor) -> list[tuple[slice, slice]]:
    """The latent tiles diffusers' tiled_decode decodes, in its order (rows, then columns): slices of z's last two
    dims; [] when z fits one tile (diffusers decodes it whole)."""
    h, w = z.shape[-2:]
    if _is_wan(vae):
        f = vae.spatial_compression_ratio
        size = (vae.tile_sample_min_height // f, vae.tile_sample_min_width // f)
        stride = (vae.tile_sample_stride_height // f, vae.tile_sample_stride_width // f)
    else:
        side = vae.tile_latent_min_size
        size, stride = (side, side), (int(side * (1 - vae.tile_overlap_factor)),) * 2
    if h <= size[0] and w <= size[1]:
        return []
    return [(slice(i, i + size[0]), slice(j, j + size[1])) for i in range(0, h, stride[0])
            for j in range(0, w, stride[1])]


def _decode_tile(vae, tile: torch.Tensor) -> torch.Tensor:
    """One latent tile -> its pixels as diffusers' tiled_decode computes them before blending (and Wan's clamp)."""
    if not _is_wan(vae):
        return vae.decoder(vae.post_quant_conv(tile) if vae.config.use_post_quant_conv else tile)
    vae.clear_cache()  # Wan: latent frames in order, each reading the causal cache of those before it
    frames = []
    for k in range(tile.shape[2]):
        vae._conv_idx = [0]
        frames.append(vae.decoder(vae.post_quant_conv(tile[:, :, k:k + 1]), feat_cache=vae._feat_map,
                                  feat_idx=vae._conv_idx, first_chunk=k == 0))
    vae.clear_cache()
    return torch.cat(frames, 2)


class _Replay(nn.Module):
    """Stands in for the decoder inside diffusers' tiled_decode, answering its calls with tiles decoded already.
    Wan's tiled_decode calls the decoder once per latent frame of a tile and concatenates in time: the whole tile
    [B, 3, T, H, W] answers the first frame's call (first_chunk), 0 frames the others'."""

    def __init__(self, tiles: list[torch.Tensor]):
        super().__init__()
        self.tiles, self.last = iter(tiles), None

    def forward(self, x, feat_cache=None, feat_idx=None, first_chunk=False):
        if feat_cache is None or first_chunk:
            self.last = next(self.tiles)
            return self.last
        return self.last[:, :, :0]


def _blend(vae, z: torch.Tensor, tiles: list[torch.Tensor]) -> torch.Tensor:
    """diffusers' tiled_decode of z with `tiles` (those of tile_grid, decoded) in place of its decoder calls: its
    own blending, cropping and (Wan) clamping."""
    decoder, post_quant_conv = vae.decoder, vae.post_quant_conv
    vae.decoder, vae.post_quant_conv = _Replay(tiles), nn.Identity()
    try:
        return vae.tiled_decode(z).sample
    finally:
        vae.decoder, vae.post_quant_conv = decoder, post_quant_conv


def _share(n: int, group) -> range:
    """This rank's contiguous share of n items."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return range(rank * n // size, (rank + 1) * n // size)


def _all_gather(mine: list[torch.Tensor], group, device) -> list[torch.Tensor]:
    """Every rank's tensors in rank order, on `device`; through host memory (all_gather_object pickles them, so
    each rank's tensors may have any shapes)."""
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, [t.cpu() for t in mine], group=group)
    return [t.to(device) for part in parts for t in part]


def _decode_rows(vae, z: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.cat([vae.decode(rows).sample for rows in z.split(batch)])


def _split_tiles(vae, z: torch.Tensor, grid: list, group) -> torch.Tensor:
    mine = [_decode_tile(vae, z[..., rows, cols]) for rows, cols in (grid[k] for k in _share(len(grid), group))]
    return _blend(vae, z, _all_gather(mine, group, z.device))


def _split_rows(vae, z: torch.Tensor, batch: int, group) -> torch.Tensor:
    share = _share(len(z), group)
    mine = [_decode_rows(vae, z[share.start:share.stop], batch)] if share else []
    return torch.cat(_all_gather(mine, group, z.device))


@torch.no_grad()
def decode_latents(vae, z: torch.Tensor, options: DecodeOptions = DecodeOptions()) -> torch.Tensor:
    """Raw latents on the VAE's device and dtype, [N, C, h, w] (Wan: [N, C, t, h, w]) -> the decoder's pixels
    [N, 3, ...]: options.batch rows per call, tiled if options.tiling, split over options.group: by rows, or by
    tiles when there are fewer rows than ranks (one large image, frame or clip) and tiling cuts them."""
    with tiling(vae, options):
        ranks = 1 if options.group is None else dist.get_world_size(options.group)
        if ranks == 1:
            return _decode_rows(vae, z, options.batch)
        grid = tile_grid(vae, z) if options.tiling else []
        if len(z) < ranks and len(grid) > 1:
            return torch.cat([_split_tiles(vae, rows, grid, options.group) for rows in z.split(options.batch)])
        return _split_rows(vae, z, options.batch, options.group)
