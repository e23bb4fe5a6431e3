"""Text encoders for FLUX (tiny random T5 and CLIP from local folders) and the FLUX VAE's scale and shift."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from opendit.data import DIGIT_CAPTION_WORDS
from opendit.encoders.text import (CLIPTextEncoder, TokenTextEncoder, load_t5_encoder, load_text_encoder,
                                   t5_encoder_dim, text_encoder_dim)
from opendit.encoders.tiny_clip import DEMO_WORDS, demo_words, save_tiny_clip
from opendit.encoders.vae import decode, encode, scale_latents, unscale_latents, vae_scale_shift
from opendit.families.flux.family import FLUX_VAE_SCALE, FLUX_VAE_SHIFT
from opendit.families.flux.tiny_t5 import save_tiny_t5

CAPTIONS = ["a handwritten seven", "the digit one", "an eight", ""]
MODEL_FILES = ("config.json", "model.safetensors")


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    return save_tiny_t5(tmp_path_factory.mktemp("tiny_t5"), d_model=32, layers=2)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("tiny_clip"), words="all", max_length=77)


def _split(src, model_dir, tok_dir):
    """A save_pretrained folder -> a pipeline's model subfolder and tokenizer subfolder."""
    os.makedirs(model_dir)
    os.makedirs(tok_dir)
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), model_dir if name in MODEL_FILES else tok_dir)


@pytest.fixture(scope="module")
def flux_pipeline_dir(tmp_path_factory, t5_dir, clip_dir):
    """Laid out as black-forest-labs/FLUX.1-dev: text_encoder/ + tokenizer/ (CLIP), text_encoder_2/ +
    tokenizer_2/ (T5), no config.json at the top."""
    root = tmp_path_factory.mktemp("flux_pipeline")
    _split(clip_dir, root / "text_encoder", root / "tokenizer")
    _split(t5_dir, root / "text_encoder_2", root / "tokenizer_2")
    (root / "model_index.json").write_text("{}")
    return str(root)


# ---- T5 -------------------------------------------------------------------------------------------------------
def test_t5_shapes_padding_deterministic_frozen(t5_dir):
    enc = load_t5_encoder(t5_dir, "cpu", 16, torch.float32)
    assert isinstance(enc, TokenTextEncoder) and enc.dim == 32 and enc.max_length == 16
    assert not enc.model.training and not any(p.requires_grad for p in enc.model.parameters())
    ids = enc.tokenize(CAPTIONS)[0]
    assert ids.shape == (4, 16)
    # T5's layout: words, then </s> (1), then <pad> (0) up to max_length; the empty caption is just </s>
    assert ids[0, :4].tolist()[-1] == 1 and (ids[0, 4:] == 0).all() and ids[3, 0] == 1 and (ids[3, 1:] == 0).all()
    assert (ids != 2).all()  # every demo word is known (2 = <unk>)
    out = enc(CAPTIONS)
    assert out.shape == (4, 16, 32) and out.dtype == torch.float32 and not out.requires_grad
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, enc(CAPTIONS), rtol=0, atol=0)
    again = load_t5_encoder(t5_dir, "cpu", 16, torch.float32)  # a fresh load: the same weights
    torch.testing.assert_close(out, again(CAPTIONS), rtol=0, atol=0)
    torch.testing.assert_close(out[:1], enc(CAPTIONS[:1]))  # no dependence on the rest of the batch
    assert not torch.allclose(out[0], out[1])
    long = enc.tokenize([" ".join(["seven"] * 40)])[0]
    assert long.shape == (1, 16) and long[0, -1] == 1  # truncated to max_length, EOS kept


def test_t5_bf16_default(t5_dir):
    enc = load_t5_encoder(t5_dir, "cpu", 8)
    assert next(enc.model.parameters()).dtype == torch.bfloat16
    out = enc(CAPTIONS[:2])
    assert out.dtype == torch.float32 and out.shape == (2, 8, 32)
    ref = load_t5_encoder(t5_dir, "cpu", 8, torch.float32)(CAPTIONS[:2])
    torch.testing.assert_close(out, ref, rtol=0.1, atol=0.1)


def test_pipeline_folder_layout(flux_pipeline_dir, t5_dir, clip_dir):
    assert t5_encoder_dim(flux_pipeline_dir) == 32 and text_encoder_dim(flux_pipeline_dir) == 32
    t5 = load_t5_encoder(flux_pipeline_dir, "cpu", 8, torch.float32)
    torch.testing.assert_close(t5(CAPTIONS), load_t5_encoder(t5_dir, "cpu", 8, torch.float32)(CAPTIONS))
    clip = load_text_encoder(flux_pipeline_dir, "cpu")
    torch.testing.assert_close(clip(CAPTIONS), CLIPTextEncoder(clip_dir)(CAPTIONS))


def test_none_means_no_encoder():
    for none in (None, "none", "None"):
        assert load_t5_encoder(none) is None and t5_encoder_dim(none) is None
        assert load_text_encoder(none) is None and text_encoder_dim(none) is None


def test_encoder_dim_reads_config_without_weights(tmp_path, t5_dir):
    shutil.copy(os.path.join(t5_dir, "config.json"), tmp_path)
    assert t5_encoder_dim(str(tmp_path)) == 32
    with pytest.raises(FileNotFoundError, match=r"--t5 .*no weights and no tokenizer files.*config\.json"):
        load_t5_encoder(str(tmp_path))


