"""Wan2.1 through diffusers' own WanTransformer3DModel (the diffusers video kind, opendit.families.wrapped.wan21)
beside opendit's native Wan family: the same weights (converted by WAN_WEIGHTS) and the same clips give the same
prompt conditions (the pipeline's UMT5 encoding against opendit's) and equal losses, in pixel space and through a
tiny AutoencoderKLWan (the command line, exact resume: tests/families/test_conformance.py); sequence parallelism
at 2 ranks: tests/test_wrapped_sp.py."""
import pytest
import torch

from opendit import config as cfglib
from tests.families.test_wan import wan_cfg


@pytest.fixture(scope="module")
def umt5(tmp_path_factory):
    from opendit.families.wan.tiny_umt5 import save_tiny_umt5
    return save_tiny_umt5(tmp_path_factory.mktemp("umt5") / "umt5", max_length=16)


def wrapped_cfg(outputs, umt5, **kw):
    base = dict(model="wan-debug-diffusers", dataset="moving_digits", image_size=16, num_frames=5, vae="none",
                text_encoder=umt5, batch_size=4, max_steps=3, log_every=1, ckpt_every=100, num_workers=0,
                outputs=str(outputs), lr=1e-3, ema_decay=0.9)
    return cfglib.TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("autoencoder", ["pixels", "AutoencoderKLWan"])
def test_same_weights_and_clips_give_the_native_familys_conditions_and_losses(tmp_path, umt5, autoencoder):
    from opendit.families import get_family
    from opendit.families.wan.weights import WAN_WEIGHTS

    vae = "none"
    if autoencoder != "pixels":
        from opendit.families.wan.vae import save_tiny_wan_vae
        vae = save_tiny_wan_vae(tmp_path / "vae")
    cpu = torch.device("cpu")
    native, wrapped = get_family("wan"), get_family("wan21")
    size = 16 if vae == "none" else 64  # the tiny VAE: 8x down; Wan-debug patches 4x4
    cfg_n = native.resolve_config(wan_cfg("unused", umt5, vae=vae, image_size=size, num_frames=5))
    cfg_w = wrapped.resolve_config(wrapped_cfg("unused", umt5, vae=vae, image_size=size))
    enc_n, enc_w = native.load_encoders(cfg_n, cpu, training=True), wrapped.load_encoders(cfg_w, cpu, training=True)
    torch.manual_seed(0)
    model_n = native.build_model(cfg_n, native.latent_shape(cfg_n, enc_n)).eval()
    model_w = wrapped.build_model(cfg_w, wrapped.latent_shape(cfg_w, enc_w)).eval()
    model_w.load_state_dict(WAN_WEIGHTS.to_diffusers(model_n.state_dict()))
    clips, captions = torch.rand(2, 3 if vae != "none" else 1, 5, size, size) * 2 - 1, \
        ["the digit 7 moving left", "the digit 2 moving up"]
    torch.manual_seed(1)
    x_n, cond_n = native.objective(cfg_n, enc_n).prepare((clips, [7, 2], captions), cpu, train=False)
    torch.manual_seed(1)
    x_w, cond_w = wrapped.objective(cfg_w, enc_w).prepare((clips, [7, 2], captions), cpu, train=False)
    torch.testing.assert_close(cond_w["embeds"], cond_n["context"], rtol=0, atol=0)
    torch.testing.assert_close(x_w, x_n, rtol=1e-6, atol=1e-6)  # the same posterior sample, normalised alike
    t, noise = torch.tensor([0.2, 0.7]), torch.randn_like(x_n)
    losses_n, _ = native.objective(cfg_n, enc_n).losses(model_n, x_n, cond_n, t_frac=t, noise=noise)
    losses_w, _ = wrapped.objective(cfg_w, enc_w).losses(model_w, x_n, cond_w, t_frac=t, noise=noise)
    torch.testing.assert_close(losses_w, losses_n, rtol=1e-5, atol=1e-6)


def test_a_text_encoder_that_is_not_umt5_is_named(tmp_path):
    from opendit.families import get_family
    from opendit.families.wrapped.flux2 import save_tiny_qwen3

    qwen = save_tiny_qwen3(tmp_path / "qwen3")
    with pytest.raises(ValueError, match="a Qwen3ForCausalLM, not the UMT5 encoder Wan2.1 reads"):
        get_family("wan21").glue.text_encoder(qwen, "cpu", torch.float32, "wan-debug-diffusers")
