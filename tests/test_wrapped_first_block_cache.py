"""sample.py --cache fbcache for the diffusers-transformer kind is diffusers' own First Block Cache: Qwen-Image's
images (true CFG: the pipeline's per-branch contexts) equal the pipeline's with the cache enabled through diffusers'
own enable_cache bitwise; threshold 0 changes nothing and a high one skips the other blocks (counted) and changes
the images; no hook is left on the model after a call; models whose blocks diffusers' hook cannot run (FLUX.2,
Z-Image, HunyuanVideo-1.5 in diffusers 0.42) are refused with the reason."""
import numpy as np
import pytest
import torch

from opendit import config as cfglib

TEXT = {"qwen-image-debug": "save_tiny_qwen25vl", "z-image-debug": "save_tiny_qwen3",
        "flux2-klein-debug": "save_tiny_qwen3"}


def _parts(model, folder):
    import importlib

    from opendit.families import LoadedModel, family_of
    module = "qwenimage" if model.startswith("qwen") else "flux2"
    text = getattr(importlib.import_module(f"opendit.families.wrapped.{module}"), TEXT[model])(folder / "text")
    family = family_of(model)
    cfg = family.resolve_config(cfglib.TrainConfig(model=model, dataset="captioned_digits", image_size=8, vae="none",
                                                   text_encoder=text))
    enc = family.load_encoders(cfg, torch.device("cpu"), training=False)
    torch.manual_seed(0)
    shape = family.latent_shape(cfg, enc)
    transformer = family.build_model(cfg, shape).eval()
    with torch.no_grad():  # no zero-initialised modulation: every block changes the output, as trained ones do
        for p in transformer.parameters():
            p.normal_(0, 0.1)
    return family, LoadedModel(family, transformer, enc, cfg, shape, "random")


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    return _parts("qwen-image-debug", tmp_path_factory.mktemp("fbcache"))


def _sample_cfg(cache="none", threshold=None):
    return cfglib.SampleConfig(prompts=["a handwritten one", "the digit seven"], cfg_scale=3.0, num_sampling_steps=6,
                               seed=5, cache=cache, cache_threshold=threshold)


def _sample(parts, cache="none", threshold=None):
    family, loaded = parts
    sample_cfg = _sample_cfg(cache, threshold)
    return family.sample_batch(loaded, family.make_sampler(sample_cfg, loaded.cfg), range(2), sample_cfg.prompts,
                               sample_cfg, torch.device("cpu"))


def _count_last_block(model):
    from opendit.families.wrapped.glue import block_lists
    last = getattr(model, block_lists(model)[-1])[-1]
    calls = []
    next(m for m in last.modules() if isinstance(m, torch.nn.Linear)).register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_threshold_zero_changes_nothing_and_a_high_one_skips_blocks(parts):
    family, loaded = parts
    calls = _count_last_block(loaded.model)
    plain = _sample(parts)
    full = len(calls)
    np.testing.assert_array_equal(_sample(parts, "fbcache", 0.0), plain)
    assert len(calls) == 2 * full
    skipped = _sample(parts, "fbcache", 10.0)
    assert len(calls) - 2 * full < full and not np.array_equal(skipped, plain)
    assert not any(getattr(m, "_diffusers_hook", None) and m._diffusers_hook.hooks for m in loaded.model.modules())
    assert family.sample_defaults(cfglib.SampleConfig(cache="fbcache"), loaded.cfg)["cache_threshold"] == 0.05


def test_images_equal_the_pipeline_with_diffusers_own_enable_cache(parts):
    """Qwen-Image's pipeline keeps one cache state per guidance branch; the same prompt conditions and noise."""
    import types

    from diffusers import FirstBlockCacheConfig

    from opendit.seeding import sampling_generator
    family, loaded = parts
    ours = _sample(parts, "fbcache", 1.0)
    model, enc = loaded.model, loaded.encoders
    cond = enc.encode(["a handwritten one", "the digit seven"], "cpu")
    negative = {k: v.expand(2, *v.shape[1:]) for k, v in enc.encode([""], "cpu").items()}
    pipe = family.glue.pipeline(model, enc.vae, None)
    noise = torch.randn(2, *loaded.latent_shape, generator=sampling_generator(5, 0))
    model.enable_cache(FirstBlockCacheConfig(threshold=1.0))
    try:
        found = pipe(latents=family.glue.pipeline_latents(noise), height=8, width=8, num_inference_steps=6,
                     output_type="np", **family.glue.pipeline_call(types.SimpleNamespace(cfg=loaded.cfg),
                                                                   _sample_cfg(), cond, negative)).images
    finally:
        model.disable_cache()
    np.testing.assert_array_equal(ours, (np.asarray(found) * 255).round().astype(np.uint8))
    assert not np.array_equal(ours, _sample(parts))  # the cache skipped work at this threshold


def test_models_whose_blocks_the_hook_cannot_run_are_refused(tmp_path):
    from opendit.families import get_family
    from opendit.families.wrapped.first_block_cache import first_block_cache
    with pytest.raises(ValueError, match="cannot run Flux2Transformer2DModel: its first block returns text and "
                                         "image tokens apart"):
        _sample(_parts("flux2-klein-debug", tmp_path), "fbcache", 0.1)
    with pytest.raises(ValueError, match="cannot run ZImageTransformer2DModel: its ZImageTransformerBlock blocks take "
                                         "no hidden_states"):
        _sample(_parts("z-image-debug", tmp_path / "z"), "fbcache", 0.1)
    with torch.device("meta"):
        hunyuan = get_family("hunyuanvideo15").models["hunyuanvideo1.5-debug"].build(in_channels=3)
    with pytest.raises(ValueError, match="no metadata for its HunyuanVideo15TransformerBlock blocks"):
        with first_block_cache(hunyuan, 0.1):
            pass
