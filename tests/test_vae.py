import pytest
import torch

from opendit.encoders import SD_VAE_SCALE, decode, encode, load_vae


def _save_tiny_vae(folder):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=16)
    vae.save_pretrained(folder)
    return vae


@pytest.fixture(scope="module")
def tiny_vae_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_vae")
    _save_tiny_vae(folder)
    return str(folder)


def test_none_means_no_vae():
    assert load_vae(None) is None
    assert load_vae("none") is None
    assert load_vae("None") is None


def test_load_frozen_and_shapes(tiny_vae_dir):
    vae = load_vae(tiny_vae_dir, "cpu", torch.float32)
    assert not vae.training
    assert all(not p.requires_grad for p in vae.parameters())
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    z = encode(vae, x, generator=torch.Generator().manual_seed(0))
    # two down blocks -> one 2x downsampling
    assert z.shape == (2, 4, 8, 8) and z.dtype == torch.float32 and not z.requires_grad
    # same generator -> same posterior sample; the scale is applied to it
    z_again = encode(vae, x, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(z, z_again)
    raw = encode(vae, x, generator=torch.Generator().manual_seed(0), scale=1.0)
    torch.testing.assert_close(z, raw * SD_VAE_SCALE)
    img = decode(vae, z)
    assert img.shape == (2, 3, 16, 16)
    assert img.min() >= -1 and img.max() <= 1


def test_loaded_weights_equal_saved(tmp_path):
    saved = _save_tiny_vae(tmp_path)
    vae = load_vae(str(tmp_path), "cpu", torch.bfloat16)
    assert next(vae.parameters()).dtype == torch.bfloat16
    ref = saved.state_dict()
    for key, value in vae.state_dict().items():
        torch.testing.assert_close(value, ref[key].to(torch.bfloat16), rtol=0, atol=0)
    # inputs of any dtype are cast to the VAE's; outputs come back as float32
    z = encode(vae, torch.zeros(1, 3, 16, 16))
    assert z.dtype == torch.float32


def test_pipeline_folder_with_vae_subfolder(tmp_path):
    _save_tiny_vae(tmp_path / "vae")
    assert load_vae(str(tmp_path)) is not None


def test_missing_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        load_vae(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_vae(str(tmp_path))  # an existing folder without a VAE in it


def test_hub_failure_says_how_to_pass_a_local_folder(monkeypatch):
    from diffusers import AutoencoderKL

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(AutoencoderKL, "from_pretrained", offline)
    with pytest.raises(OSError, match="stabilityai/sd-vae-ft-ema.*local folder"):
        load_vae("stabilityai/sd-vae-ft-ema")
