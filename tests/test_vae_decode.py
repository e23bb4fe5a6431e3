"""Tiled, frame-chunked and parallel VAE decoding (opendit/encoders/vae_decode.py) on tiny random VAEs: SD's and
FLUX's AutoencoderKL layout (4 levels, 8x down) and Wan2.1's causal 3-D AutoencoderKLWan."""
import dataclasses
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from opendit.encoders.vae import decode, decode_frames
from opendit.encoders.vae_decode import DecodeOptions, _blend, check_tile_size, decoding_of, tile_grid, tiling
from opendit.families.wan.vae import described, wan_decode
from opendit.inference import with_vae_decode
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
# 64 px tiles on 128 px latents' images (16 x 16 latents): 3 x 3 overlapping tiles of 8 latents every 6
TILED = DecodeOptions(tiling=True, tile_size=64)
# Tiled minus plain decode, |difference| measured on these random VAEs (torch 2.13 CPU, diffusers 0.42.1), outputs in
# [-1, 1]: SD layout max 1.87 / mean 0.21, FLUX layout 1.83 / 0.23 (the mean output magnitude is 0.24: unrelated
# images), Wan 0.22 / 0.016. Not an error bound of the method: AutoencoderKL's decoder normalises with GroupNorm
# statistics of the whole image and its mid-block attends over every latent position, so a tile alone sees other
# statistics and context, which random weights turn into different pixels (trained VAEs are tiled so by diffusers'
# pipelines); Wan's RMS norms are per position and its cache causal, leaving mostly the seams' zero padding. What
# the tests pin is that tiling ran (the difference is not 0) and that it stays at what was measured (Wan2.2's: 0.12,
# its 64-pixel tiles being 4 latent pixels at 16x, so seams are a larger share).
TILING_MEAN_DIFF = {"sd": 0.3, "flux": 0.3, "wan": 0.03, "wan22": 0.2}


def tiny_kl(latent_channels: int = 4):
    """AutoencoderKL with SD's layout (FLUX's with 16 latent channels) and 8-wide layers."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                         block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=latent_channels,
                         norm_num_groups=8, sample_size=32).eval()


def tiny_wan(wan22: bool = False):
    """AutoencoderKLWan with Wan2.1's layout (8x in space, 4x in time), 4 channels a level; wan22: Wan2.2's (a
    residual VAE over 2x2-patchified frames: 16x in space, 48 latent channels)."""
    from diffusers import AutoencoderKLWan

    layout = dict(z_dim=48, decoder_base_dim=4, is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                  scale_factor_spatial=16, latents_mean=[0.0] * 48, latents_std=[1.0] * 48) if wan22 else {}
    torch.manual_seed(0)
    return described(AutoencoderKLWan(**{"base_dim": 4, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
                                         **layout}).eval())


def _vae(kind: str):
    return tiny_wan(kind == "wan22") if kind.startswith("wan") else tiny_kl(16 if kind == "flux" else 4)


def _latents(kind: str, n: int = 1, side: int = 16) -> torch.Tensor:
    """n latents of 128 x 128 pixels: images [n, C, 16, 16]; Wan clips [n, 16, 3, 16, 16] (9 frames); Wan2.2's
    [n, 48, 3, 8, 8]."""
    shape = {"wan": (n, 16, 3, side, side), "wan22": (n, 48, 3, side // 2, side // 2)}.get(
        kind, (n, 16 if kind == "flux" else 4, side, side))
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


def _decode(kind, vae, z, options=DecodeOptions()):
    return wan_decode(vae, z, options) if kind.startswith("wan") else decode(vae, z, scale=1.0, options=options)


@pytest.mark.parametrize("kind", ["sd", "flux", "wan", "wan22"])
def test_tiled_decode_is_close_to_the_plain_decode(kind, one_thread):
    vae, z = _vae(kind), _latents(kind)
    with tiling(vae, TILED):
        assert len(tile_grid(vae, z)) == 9
    plain, tiled = _decode(kind, vae, z), _decode(kind, vae, z, TILED)
    assert tiled.shape == plain.shape == (1, 3, *((9,) if kind.startswith("wan") else ()), 128, 128)
    diff = (tiled - plain).abs()
    assert 0 < diff.mean() < TILING_MEAN_DIFF[kind], diff.mean()
    assert tiled.abs().max() <= 1


@pytest.mark.parametrize("kind", ["sd", "wan", "wan22"])
def test_tiles_decoded_one_by_one_and_blended_equal_diffusers_tiled_decode(kind, one_thread):
    """What a rank of a parallel decode does with its share of the tiles, minus the gather: bitwise diffusers'."""
    vae, z = _vae(kind), _latents(kind)
    with tiling(vae, TILED):
        expected = vae.tiled_decode(z).sample
        tiles = [decoding_of(vae).decode_tile(vae, z[..., rows, cols]) for rows, cols in tile_grid(vae, z)]
        assert torch.equal(_blend(vae, z, tiles), expected)
    assert type(vae.decoder).__name__ != "_Replay" and vae.post_quant_conv is not None  # put back


def test_tiling_puts_the_vae_settings_back():
    vae = tiny_kl()
    before = (vae.use_tiling, vae.tile_sample_min_size, vae.tile_latent_min_size)
    with tiling(vae, TILED):
        assert (vae.use_tiling, vae.tile_sample_min_size, vae.tile_latent_min_size) == (True, 64, 8)
    assert (vae.use_tiling, vae.tile_sample_min_size, vae.tile_latent_min_size) == before == (False, 32, 4)


