"""Chroma through diffusers' ChromaTransformer2DModel: what is special to it (the command line, resume, folders and
FLOPs: test_conformance.py). Its prompts are the pipeline's own T5 encoding with Chroma's mask (the prompt and one
padding token); the loss is the recipe's through diffusers' forward with that mask as booleans; sampled images equal
ChromaPipeline's own given the same embeddings and the masks as booleans (its own float mask is added to the logits,
diffusers issues #12116 / #13619), and differ from what the float mask gives."""
import numpy as np
import pytest
import torch

from opendit import config as cfglib
from tests.families.parts import debug_parts


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from tests.test_zimage_family import save_tiny_flux_vae
    root = tmp_path_factory.mktemp("chroma")
    return debug_parts("chroma-debug", root, save_tiny_flux_vae(root / "vae"))


CAPTIONS = ["a handwritten one", "the digit twenty two"]


def test_prompts_and_mask_are_the_pipelines(parts):
    from diffusers import ChromaPipeline
    family, cfg, enc, model = parts
    cond = enc.encode(CAPTIONS, "cpu")
    pipe = ChromaPipeline(None, None, enc.text.model, enc.text.tokenizer, model)
    embeds, mask = pipe._get_t5_prompt_embeds(CAPTIONS, max_sequence_length=16, device="cpu")
    assert torch.equal(cond["embeds"], embeds) and torch.equal(cond["mask"], mask.bool())
    lengths = [len(enc.text.tokenizer(c).input_ids) for c in CAPTIONS]
    assert cond["mask"].sum(1).tolist() == [n + 1 for n in lengths]  # and the first padding token


def test_the_loss_is_the_recipes_with_the_mask_as_booleans(parts):
    from diffusers import FluxPipeline

    from opendit.families.wrapped.glue import pack
    family, cfg, enc, model = parts
    objective = family.objective(cfg, enc)
    x, cond = objective.prepare((torch.rand(2, 3, 16, 16) * 2 - 1, CAPTIONS), torch.device("cpu"), train=False)
    assert x.shape == (2, 16, 4, 4)  # the 2x VAE's 4 channels, 2x2-packed
    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=noise)
    x_t = (1 - t[:, None, None, None]) * x + t[:, None, None, None] * noise
    mask = torch.cat([cond["mask"], torch.ones(2, 16, dtype=torch.bool)], 1)
    out = model(pack(x_t), cond["embeds"], t, FluxPipeline._prepare_latent_image_ids(2, 4, 4, "cpu", x.dtype),
                torch.zeros(16, 3), attention_mask=mask, return_dict=False)[0]
    by_hand = ((out.transpose(1, 2).reshape(x.shape) - (noise - x)) ** 2).mean((1, 2, 3))
    torch.testing.assert_close(losses, by_hand, rtol=1e-6, atol=1e-7)


def test_samples_equal_the_pipeline_given_boolean_masks(parts):
    from diffusers import ChromaPipeline, FlowMatchEulerDiscreteScheduler

    from opendit.families import LoadedModel
    from opendit.families.wrapped.chroma import SCHEDULER
    from opendit.families.wrapped.glue import pack
    from opendit.seeding import sampling_generator
    family, cfg, enc, model = parts
    loaded = LoadedModel(family, model, enc, cfg, (16, 4, 4), "random")
    sample_cfg = cfglib.SampleConfig(prompts=CAPTIONS, cfg_scale=3.0, num_sampling_steps=3, seed=5)
    ours = family.sample_batch(loaded, family.make_sampler(sample_cfg, cfg), range(0, 2), CAPTIONS, sample_cfg,
                               torch.device("cpu"))
    pipe = ChromaPipeline(FlowMatchEulerDiscreteScheduler(**SCHEDULER), enc.vae, enc.text.model, enc.text.tokenizer,
                          model)
    embeds, mask = pipe._get_t5_prompt_embeds(CAPTIONS, max_sequence_length=16, device="cpu")
    neg, neg_mask = pipe._get_t5_prompt_embeds(["", ""], max_sequence_length=16, device="cpu")
    noise = pack(torch.randn(2, 16, 4, 4, generator=sampling_generator(5, 0)))

    def theirs(as_bool: bool):
        cast = (lambda m: m.bool()) if as_bool else (lambda m: m)
        images = pipe(prompt_embeds=embeds, prompt_attention_mask=cast(mask), negative_prompt_embeds=neg,
                      negative_prompt_attention_mask=cast(neg_mask), latents=noise, height=16, width=16,
                      num_inference_steps=3, guidance_scale=3.0, max_sequence_length=16, output_type="pil").images
        return np.stack([np.asarray(im) for im in images])
    np.testing.assert_array_equal(ours, theirs(as_bool=True))
    assert not np.array_equal(ours, theirs(as_bool=False))  # the pipeline's float mask masks nothing
