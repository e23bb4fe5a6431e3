"""Latent and text-embedding caches of the diffusers-transformer kind: preprocess.py stores each image's VAE
posterior and its caption's conditions as the pipeline's own encoding gives them (masks too); training on the cache
loads no text encoder and gives the losses of encoding on the fly; its previews and sample.py work from the cache's
run; a cache is one model's. The same for clips of a video model (HunyuanVideo-1.5)."""
import json

import numpy as np
import pytest

from opendit import config as cfglib
from tests.run_each import losses_of, run_here
from tests.test_flux2_family import save_tiny_flux2_vae
from tests.test_qwenimage_family import save_tiny_qwen_vae
from tests.test_train import run_trainer


def _encoder(model, folder):
    if model.startswith("flux2"):
        from opendit.families.wrapped.flux2 import save_tiny_qwen3
        return save_tiny_qwen3(folder), save_tiny_flux2_vae(folder.parent / "vae"), "flux2"
    from opendit.families.wrapped.qwenimage import save_tiny_qwen25vl
    return save_tiny_qwen25vl(folder), save_tiny_qwen_vae(folder.parent / "vae"), "qwenimage"


@pytest.mark.parametrize("model", ["flux2-klein-debug", "qwen-image-debug"])
def test_a_cache_trains_like_encoding_on_the_fly_and_its_run_samples(tmp_path, model):
    text, vae, family = _encoder(model, tmp_path / "text")
    cache = tmp_path / "cache"
    run_here("preprocess.py", "--family", family, "--model", model, "--dataset", "captioned_digits", "--image_size",
        "16", "--vae", vae, "--text_encoder", text, "--out", cache, "--batch_size", "256", "--num_workers", "0")
    manifest = json.loads((cache / "manifest.json").read_text())
    conditions = ["cond_embeds"] if family == "flux2" else ["cond_embeds", "cond_mask"]
    assert manifest["embeddings"] == conditions and manifest["extras"] == sorted(conditions)
    assert manifest["model"] == model and manifest["text_encoder"] == text and manifest["count"] == 1797

    common = dict(model=model, image_size=16, batch_size=4, max_steps=3, log_every=1, num_workers=0, lr=1e-3,
                  caption_dropout_prob=0.5)
    trainer, _ = run_trainer(cfglib.TrainConfig(**common, dataset="latents", data_path=str(cache),
                                                outputs=str(tmp_path / "c"), sample_every=3))
    assert trainer.encoders.text is None and trainer.cfg.text_encoder == text  # for sampling later
    run_trainer(cfglib.TrainConfig(**common, dataset="captioned_digits", vae=vae, text_encoder=text,
                                   outputs=str(tmp_path / "f")))
    cached, fly = (losses_of(next((tmp_path / d).glob("000-*"))) for d in ("c", "f"))
    np.testing.assert_allclose(cached, fly, rtol=1e-5)
    assert list((tmp_path / "c").glob("000-*/previews/*"))  # the preview, its prompts from the cache

    out = tmp_path / "samples"
    run_here("sample.py", "--ckpt", "latest", "--outputs", tmp_path / "c", "--prompts", "a handwritten one",
        "--num_sampling_steps", "2", "--npz", "--out", out)
    assert np.load(out / "samples.npz")["arr_0"].shape == (1, 16, 16, 3)

    with pytest.raises(ValueError, match="--model flux2-dev-debug disagrees with the latent cache"):
        from opendit.families import get_family
        get_family("flux2").resolve_config(cfglib.TrainConfig(model="flux2-dev-debug", dataset="latents",
                                                              data_path=str(cache)))


def test_a_cache_needs_its_model_and_text_encoder():
    from opendit.families import get_family
    cfg = cfglib.PreprocessConfig(family="flux2", dataset="captioned_digits", vae="v", out="o")
    with pytest.raises(ValueError, match="a flux2 cache is for one model .* flux2-klein-4b"):
        get_family("flux2").resolve_cache_config(cfg)
    with pytest.raises(ValueError, match="--text_encoder is required"):
        get_family("flux2").resolve_cache_config(cfglib.PreprocessConfig(**{**vars(cfg), "model": "flux2-klein-debug"}))


@pytest.mark.slow
def test_a_clip_cache_trains_like_encoding_on_the_fly_and_its_run_samples(tmp_path):
    """HunyuanVideo-1.5 with a tiny video VAE (16x down, 4x in time): 5-frame clips cached as [4, 2, 2, 2] latents
    beside both encoders' conditions and masks; training on them loads no text encoder and gives the losses of
    encoding the clips on the fly."""
    from opendit.families.wrapped.hunyuanvideo15 import save_tiny_text_encoders
    from tests.test_hunyuanvideo15_family import save_tiny_video_vae

    text, vae = save_tiny_text_encoders(tmp_path / "text"), save_tiny_video_vae(tmp_path / "vae")
    cache = tmp_path / "cache"
    run_here("preprocess.py", "--family", "hunyuanvideo15", "--model", "hunyuanvideo1.5-debug", "--dataset",
        "moving_digits", "--image_size", "32", "--num_frames", "5", "--vae", vae, "--text_encoder", text, "--out",
        cache, "--batch_size", "64", "--num_workers", "0")
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["latent_shape"] == [4, 2, 2, 2] and manifest["num_frames"] == 5
    assert manifest["embeddings"] == ["cond_embeds", "cond_mask", "cond_embeds_2", "cond_mask_2"]

    common = dict(model="hunyuanvideo1.5-debug", image_size=32, num_frames=5, batch_size=2, max_steps=3, log_every=1,
                  num_workers=0, lr=1e-3, caption_dropout_prob=0.5)
    trainer, _ = run_trainer(cfglib.TrainConfig(**common, dataset="latents", data_path=str(cache),
                                                outputs=str(tmp_path / "c"), sample_every=3, preview_steps=2))
    assert trainer.encoders.text is None
    assert list((tmp_path / "c").glob("000-*/previews/*"))  # the preview, its prompts from the cache
    run_trainer(cfglib.TrainConfig(**common, dataset="moving_digits", vae=vae, text_encoder=text,
                                   outputs=str(tmp_path / "f")))
    cached, fly = (losses_of(next((tmp_path / d).glob("000-*"))) for d in ("c", "f"))
    np.testing.assert_allclose(cached, fly, rtol=1e-5)
    run_here("sample.py", "--ckpt", "latest", "--outputs", tmp_path / "c", "--prompts", "the digit 3 moving up",
        "--num_sampling_steps", "2", "--npz", "--out", tmp_path / "samples")
    assert np.load(tmp_path / "samples" / "samples.npz")["arr_0"].shape == (1, 5, 32, 32, 3)
