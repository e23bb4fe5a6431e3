"""Grids other than the trained square: every family's model takes a non-square latent (and, for video, another
frame count) with the sin-cos tables of that grid (the stored square tables, official keys, stay what they
were), sequence parallelism splits such a grid like the plain path, and sample.py samples at any --height /
--width (video: --num_frames) of whole patches, naming the flag and valid sizes otherwise."""
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from opendit import config as cfglib
from opendit.diffusion.objective import DiffusionObjective
from opendit.families import family_of
from opendit.families.dit.model import DiT
from opendit.families.flux.family import FLUX_MODELS, FlowObjective
from opendit.families.video.latte import Latte
from opendit.families.video.vdit import VDiT
from opendit.families.wan.family import WAN_MODELS, WanEncoders, WanFlowObjective
from opendit.models.pos_embed import sincos_1d, sincos_2d
from opendit.parallel import enable_sequence_parallel
from tests.distributed import run_distributed
from tests.test_train import ROOT, tiny_cfg
from tests.test_video_models import _randomize

sys.path.insert(0, str(ROOT))
import sample  # noqa: E402  (the entry script, run in-process)

TINY = dict(hidden_size=32, depth=2, num_heads=4)


# ---------------------------------------------------------------------------------------------- position tables
def _old_sincos_2d(dim, grid_size):
    """sincos_2d as it was before non-square grids (square only)."""
    coords = np.arange(grid_size, dtype=np.float64)
    grid_w, grid_h = np.meshgrid(coords, coords)
    return torch.from_numpy(np.concatenate([sincos_1d(dim // 2, grid_w), sincos_1d(dim // 2, grid_h)], 1)).float()


def _mae_2d(embed_dim, h, w):
    """MAE's get_2d_sincos_pos_embed(embed_dim, (h, w)) (facebookresearch/mae util/pos_embed.py), in numpy."""
    def one_d(dim, pos):
        omega = np.arange(dim // 2, dtype=np.float64)
        omega /= dim / 2.0
        omega = 1.0 / 10000 ** omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    grid = np.stack(np.meshgrid(np.arange(w, dtype=np.float32), np.arange(h, dtype=np.float32)), axis=0)
    grid = grid.reshape(2, 1, h, w)  # grid[0]: the column, grid[1]: the row
    return np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], axis=1)


@pytest.mark.parametrize("g", [1, 4, 16])
def test_square_table_is_bitwise_the_old_one(g):
    assert torch.equal(sincos_2d(64, g), _old_sincos_2d(64, g))
    assert torch.equal(sincos_2d(64, g, g), _old_sincos_2d(64, g))


@pytest.mark.parametrize("h, w", [(2, 5), (6, 3), (1, 4)])
def test_rectangular_table_is_maes(h, w):
    ours = sincos_2d(64, h, w)
    assert ours.shape == (h * w, 64)
    torch.testing.assert_close(ours, torch.from_numpy(_mae_2d(64, h, w)).float(), atol=0, rtol=0)


def _dit():
    return _randomize(DiT(input_size=8, patch_size=2, in_channels=4, num_classes=10, class_dropout_prob=0.0,
                          **TINY)).eval()


def _dit_as_before(model, x, t, y):
    """DiT's forward before non-square grids: the stored table, a square unpatchify."""
    tokens = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder(y, False)
    for block in model.blocks:
        tokens = block(tokens, c)
    out = model.final_layer(tokens, c)
    g, p, C = int(out.shape[1] ** 0.5), model.patch_size, model.out_channels
    out = torch.einsum("nhwpqc->nchpwq", out.reshape(out.shape[0], g, g, p, p, C))
    return out.reshape(out.shape[0], C, g * p, g * p)


def test_dit_square_forward_is_unchanged_and_other_grids_stay_out_of_the_state_dict():
    model = _dit()
    keys = list(model.state_dict())
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 500]), torch.tensor([1, 7])
    with torch.no_grad():
        assert torch.equal(model(x, t, y), _dit_as_before(model, x, t, y))
        assert not model.pos_tables.tables  # the square grid used the stored table
        wide = torch.randn(2, 4, 4, 12)
        tokens, _ = model.embed(wide, t, y)
        torch.testing.assert_close(tokens, model.x_embedder(wide) + sincos_2d(32, 2, 6), atol=0, rtol=0)
        assert model(wide, t, y).shape == (2, 8, 4, 12)
    assert list(model.state_dict()) == keys and len(model.pos_tables.tables) == 1
    with pytest.raises(ValueError, match="not divisible by its patch size 2"):
        model(torch.randn(2, 4, 8, 5), t, y)


def test_video_tables_follow_the_clip():
    for model in (VDiT(input_size=(4, 8, 8), patch_size=(1, 2, 2), **TINY),
                  Latte(input_size=(4, 8, 8), patch_size=2, **TINY)):
        stored_s = model.pos_embed_spatial if isinstance(model, VDiT) else model.pos_embed
        stored_t = model.pos_embed_temporal if isinstance(model, VDiT) else model.temp_embed
        assert torch.equal(model.spatial_table(4, 4, stored_s, torch.float32, "cpu"), stored_s)
        assert torch.equal(model.spatial_table(2, 6, stored_s, torch.float32, "cpu")[0], sincos_2d(32, 2, 6))
        assert torch.equal(model.temporal_table(4, stored_t, torch.float32, "cpu"), stored_t)
        assert torch.equal(model.temporal_table(6, stored_t, torch.float32, "cpu")[0, :4], stored_t[0])


# ---------------------------------------------------------------------------------------------- forward / backward
def _check_backward(model, loss, out_shape, expected):
    assert out_shape == expected
    loss.mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("name", ["dit", "vdit", "latte"])
def test_gaussian_models_train_on_a_nonsquare_grid_and_another_frame_count(name, one_thread):
    if name == "dit":
        model, x, cond = _dit().train(), torch.randn(2, 4, 8, 4), {"y": torch.tensor([1, 2])}
    else:
        cls = VDiT if name == "vdit" else Latte
        model = _randomize(cls(input_size=(4, 8, 8), num_classes=10, **TINY)).train()
        x, cond = torch.randn(2, 4, 3, 8, 4), {"y": torch.tensor([1, 2])}  # 3 frames of 8x4, trained 4 of 8x8
    loss, _ = DiffusionObjective(None, 1.0, learn_sigma=True).losses(model, x, cond)
    _check_backward(model, loss, tuple(model(x, torch.tensor([1, 2]), **cond).shape),
                    (2, 8, *x.shape[2:]))


def test_flux_trains_on_a_nonsquare_latent(one_thread):
    model = _randomize(FLUX_MODELS["flux-debug"].build(in_channels=16, out_channels=16, context_in_dim=8,
                                                       vec_in_dim=6))
    cfg = SimpleNamespace(vae_scale=1.0, timestep_sampling="logit_normal", guidance=1.0, text_dropout_prob=0.0)
    objective = FlowObjective(None, cfg, guidance_embed=True, vae_shift=0.0)
    x = torch.randn(2, 4, 8, 4)  # 4 x 2 packed tokens
    loss, _ = objective.losses(model, x, {"txt": torch.randn(2, 5, 8), "y": torch.randn(2, 6)})
    _check_backward(model, loss, tuple(loss.shape), (2,))


def test_wan_trains_on_a_nonsquare_clip_of_another_frame_count(one_thread):
    model = _randomize(WAN_MODELS["Wan-debug"].build(in_dim=3, out_dim=3, text_dim=8))
    objective = WanFlowObjective(WanEncoders(None, None), shift=1.0, timestep_sampling="uniform", dropout=0.0)
    x, context = torch.randn(2, 3, 5, 8, 16), torch.randn(2, 16, 8)
    loss, _ = objective.losses(model, x, {"context": context})
    _check_backward(model, loss, tuple(model(x, torch.tensor([1.0, 2.0]), context).shape), (2, 3, 5, 8, 16))


# ---------------------------------------------------------------------------------------------- sequence parallel
def _sp_worker(rank, world_size):
    """DiT at a 6x10 latent (3 x 5 = 15 tokens: padded on 2 ranks) split by each method vs unsplit."""
    torch.manual_seed(1)
    x, t, y = torch.randn(2, 4, 6, 10), torch.tensor([3, 700]), torch.tensor([1, 7])
    target = torch.randn(2, 8, 6, 10)
    results = {}
    for kind in ("fastseq", "ulysses"):
        outs, grads = [], []
        for split in (False, True):
            model = _dit().train()
            if split:
                enable_sequence_parallel(model, dist.group.WORLD, kind)
            out = model(x, t, y)
            ((out - target) ** 2).mean().backward()
            grad = model.x_embedder.proj.weight.grad.clone()
            if split:  # every rank's loss is the whole sample's: the group mean is the unsplit gradient
                dist.all_reduce(grad)
                grad /= world_size
            outs.append(out.detach())
            grads.append(grad)
        results[kind] = (outs, grads)
    return results


@pytest.mark.slow
def test_sequence_parallel_splits_a_nonsquare_grid_like_the_plain_path():
    for res in run_distributed(_sp_worker, 2):
        for kind, ((plain, split), (g_plain, g_split)) in res.items():
            torch.testing.assert_close(split, plain, atol=1e-5, rtol=1e-5, msg=lambda m: f"{kind} output: {m}")
            torch.testing.assert_close(g_split, g_plain, atol=2e-5, rtol=1e-4, msg=lambda m: f"{kind} grad: {m}")


# ---------------------------------------------------------------------------------------------- sample.py
def _sample(family_runs, name, out, **flags):
    prompt = {"flux": ["a handwritten one"], "wan": ["the digit 1 moving down"]}.get(name, [])
    sample.main(cfglib.SampleConfig(ckpt="latest", outputs=str(family_runs / name), num_samples=2, batch_size=2,
                                    num_sampling_steps=2, prompts=prompt, out=str(out), npz=True, **flags))
    return np.load(out / "samples.npz")["arr_0"]


@pytest.mark.parametrize("name", ["dit", "vdit", "latte", "flux", "wan"])
def test_sample_py_samples_any_size_of_whole_patches(family_runs, name, tmp_path, one_thread):
    video = name in ("vdit", "latte", "wan")
    frames = {"vdit": 4, "latte": 4, "wan": 5}.get(name)
    default = _sample(family_runs, name, tmp_path / "default")
    assert default.shape == ((2, frames, 8, 8, 3) if video else (2, 8, 8, 3))
    same = _sample(family_runs, name, tmp_path / "same", height=8, width=8, **({"num_frames": frames} if video else {}))
    assert np.array_equal(same, default)  # flags at the trained size change nothing
    wide = _sample(family_runs, name, tmp_path / "wide", height=8, width=16)
    assert wide.shape == ((2, frames, 8, 16, 3) if video else (2, 8, 16, 3))
    if video:  # Wan's pixel-space demo: any frame count; Latte and VDiT-debug: temporal patch 1
        longer = _sample(family_runs, name, tmp_path / "longer", height=16, width=8, num_frames=frames + 2)
        assert longer.shape == (2, frames + 2, 16, 8, 3)


def test_a_size_that_is_not_whole_patches_names_the_flag_and_valid_sizes():
    loaded = SimpleNamespace(cfg=tiny_cfg("x", image_size=8, num_frames=4), latent_shape=(1, 8, 8),
                             encoders=SimpleNamespace(vae=None))
    dit = family_of("DiT-debug")
    assert dit.sample_shape(loaded, cfglib.SampleConfig(height=6, width=12)) == (1, 6, 12)
    with pytest.raises(ValueError, match="--height 7 must be a positive multiple of patch size = 2; use 6 or 8"):
        dit.sample_shape(loaded, cfglib.SampleConfig(height=7))
    sd_vae = SimpleNamespace(config=SimpleNamespace(block_out_channels=(8,) * 4, latent_channels=4))  # 8x down
    latent = SimpleNamespace(cfg=tiny_cfg("x", image_size=64), latent_shape=(4, 8, 8),
                             encoders=SimpleNamespace(vae=sd_vae))
    with pytest.raises(ValueError, match=r"--width 40 must be a positive multiple of 8 \(the VAE's downsampling\) x "
                                         r"patch size = 16; use 32 or 48"):
        dit.sample_shape(latent, cfglib.SampleConfig(width=40))
    clip = SimpleNamespace(cfg=tiny_cfg("x", model="VDiT-Ti/2x2x2", image_size=8, num_frames=4),
                           latent_shape=(3, 4, 8, 8), encoders=SimpleNamespace(vae=None))
    with pytest.raises(ValueError, match="--num_frames 5 must be a positive multiple of VDiT-Ti/2x2x2's temporal "
                                         "patch = 2; use 4 or 6"):
        family_of("VDiT-Ti/2x2x2").sample_shape(clip, cfglib.SampleConfig(num_frames=5))
