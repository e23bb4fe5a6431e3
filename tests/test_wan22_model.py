"""Wan2.2 in the Wan family: the transformer's new inputs against tests/wan_reference.py's transcription of the
official Wan2.2 forward (wan22=True) and diffusers' WanTransformer3DModel — timesteps per token (TI2V's clean first
frame: its tokens at t = 0), a [B] timestep equal to its per-token expansion, the i2v model's conditioning channels
— and TI2V's text-to-video use with the Wan2.2 VAE through the entry scripts. The official key lists of TI2V-5B and
both A14B experts: tests/test_wan_model.py; the Wan2.2 VAE's tiled decode: tests/test_vae_decode.py."""
import pytest
import torch

from opendit.families.wan.model import WanModel
from opendit.families.wan.weights import WAN_WEIGHTS
from tests.run_each import run_here
from tests.test_wan_model import ATOL, TINY, padded, tiny_wan, wan_inputs
from tests.wan_reference import reference_forward

TI2V = dict(TINY, model_type="ti2v")
I2V = dict(TINY, model_type="i2v", in_dim=7)  # 4 noisy latent channels + 3 conditioning channels (y)


def first_frame_clean(t, grid, seq_len):
    """Per-token timesteps [B, seq_len]: every token at its sample's t, the first latent frame's h*w at 0."""
    per_token = t[:, None].repeat(1, seq_len).float()
    _, h, w = grid
    per_token[:, :h * w] = 0
    return per_token


@torch.no_grad()
def test_per_token_timesteps_equal_the_official_wan22_forward():
    model = tiny_wan(**TI2V)
    x, t, context = wan_inputs()
    x = [u[:, :, :, :4] for u in x[:1]] * 2  # two samples of one grid (3, 2, 2) = 12 tokens, for the tensor forward
    x[1] = x[1].flip(-1)
    context = context[:2]
    per_token = first_frame_clean(t, (3, 2, 2), 12)
    ref = reference_forward(model.state_dict(), TI2V, x, per_token, context, seq_len=12, wan22=True)
    out = model(x, per_token, context, seq_len=12)
    for o, r in zip(out, ref):
        assert r.abs().mean() > 0.3
        torch.testing.assert_close(o, r, atol=ATOL, rtol=ATOL)
    batched = model(torch.stack(x), per_token, padded(context, TINY["text_len"]))
    torch.testing.assert_close(batched, torch.stack(ref), atol=ATOL, rtol=ATOL)
    # the clean first frame changes the output: per-token t is not one t per sample
    assert (model(x, t, context, seq_len=12)[0] - out[0]).abs().max() > 1e-3


@torch.no_grad()
def test_one_timestep_per_sample_equals_its_per_token_expansion():
    model = tiny_wan(**TI2V)
    x, t, context = wan_inputs()
    ref = reference_forward(model.state_dict(), TI2V, x, t, context, seq_len=20, wan22=True)  # t expanded
    for o, r in zip(model(x, t, context, seq_len=20), ref):
        torch.testing.assert_close(o, r, atol=ATOL, rtol=ATOL)
    expanded = t[:, None].expand(2, 20)
    for o, r in zip(model(x, expanded, context, seq_len=20), ref):
        torch.testing.assert_close(o, r, atol=ATOL, rtol=ATOL)


@torch.no_grad()
def test_i2v_conditioning_channels_join_the_latent():
    model = tiny_wan(**I2V)
    x, t, context = wan_inputs()
    g = torch.Generator().manual_seed(5)
    y = [torch.randn(3, *u.shape[1:], generator=g) for u in x]
    ref = reference_forward(model.state_dict(), I2V, x, t, context, seq_len=20, y=y, wan22=True)
    for o, r in zip(model(x, t, context, seq_len=20, y=y), ref):
        assert o.shape == (TINY["out_dim"], *r.shape[1:])
        torch.testing.assert_close(o, r, atol=ATOL, rtol=ATOL)
    with pytest.raises(ValueError, match="i2v model takes y"):
        model(x, t, context, seq_len=20)
    with pytest.raises(ValueError, match="no y"):
        tiny_wan(**TI2V)(x, t, context, seq_len=20, y=y)
    with pytest.raises(ValueError, match="one per token"):
        tiny_wan(**TI2V)(torch.randn(2, 4, 2, 4, 4), torch.zeros(2, 5), torch.randn(2, 8, 12))


@torch.no_grad()
def test_per_token_timesteps_equal_diffusers_wan_transformer():
    from diffusers import WanTransformer3DModel

    model = tiny_wan(**TI2V)
    peer = WanTransformer3DModel(**WAN_WEIGHTS.arch_to_diffusers(TI2V)).eval()
    peer.load_state_dict(WAN_WEIGHTS.to_diffusers(model.state_dict()), strict=True)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, TINY["in_dim"], 3, 4, 4, generator=g)
    context = torch.randn(2, TINY["text_len"], TINY["text_dim"], generator=g)
    per_token = first_frame_clean(torch.tensor([250, 900]), (3, 2, 2), 12)
    ours = model(x, per_token, context)
    theirs = peer(x, per_token, context, return_dict=False)[0]
    torch.testing.assert_close(ours, theirs.float(), atol=1e-4, rtol=1e-4)  # diffusers' fp32 sinusoid and RoPE


def test_wan22_models_build():
    for kind in ("t2v", "i2v", "ti2v"):
        assert WanModel(**{**TINY, "model_type": kind}).model_type == kind


@pytest.mark.slow
def test_ti2v_text_to_video_trains_caches_and_samples_with_the_wan22_vae(tmp_path):
    """Wan2.2-debug (TI2V-5B's network at CPU size) with a tiny random Wan2.2 VAE (48 channels, 16x): train.py,
    preprocess.py, training on that cache, sample.py; the latents are 16x smaller than the clips."""
    import json

    import numpy as np

    from opendit.families.wan.tiny_umt5 import save_tiny_umt5
    from opendit.families.wan.vae import save_tiny_wan_vae

    umt5 = save_tiny_umt5(tmp_path / "umt5", max_length=16)
    vae = save_tiny_wan_vae(tmp_path / "vae", wan22=True)
    common = ["--model", "Wan2.2-debug", "--umt5", umt5, "--batch_size", "2", "--max_steps", "2", "--log_every", "1",
              "--num_workers", "0"]
    run_here("train.py", *common, "--dataset", "moving_digits", "--image_size", "32", "--num_frames", "5", "--vae", vae,
        "--outputs", tmp_path / "runs")
    run_here("preprocess.py", "--family", "wan", "--model", "Wan2.2-debug", "--dataset", "moving_digits",
        "--image_size", "32", "--num_frames", "5", "--vae", vae, "--umt5", umt5, "--batch_size", "4",
        "--num_workers", "0", "--out", tmp_path / "cache")
    assert json.loads((tmp_path / "cache" / "manifest.json").read_text())["latent_shape"] == [48, 2, 2, 2]
    run_here("train.py", *common, "--dataset", "latents", "--data_path", tmp_path / "cache",
        "--outputs", tmp_path / "cached")
    run_here("sample.py", "--ckpt", "latest", "--outputs", tmp_path / "cached", "--prompt", "the digit 3 moving up",
        "--num_sampling_steps", "2", "--npz", "--out", tmp_path / "samples")
    clips = np.load(tmp_path / "samples" / "samples.npz")["arr_0"]
    assert clips.shape == (1, 5, 32, 32, 3) and clips.dtype == np.uint8
