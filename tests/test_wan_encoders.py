"""Wan2.1's encoders from local folders: the UMT5 text encoder (masked, zero after each caption) and the causal 3-D
VAE (AutoencoderKLWan, per-channel normalised latents), on tiny random models."""
import json
import os
import subprocess
import sys

import pytest
import torch

from opendit.booster.plugins import shard_frozen
from opendit.data.moving_digits import MovingDigitsDataset
from opendit.encoders.text import TokenTextEncoder, load_t5_encoder
from opendit.families.flux.tiny_t5 import save_tiny_t5
from opendit.families.wan.text import load_umt5_encoder, umt5_encoder_dim
from opendit.families.wan.tiny_umt5 import save_tiny_umt5
from opendit.families.wan.vae import (is_wan_vae, load_wan_vae, save_tiny_wan_vae, wan_decode, wan_latent_shape,
                                      wan_posterior, wan_vae_config)

CAPTIONS = ["the digit 3 moving up and left", "the digit 7 moving right", "the  digit 0\nmoving down", ""]


@pytest.fixture(scope="module")
def umt5_dir(tmp_path_factory):
    return save_tiny_umt5(tmp_path_factory.mktemp("tiny_umt5"))


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    return save_tiny_wan_vae(tmp_path_factory.mktemp("tiny_wan_vae"))


