"""Ideogram 4 through diffusers' Ideogram4Transformer2DModel: what is special to it (the command line, resume, folders
and FLOPs: test_conformance.py). Its prompts are the pipeline's own encode_prompt, the empty caption no text at all;
the loss is the recipe's through diffusers' forward on the pipeline's packed sequence (model time 1 - s, x - noise
predicted), and a dropped caption is the pipeline's unconditional pass; latents are the inverse of the pipeline's
decoding; sampled images equal Ideogram4Pipeline's own, called with prompt strings and its text encoder, bitwise.
diffusers has no converter of an official single file for it, so there is no official layout to test."""
import numpy as np
import pytest
import torch

from opendit import config as cfglib
from tests.families.parts import debug_parts

CAPTIONS = ["a handwritten one", "the digit twenty two"]
LENGTH = 24  # ideogram4-debug's max_sequence_length


@pytest.fixture(scope="module", autouse=True)
def one_thread_for_the_module():
    """conftest's one_thread for every test and fixture here (its 36-layer text encoder is many tiny ops)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from tests.test_flux2_family import save_tiny_flux2_vae
    root = tmp_path_factory.mktemp("ideogram4")
    return debug_parts("ideogram4-debug", root, save_tiny_flux2_vae(root / "vae"))


def _pipeline(enc, model, scheduler=None, vae=None):
    from diffusers import Ideogram4Pipeline
    return Ideogram4Pipeline(scheduler, vae, enc.text.model, enc.text.tokenizer, model, model)


def test_prompts_are_the_pipelines_and_the_empty_caption_is_no_text(parts):
    from diffusers.models.transformers.transformer_ideogram4 import LLM_TOKEN_INDICATOR
    family, cfg, enc, model = parts
    cond = enc.encode([*CAPTIONS, ""], "cpu")
    embeds, _, _, indicator = _pipeline(enc, model).encode_prompt(CAPTIONS, 4, 4, LENGTH, "cpu")
    assert torch.equal(cond["embeds"][:2], embeds[:, :LENGTH])  # the text region of the packed sequence
    assert torch.equal(cond["mask"][:2], indicator[:, :LENGTH] == LLM_TOKEN_INDICATOR)
    assert cond["mask"][:2].sum(1).tolist() == [8, 9]  # chat template (5 tokens) + the words, left-padded
    assert not cond["mask"][2].any() and not cond["embeds"][2].any()


def test_the_loss_is_the_recipe_through_the_pipelines_sequence(parts):
    from opendit.families.wrapped.glue import pack
    family, cfg, enc, model = parts
    objective = family.objective(cfg, enc)
    x, cond = objective.prepare((torch.rand(2, 3, 16, 16) * 2 - 1, CAPTIONS), torch.device("cpu"), train=False)
    assert x.shape == (2, 16, 4, 4)  # the 2x VAE's 4 channels in 2x2 patches
    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=noise)
    x_t = (1 - t[:, None, None, None]) * x + t[:, None, None, None] * noise
    embeds, position_ids, segment_ids, indicator = _pipeline(enc, model).encode_prompt(CAPTIONS, 4, 4, LENGTH, "cpu")
    hidden = torch.cat([torch.zeros(2, LENGTH, 16), pack(x_t)], 1)
    out = model(hidden, 1 - t, embeds, position_ids, segment_ids, indicator, return_dict=False)[0][:, LENGTH:]
    velocity = -out.transpose(1, 2).reshape(x.shape)  # the model predicts x - noise
    by_hand = ((velocity - (noise - x)) ** 2).mean((1, 2, 3))
    torch.testing.assert_close(losses, by_hand, rtol=1e-6, atol=1e-7)


def test_a_dropped_caption_is_the_pipelines_unconditional_pass(parts):
    """No text: the image tokens attend to themselves alone, as the pipeline's unconditional call (image tokens
    only, text features zeroed) computes them."""
    from opendit.families.wrapped.ideogram4 import forward, output
    family, cfg, enc, model = parts
    x, t = torch.randn(1, 16, 4, 4), torch.tensor([0.4])
    with torch.no_grad():
        ours = output(model(**forward(model, x, t, enc.encode([""], "cpu")))[0], x.shape)
        _, position_ids, segment_ids, indicator = _pipeline(enc, model).encode_prompt(CAPTIONS[:1], 4, 4, LENGTH,
                                                                                       "cpu")
        theirs = model(x.flatten(2).transpose(1, 2), 1 - t, torch.zeros(1, 16, 208), position_ids[:, LENGTH:],
                       segment_ids[:, LENGTH:], indicator[:, LENGTH:], return_dict=False)[0]
    torch.testing.assert_close(ours, -theirs.transpose(1, 2).reshape(x.shape), rtol=1e-5, atol=1e-6)


def test_latents_are_the_inverse_of_the_pipelines_decoding(parts):
    """The pipeline decodes what to_model made of z (swapped in as its last latents) to what the VAE decodes of z:
    the (dy, dx, c) patch order and the batch-norm statistics, undone."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from opendit.families.wrapped.glue import pack
    from opendit.families.wrapped.ideogram4 import SCHEDULER
    family, cfg, enc, model = parts
    z = torch.randn(1, 4, 8, 8)
    ours = pack(family.glue.to_model_space(enc.vae, z))
    pipe = _pipeline(enc, model, FlowMatchEulerDiscreteScheduler(**SCHEDULER), enc.vae)
    images = pipe(CAPTIONS[:1], height=16, width=16, num_inference_steps=1, guidance_scale=2.0,
                  guidance_schedule=None, max_sequence_length=LENGTH, output_type="pt",
                  callback_on_step_end=lambda p, i, t, kw: {"latents": ours}).images
    with torch.no_grad():
        expected = (enc.vae.decode(z).sample / 2 + 0.5).clamp(0, 1)
    torch.testing.assert_close(images, expected, rtol=1e-4, atol=1e-5)