def test_frame_chunks_decode_as_the_whole_clip(one_thread):
    """SD's VAE decodes a clip's frames independently: 3 frames per call give all 10 at once up to float32 rounding
    (the CPU's convolutions block their sums differently by batch size: 3.2e-6 measured)."""
    vae = tiny_kl()
    z = torch.randn(2, 4, 5, 4, 4, generator=torch.Generator().manual_seed(0))  # 2 clips of 5 frames
    whole = decode_frames(vae, z, scale=1.0)
    chunked = decode_frames(vae, z, scale=1.0, options=DecodeOptions(batch=3))
    assert chunked.shape == (2, 3, 5, 32, 32)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-5)


def test_tile_size_must_be_whole_overlaps():
    check_tile_size(tiny_kl(), 96)
    with pytest.raises(ValueError, match=r"--vae_tile_size 100: must be a multiple of 32 .* use 96"):
        check_tile_size(tiny_kl(), 100)
    with pytest.raises(ValueError, match=r"multiple of 32 .* use 32"):
        check_tile_size(tiny_wan(), 16)


@dataclasses.dataclass
class _Loaded:  # what with_vae_decode reads of a LoadedModel
    encoders: object
    vae_decode: DecodeOptions = DecodeOptions()


def _flags(**given):
    return types.SimpleNamespace(**{"vae_tiling": False, "vae_tile_size": None, "vae_batch": 64,
                                    "parallel_decode": False, **given})


def test_sample_flags_become_decode_options():
    loaded = _Loaded(types.SimpleNamespace(vae=tiny_kl()))
    options = with_vae_decode(loaded, _flags(vae_tile_size=64, vae_batch=8), world_size=1, dp_size=1).vae_decode
    assert options == DecodeOptions(tiling=True, tile_size=64, batch=8)  # a tile size turns tiling on
    with pytest.raises(ValueError, match="--vae_tile_size 40: must be a multiple of 32"):
        with_vae_decode(loaded, _flags(vae_tile_size=40), world_size=1, dp_size=1)
    with pytest.raises(ValueError, match="--parallel_decode: every process decodes only its own samples"):
        with_vae_decode(loaded, _flags(parallel_decode=True), world_size=2, dp_size=2)


# ---- two processes --------------------------------------------------------------------------------------------
CASES = {  # name: (kind, latents, options): rows split (frames, clips) and tiles split (one image, one clip)
    "sd frames": ("sd_clip", None, DecodeOptions(batch=3)),
    "sd one image, tiles": ("sd", 1, TILED),
    "flux two images, rows": ("flux", 2, TILED),
    "wan one clip, tiles": ("wan", 1, TILED),
    "wan three clips, rows": ("wan", 3, DecodeOptions()),
}


def _case(kind, n, options):
    if kind == "sd_clip":
        z = torch.randn(1, 4, 7, 8, 8, generator=torch.Generator().manual_seed(2))  # one clip of 7 frames
        return lambda opts: decode_frames(tiny_kl(), z, scale=1.0, options=opts)
    vae, z = _vae(kind), _latents(kind, n)
    return lambda opts: _decode(kind, vae, z, opts)


def _decode_on_two_ranks(rank, world_size):

    torch.set_num_threads(1)
    diffs = {}
    for name, (kind, n, options) in CASES.items():
        run = _case(kind, n, options)
        alone, split = run(options), run(dataclasses.replace(options, group=dist.group.WORLD))
        diffs[name] = (split - alone).abs().max().item()
    return diffs


@pytest.mark.slow
def test_two_ranks_decode_as_one_process():
    for diffs in run_distributed(_decode_on_two_ranks, 2):
        # rows: the same per-row math in other batch sizes (float32 rounding, as in the frame chunks' test); tiles:
        # the same tiles, blended by diffusers' own code
        assert all(d <= 1e-5 for d in diffs.values()), diffs


def test_benchmark_small_runs(capsys, one_thread):
    from benchmarks import vae_decode_memory

    start = time.perf_counter()
    rows = vae_decode_memory.main(["--small", "--in_process"])
    assert [(r["case"], r["tiled"]) for r in rows] == [("flux", False), ("flux", True), ("wan", False), ("wan", True)]
    assert rows[3]["shape"] == [1, 3, 5, 128, 128] and all(r["peak_mib"] >= 0 for r in rows)
    assert "| FLUX image 128² | tiled (64 px tiles) |" in capsys.readouterr().out
    assert time.perf_counter() - start < 20


@pytest.mark.slow
def test_sample_py_parallel_decode_writes_what_each_rank_decoding_all_does(tmp_path):
    """Two sequence-parallel ranks share one Wan clip; --parallel_decode splits its 9 tiles between them."""
    from opendit.families.wan.vae import save_tiny_wan_vae
    from tests.run_each import sample_each
    from tests.families.test_wan import tiny_wan_pipeline

    pipe, _ = tiny_wan_pipeline(tmp_path / "pipe", tmp_path / "umt5", save_tiny_wan_vae(tmp_path / "vae"))
    common = ["--ckpt", pipe, "--prompts", "the digit 1 moving down", "--num_frames", "5", "--height", "64",
              "--width", "64", "--num_sampling_steps", "2", "--npz", "--sequence_parallel_size", "2",
              "--vae_tile_size", "32"]
    sample_each([[*common, "--out", tmp_path / "all"], [*common, "--parallel_decode", "--out", tmp_path / "split"]],
                nproc=2)  # one torchrun launch
    every, split = (np.load(tmp_path / d / "samples.npz")["arr_0"] for d in ("all", "split"))
    assert split.shape == (1, 5, 64, 64, 3) and np.array_equal(every, split)