def test_missing_and_invalid_folders_name_the_flag_and_files(tmp_path, t5_dir, clip_dir):
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"--t5 '.*nope' does not exist.*config\.json.*text_encoder_2/"
                                                r".*google/t5-v1_1-xxl"):
        load_t5_encoder(missing)
    with pytest.raises(FileNotFoundError, match=r"--clip '.*nope' does not exist.*config\.json.*tokenizer"):
        load_text_encoder(missing)
    with pytest.raises(FileNotFoundError, match=r"--t5 .* is not a T5 encoder folder"):
        t5_encoder_dim(str(tmp_path))  # an existing folder without a model in it
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    for name in MODEL_FILES:
        shutil.copy(os.path.join(t5_dir, name), no_tok)
    with pytest.raises(FileNotFoundError, match=r"--t5 .* has no tokenizer files.*spiece\.model"):
        load_t5_encoder(str(no_tok))
    # the wrong kind of model: names what the config holds
    with pytest.raises(ValueError, match=r"--t5 .*'clip_text_model' model, not a T5 encoder"):
        t5_encoder_dim(clip_dir)
    with pytest.raises(ValueError, match=r"--clip .*'t5' model, not a CLIP text encoder"):
        load_text_encoder(t5_dir)
    with pytest.raises(ValueError, match="max_length"):
        load_t5_encoder(t5_dir, "cpu", 0)


# ---- CLIP -----------------------------------------------------------------------------------------------------
def test_clip_dtype(clip_dir):
    ref = load_text_encoder(clip_dir, "cpu")
    assert next(ref.model.parameters()).dtype == torch.float32  # the default stays float32 (video DiT)
    enc = load_text_encoder(clip_dir, "cpu", dtype=torch.bfloat16)
    assert next(enc.model.parameters()).dtype == torch.bfloat16
    assert not any(p.requires_grad for p in enc.model.parameters()) and not enc.model.training
    out = enc(CAPTIONS)
    assert out.shape == (4, 32) and out.dtype == torch.float32 and enc.max_length == 77
    torch.testing.assert_close(out, ref(CAPTIONS), rtol=0.1, atol=0.1)


def test_tiny_encoder_vocabularies_and_command_line(tmp_path):
    assert demo_words("digits") == list(DIGIT_CAPTION_WORDS) and demo_words("moving_digits") == DEMO_WORDS
    assert demo_words("all") == [*DEMO_WORDS, *DIGIT_CAPTION_WORDS] and demo_words(("a", "b")) == ["a", "b"]
    with pytest.raises(ValueError, match="unknown word set 'digit'; valid names: moving_digits, digits, edit_digits, "
                                         "all"):
        demo_words("digit")
    # what train_flux.sh runs: a tiny T5 (and CLIP) over the captioned digits' words
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "opendit.families.flux.tiny_t5", str(tmp_path / "t5"), "--clip",
                          str(tmp_path / "clip")], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    t5 = load_t5_encoder(str(tmp_path / "t5"), "cpu", 8, torch.float32)
    clip = load_text_encoder(str(tmp_path / "clip"))
    assert (t5.tokenize(CAPTIONS)[0] != 2).all()  # 2 = T5's <unk>
    assert all(1 not in ids for ids in clip.tokenizer(CAPTIONS)["input_ids"])  # 1 = tiny CLIP's <unk>


# ---- FLUX VAE -------------------------------------------------------------------------------------------------
def test_flux_vae_scale_shift_round_trip(tmp_path):
    from diffusers import AutoencoderKL

    assert (FLUX_VAE_SCALE, FLUX_VAE_SHIFT) == (0.3611, 0.1159)
    torch.manual_seed(0)
    vae = AutoencoderKL(down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 16),
                        layers_per_block=1, latent_channels=16, norm_num_groups=8, sample_size=16,
                        scaling_factor=FLUX_VAE_SCALE, shift_factor=FLUX_VAE_SHIFT).eval()
    assert vae_scale_shift(vae) == (FLUX_VAE_SCALE, FLUX_VAE_SHIFT)
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    raw = encode(vae, x, generator=torch.Generator().manual_seed(0), scale=1.0, shift=0.0)
    z = encode(vae, x, generator=torch.Generator().manual_seed(0), scale=FLUX_VAE_SCALE, shift=FLUX_VAE_SHIFT)
    assert z.shape == (2, 16, 8, 8)
    torch.testing.assert_close(z, (raw - FLUX_VAE_SHIFT) * FLUX_VAE_SCALE)  # FLUX's ae.encode
    torch.testing.assert_close(unscale_latents(z, FLUX_VAE_SCALE, FLUX_VAE_SHIFT), raw)  # FLUX's ae.decode
    torch.testing.assert_close(scale_latents(raw, FLUX_VAE_SCALE, FLUX_VAE_SHIFT), z)
    # decoding the scaled latents with the same (scale, shift) is decoding the raw posterior sample
    torch.testing.assert_close(decode(vae, z, scale=FLUX_VAE_SCALE, shift=FLUX_VAE_SHIFT),
                               decode(vae, raw, scale=1.0, shift=0.0), rtol=1e-4, atol=1e-5)
    sd = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4)
    assert vae_scale_shift(sd) == (0.18215, 0.0)