@pytest.fixture(scope="module")
def wan_pipeline_dir(tmp_path_factory):
    """Laid out as Wan-AI/Wan2.1-T2V-1.3B-Diffusers: text_encoder/ + tokenizer/ (UMT5), vae/, no config.json at
    the top."""
    root = tmp_path_factory.mktemp("wan_pipeline")
    save_tiny_umt5(root, pipeline=True)
    save_tiny_wan_vae(root / "vae")
    (root / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    return str(root)


# ---- UMT5 -----------------------------------------------------------------------------------------------------
def test_umt5_zero_after_each_caption_frozen_shardable(umt5_dir):
    enc = load_umt5_encoder(umt5_dir, "cpu", 16)
    assert isinstance(enc, TokenTextEncoder) and enc.dim == 32 and enc.max_length == 16
    assert not enc.model.training and not any(p.requires_grad for p in enc.model.parameters())
    assert next(enc.model.parameters()).dtype == torch.float32
    ids, mask = enc.tokenize(CAPTIONS)
    lengths = enc.lengths(CAPTIONS)
    assert ids.shape == mask.shape == (4, 16) and lengths.tolist() == [8, 6, 6, 1]  # words + EOS
    assert (ids[torch.arange(4), lengths - 1] == 1).all() and (ids[mask == 0] == 0).all()  # </s> then <pad>
    out = enc(CAPTIONS)
    assert out.shape == (4, 16, 32) and out.dtype == torch.float32 and not out.requires_grad
    for row, n in zip(out, lengths):
        assert (row[n:] == 0).all() and (row[:n].abs().sum(dim=1) > 0).all()
    torch.testing.assert_close(out[2], enc(["the digit 0 moving down"])[0], rtol=0, atol=0)  # whitespace collapsed
    assert not torch.allclose(out[0], out[1])
    # the blocks FSDP shards one by one, named as in T5's TokenTextEncoder; one process keeps the module whole
    assert len(enc.model.encoder.block) == 2
    assert shard_frozen(enc.model, enc.model.encoder.block, "zero3") is enc.model


def test_umt5_independent_of_batch_and_max_length(umt5_dir):
    short, long = load_umt5_encoder(umt5_dir, "cpu", 16), load_umt5_encoder(umt5_dir, "cpu", 40)
    out = short(CAPTIONS)
    torch.testing.assert_close(out[:1], short(CAPTIONS[:1]))
    torch.testing.assert_close(out[1:2], short(CAPTIONS[1:2]))
    out_long = long(CAPTIONS)
    torch.testing.assert_close(out_long[:, :16], out)
    assert (out_long[:, 16:] == 0).all()
    # beyond max_length: truncated, EOS kept
    many = " ".join(["digit"] * 30)
    assert short.lengths([many]).tolist() == [16] and short.tokenize([many])[0][0, -1] == 1
    assert long.lengths([many]).tolist() == [31]


def test_umt5_equals_masked_model_trimmed_and_zero_padded(umt5_dir):
    from transformers import AutoTokenizer, UMT5EncoderModel

    tokenizer, model = AutoTokenizer.from_pretrained(umt5_dir), UMT5EncoderModel.from_pretrained(umt5_dir).eval()
    tokens = tokenizer(CAPTIONS, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(tokens["input_ids"], tokens["attention_mask"]).last_hidden_state
        unmasked = model(tokens["input_ids"]).last_hidden_state
    lengths = tokens["attention_mask"].sum(dim=1)
    expected = torch.stack([torch.cat([h[:n], h.new_zeros(16 - n, h.shape[1])]) for h, n in zip(hidden, lengths)])
    out = load_umt5_encoder(umt5_dir, "cpu", 16)(CAPTIONS)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert not torch.allclose(out[1, :6], unmasked[1, :6])  # the mask matters: padding is not attended to
    bf16 = load_umt5_encoder(umt5_dir, "cpu", 16, torch.bfloat16)
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(bf16(CAPTIONS), out, rtol=0.1, atol=0.1)


def test_moving_digit_captions_get_distinct_token_sequences(umt5_dir):
    data = MovingDigitsDataset(image_size=8, num_frames=2)
    captions = sorted({data.caption(i) for i in range(len(data))})
    assert len(captions) == 80  # 10 digits x 8 directions
    ids, _ = load_umt5_encoder(umt5_dir, "cpu", 12).tokenize(captions)
    assert len({tuple(row.tolist()) for row in ids}) == len(captions)


def test_umt5_pipeline_layout_and_command_line(wan_pipeline_dir, umt5_dir, tmp_path):
    assert umt5_encoder_dim(wan_pipeline_dir) == 32 and umt5_encoder_dim(umt5_dir) == 32
    torch.testing.assert_close(load_umt5_encoder(wan_pipeline_dir, "cpu", 16)(CAPTIONS),
                               load_umt5_encoder(umt5_dir, "cpu", 16)(CAPTIONS), rtol=0, atol=0)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "opendit.families.wan.tiny_umt5", str(tmp_path / "wan"), "--pipeline"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert sorted(os.listdir(tmp_path / "wan")) == ["text_encoder", "tokenizer"]
    torch.testing.assert_close(load_umt5_encoder(str(tmp_path / "wan"), "cpu", 16)(CAPTIONS),
                               load_umt5_encoder(umt5_dir, "cpu", 16)(CAPTIONS), rtol=0, atol=0)


def test_umt5_errors_name_the_flag_and_files(tmp_path, umt5_dir):
    for none in (None, "none", "None"):
        assert load_umt5_encoder(none) is None and umt5_encoder_dim(none) is None
    with pytest.raises(FileNotFoundError, match=r"--umt5 '.*nope' does not exist.*config\.json.*tokenizer.*"
                                                r"text_encoder/.*Wan-AI/Wan2\.1-T2V-1\.3B-Diffusers"):
        load_umt5_encoder(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"--umt5 .* is not a UMT5 encoder folder.*text_encoder/config\.json"):
        umt5_encoder_dim(str(tmp_path))
    t5_dir = save_tiny_t5(tmp_path / "t5", d_model=8, layers=1)
    with pytest.raises(ValueError, match=r"--umt5 .*'t5' model, not a UMT5 encoder \(model_type umt5\)"):
        load_umt5_encoder(t5_dir)
    with pytest.raises(ValueError, match=r"--t5 .*'umt5' model, not a T5 encoder"):
        load_t5_encoder(umt5_dir)
    with pytest.raises(ValueError, match="UMT5 encoder max_length must be a positive int, got 0"):
        load_umt5_encoder(umt5_dir, "cpu", 0)


# ---- Wan VAE --------------------------------------------------------------------------------------------------
def _video(batch, frames, size, seed=0):
    return torch.rand(batch, 3, frames, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_wan_vae_round_trip_shapes_frozen(vae_dir):
    vae = load_wan_vae(vae_dir)
    assert not vae.training and not any(p.requires_grad for p in vae.parameters())
    config = wan_vae_config(vae_dir)
    assert config["_class_name"] == "AutoencoderKLWan" and len(config["latents_mean"]) == 16
    for frames, size, latent in ((9, 16, (16, 3, 2, 2)), (1, 8, (16, 1, 1, 1))):
        assert wan_latent_shape(vae, frames, size, size) == wan_latent_shape(config, frames, size, size) == latent
        mean, std = wan_posterior(vae, _video(2, frames, size))
        assert mean.shape == std.shape == (2, *latent) and mean.dtype == std.dtype == torch.float32
        assert (std > 0).all() and not mean.requires_grad
        video = wan_decode(vae, mean + std * torch.randn_like(std))
        assert video.shape == (2, 3, frames, size, size) and video.dtype == torch.float32
        assert video.min() >= -1 and video.max() <= 1
    bf16 = load_wan_vae(vae_dir, dtype=torch.bfloat16)
    assert next(bf16.parameters()).dtype == torch.bfloat16
    assert wan_posterior(bf16, _video(1, 5, 16))[0].dtype == torch.float32


def test_wan_latents_normalised_with_the_config_lists(vae_dir):
    vae = load_wan_vae(vae_dir)
    m = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    s = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    assert m.abs().min() > 0 and (s != 1).all()  # not the identity, so the test below means something
    video = _video(2, 5, 16, seed=1)
    mean, std = wan_posterior(vae, video)
    with torch.no_grad():
        raw = vae.encode(video).latent_dist
        expected = vae.decode(raw.mean).sample
    torch.testing.assert_close(mean, (raw.mean - m) / s)
    torch.testing.assert_close(std, raw.std / s)
    torch.testing.assert_close(wan_decode(vae, mean), expected, rtol=1e-4, atol=1e-5)


def test_wan_clip_frame_count_and_size_errors(vae_dir):
    vae = load_wan_vae(vae_dir)
    with pytest.raises(ValueError, match=r"--num_frames 8: .*1 \+ 4k frames.*1, 5, 9, 13, \.\.\.; use 5 or 9"):
        wan_posterior(vae, _video(1, 8, 16))
    with pytest.raises(ValueError, match=r"--num_frames 0: .*use 1 or 5"):
        wan_latent_shape(vae, 0, 16, 16)
    with pytest.raises(ValueError, match=r"--image_size 12x16: .*multiples of 8.*use e\.g\. 8x16"):
        wan_posterior(vae, _video(1, 5, 16)[..., :12, :])
    with pytest.raises(ValueError, match=r"video must be \[B, 3, T, H, W\].*\(1, 5, 16, 16\)"):
        wan_posterior(vae, _video(1, 5, 16)[:, 0])
    with pytest.raises(ValueError, match=r"latents must be \[B, 16, frames, h, w\], got shape \(1, 4, 2, 2, 2\)"):
        wan_decode(vae, torch.zeros(1, 4, 2, 2, 2))


def test_wan_vae_from_a_folder_or_a_pipeline_folder(vae_dir, wan_pipeline_dir, umt5_dir, tmp_path):
    from diffusers import AutoencoderKL

    assert is_wan_vae(vae_dir) and is_wan_vae(wan_pipeline_dir)
    flat, pipeline = load_wan_vae(vae_dir), load_wan_vae(wan_pipeline_dir)
    for key, value in flat.state_dict().items():
        torch.testing.assert_close(pipeline.state_dict()[key], value, rtol=0, atol=0)
    assert wan_vae_config(wan_pipeline_dir)["latents_std"] == flat.config.latents_std
    for none in (None, "none", "None"):
        assert load_wan_vae(none) is None and not is_wan_vae(none)
    sd_dir = tmp_path / "sd_vae"
    AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4).save_pretrained(sd_dir)
    for not_wan in (str(sd_dir), umt5_dir, str(tmp_path / "nope"), "stabilityai/sd-vae-ft-ema"):
        assert not is_wan_vae(not_wan)
    with pytest.raises(ValueError, match=r"--vae .*sd_vae.*describes a 'AutoencoderKL' model, not Wan's causal 3-D "
                                         r"VAE \(AutoencoderKLWan\)"):
        load_wan_vae(str(sd_dir))
    with pytest.raises(ValueError, match=r"--vae .*describes a 'umt5' model"):
        wan_vae_config(umt5_dir)


def test_wan_vae_missing_files_name_the_flag_and_files(vae_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--vae '.*nope' does not exist.*config\.json.*"
                                                r"diffusion_pytorch_model\*\.safetensors.*vae/.*"
                                                r"Wan-AI/Wan2\.1-T2V-1\.3B-Diffusers"):
        load_wan_vae(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"--vae .* has no config\.json \(nor vae/config\.json\)"):
        wan_vae_config(str(tmp_path))
    (tmp_path / "config.json").write_text(open(os.path.join(vae_dir, "config.json")).read())
    assert is_wan_vae(str(tmp_path)) and wan_vae_config(str(tmp_path))["z_dim"] == 16  # the config alone will do
    with pytest.raises(FileNotFoundError, match=r"--vae .* has no weights \(no diffusion_pytorch_model"):
        load_wan_vae(str(tmp_path))
