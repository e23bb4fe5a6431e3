"""How a frozen diffusers VAE (AutoencoderKL, AutoencoderKLWan) decodes: its own tiling at a chosen tile size, a
bounded number of rows (images, frames, clips) per decoder call, and the work split over the ranks that hold the same
latents (the ranks of one of sample.py's sequence- or CFG-parallel groups).

Tiling is diffusers' `tiled_decode`: the latent is cut into overlapping square tiles, each decoded alone, and the
overlaps are blended linearly. The decoder's activations are then one tile's, but a pixel near a seam sees less
context than in one pass, so a tiled decode differs from the plain one (tests/test_vae_decode.py states by how much);
a latent that fits one tile is decoded whole.

Splitting over a group gives what one process decoding the same way gives: rows are independent (SD's VAE decodes a
clip frame by frame), and so are tiles, which every rank then blends with diffusers' own tiled_decode. A causal 3-D
VAE (Wan's) is never split in time: each latent frame's decode reads the cached features of the frames before it.
What differs between VAEs, each says itself (VAEDecoding).
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
    VAE's own: its config's sample_size for AutoencoderKL, 256 for Wan's); batch: rows per decoder call; group: the
    ranks holding the same latents, which split the work (None: this process decodes everything)."""
    tiling: bool = False
    tile_size: int | None = None
    batch: int = 64
    group: Any = None


class VAEDecoding:
    """What shared decoding asks of a VAE, answered for diffusers' 2-D AutoencoderKL (SD, FLUX): its downsampling,
    diffusers' tile attributes, the latent tiles of its tiled_decode, one tile's decode. A clip decodes frame by
    frame, so rows (images or frames) are independent. A VAE whose decoder works otherwise carries its own answers
    as the attribute `opendit_decoding` (Wan's causal 3-D VAE: opendit.families.wan.vae); shared code asks
    `decoding_of(vae)` and never tests a class name."""

    def downsampling(self, vae) -> int:
        return 2 ** (len(vae.config.block_out_channels) - 1)

    def tile_settings(self, vae, size: int) -> dict:
        """diffusers' attributes for tiles of size x size pixels, a quarter overlapping (its defaults' proportions)."""
        return {"tile_sample_min_size": size, "tile_latent_min_size": size // self.downsampling(vae)}

    def tile_shape(self, vae) -> tuple[tuple[int, int], tuple[int, int]]:
        """(tile size, stride) in latent pixels, (height, width) each, as tiled_decode reads them now."""
        side = vae.tile_latent_min_size
        return (side, side), (int(side * (1 - vae.tile_overlap_factor)),) * 2

    def decode_tile(self, vae, tile: torch.Tensor) -> torch.Tensor:
        """One latent tile -> its pixels as tiled_decode computes them before blending."""
        return vae.decoder(vae.post_quant_conv(tile) if vae.config.use_post_quant_conv else tile)


def decoding_of(vae) -> VAEDecoding:
    return getattr(vae, "opendit_decoding", None) or VAEDecoding()


def check_tile_size(vae, size: int) -> None:
    """ValueError naming --vae_tile_size unless `size` is a multiple of 4 x the VAE's downsampling: tiles overlap by
    a quarter of their side, which must be whole latent pixels (else diffusers' tiles leave seams of gaps)."""
    step = 4 * decoding_of(vae).downsampling(vae)
    if size % step:
        raise ValueError(f"--vae_tile_size {size}: must be a multiple of {step} (tiles overlap by a quarter of their "
                         f"side, in whole latent pixels of the VAE's {step // 4}x downsampling); use "
                         f"{max(step, size // step * step)}")


@contextlib.contextmanager
def tiling(vae, options: DecodeOptions):
    """Within: diffusers' tiling switched on as `options` say (nothing changes without options.tiling); the VAE's
    own settings come back after."""
    sized = decoding_of(vae).tile_settings(vae, options.tile_size) if options.tile_size else {}
    settings = {"use_tiling": True, **sized}
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
    size, stride = decoding_of(vae).tile_shape(vae)
    if h <= size[0] and w <= size[1]:
        return []
    return [(slice(i, i + size[0]), slice(j, j + size[1])) for i in range(0, h, stride[0])
            for j in range(0, w, stride[1])]


class _Replay(nn.Module):
    """Stands in for the decoder inside diffusers' tiled_decode, answering its calls with tiles decoded already.
    A causal 3-D VAE's tiled_decode (Wan's) calls the decoder once per latent frame of a tile and concatenates in
    time: the whole tile [B, 3, T, H, W] answers the first frame's call (first_chunk), 0 frames the others'."""

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
    own blending, cropping and clamping."""
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
    decode_tile = decoding_of(vae).decode_tile
    mine = [decode_tile(vae, z[..., rows, cols]) for rows, cols in (grid[k] for k in _share(len(grid), group))]
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