def test_samples_equal_the_pipelines_own_given_prompt_strings(parts):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from opendit.families import LoadedModel
    from opendit.families.wrapped.glue import pack
    from opendit.families.wrapped.ideogram4 import SCHEDULER
    from opendit.seeding import sampling_generator
    family, cfg, enc, model = parts
    loaded = LoadedModel(family, model, enc, cfg, (16, 4, 4), "random")
    sample_cfg = cfglib.SampleConfig(prompts=CAPTIONS, cfg_scale=3.0, num_sampling_steps=3, seed=5)
    ours = family.sample_batch(loaded, family.make_sampler(sample_cfg, cfg), range(0, 2), CAPTIONS, sample_cfg,
                               torch.device("cpu"))
    pipe = _pipeline(enc, model, FlowMatchEulerDiscreteScheduler(**SCHEDULER), enc.vae)
    noise = pack(torch.randn(2, 16, 4, 4, generator=sampling_generator(5, 0)))
    images = pipe(CAPTIONS, latents=noise, height=16, width=16, num_inference_steps=3, guidance_scale=3.0,
                  guidance_schedule=None, max_sequence_length=LENGTH, output_type="pil").images
    np.testing.assert_array_equal(ours, np.stack([np.asarray(im) for im in images]))


def test_a_negative_prompt_is_refused(parts):
    from opendit.families.wrapped.ideogram4 import call
    family, cfg, enc, model = parts
    cond, negative = enc.encode(CAPTIONS, "cpu"), enc.encode(["a blurry one"], "cpu")
    with pytest.raises(ValueError, match="takes no negative prompt; leave it out"):
        call({}, cfglib.SampleConfig(prompts=CAPTIONS), cond, negative)


def test_rope_frequencies_are_computed_on_the_meta_device_and_stay_float32(parts):
    """Built on the meta device, the model gets its MRoPE frequencies; cast to bf16 (sampling's --mixed_precision),
    they are float32 again at the forward, as diffusers' from_pretrained keeps them."""
    from opendit.families.wrapped.ideogram4 import forward
    family, cfg, enc, model = parts
    with torch.device("meta"):
        built = family.models["ideogram4-debug"].build(in_channels=16)
    assert torch.equal(built.rotary_emb.inv_freq, model.rotary_emb.inv_freq)
    cast = family.models["ideogram4-debug"].build(in_channels=16).to(torch.bfloat16)
    assert cast.rotary_emb.inv_freq.dtype == torch.bfloat16
    x = torch.randn(1, 16, 4, 4, dtype=torch.bfloat16)
    cond = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in enc.encode(CAPTIONS[:1], "cpu").items()}
    with torch.no_grad():
        cast(**forward(cast, x, torch.tensor([0.5], dtype=torch.bfloat16), cond))
    assert torch.equal(cast.rotary_emb.inv_freq, model.rotary_emb.inv_freq)
