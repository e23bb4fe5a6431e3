"""Kandinsky 5.0 Video Lite through diffusers' Kandinsky5Transformer3DModel: what is special to it (the command line,
exact resume, pixel-space sampling: tests/families/test_conformance.py). Prompts are the pipeline's own encoding
(Qwen2.5-VL's states of each prompt's tokens, CLIP's pooled output); the loss is the pipeline's parametrisation through
diffusers' forward (channels last, the zero visual condition, the batch's prompts cut to the longest, the resolution's
RoPE scale); sampled clips equal Kandinsky5T2VPipeline's own bitwise (a tiny HunyuanVideo autoencoder); LoRA takes the
official LoRA config's Linears. diffusers has no converter of the official single files (they use its module names):
there is no official layout to check."""
import re

import numpy as np
import pytest
import torch

from opendit import config as cfglib

PROMPTS = ["the digit 7 moving left", "the digit 2 moving right"]  # as many tokens each: the pipeline pads none


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    from opendit.families.wrapped.tiny_text import write_text_encoder
    return write_text_encoder("kandinsky5-t2v-debug", tmp_path_factory.mktemp("text"), "moving_digits")


def save_tiny_hunyuan_vae(folder) -> str:
    """AutoencoderKLHunyuanVideo 8 wide, one layer a block: 8x down, 4x in time after the first frame, 4 channels."""
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(0)
    AutoencoderKLHunyuanVideo(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
                              latent_channels=4, mid_block_add_attention=False).save_pretrained(folder)
    return str(folder)


def _parts(text, vae):
    from opendit.families import get_family
    family = get_family("kandinsky5")
    cfg = family.resolve_config(cfglib.TrainConfig(model="kandinsky5-t2v-debug", dataset="moving_digits", num_frames=5,
                                                   image_size=32, vae=vae, text_encoder=text, batch_size=2,
                                                   num_workers=0, outputs="unused"))
    encoders = family.load_encoders(cfg, torch.device("cpu"), training=True)
    torch.manual_seed(0)
    return family, cfg, encoders, with_random_modulations(family.build_model(cfg, family.latent_shape(cfg, encoders)))


def with_random_modulations(model):
    """The model (eval mode) with random modulations: diffusers initialises them to zero, which gates every block
    off."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "modulation" in name:
                p.normal_(0, 0.1)
    return model.eval()


def test_prompts_and_loss_follow_the_pipeline_and_its_parametrisation(tmp_path, text):
    from diffusers import Kandinsky5T2VPipeline
    family, cfg, enc, model = _parts(text, save_tiny_hunyuan_vae(tmp_path / "vae"))
    captions = ["the digit 7 moving up and left", "the digit 2"]  # two lengths: padded, masked, cut
    cond = enc.encode(captions, "cpu")
    theirs, pooled, cu_seqlens = enc.text.pipeline.encode_prompt(captions, max_sequence_length=16, device="cpu",
                                                                 dtype=torch.float32)
    lengths = cu_seqlens.diff().tolist()
    assert cond["mask"].sum(1).tolist() == lengths and lengths[0] != lengths[1]
    for e, m, t, n in zip(cond["embeds"], cond["mask"], theirs, lengths):
        torch.testing.assert_close(e[m], t[:n], rtol=0, atol=0)
        assert not e[~m].any()
    torch.testing.assert_close(cond["pooled"], pooled, rtol=0, atol=0)

    objective = family.objective(cfg, enc)
    clips = torch.rand(2, 3, 5, 32, 32) * 2 - 1
    x, cond = objective.prepare((clips, captions), torch.device("cpu"), train=False)
    assert x.shape == (2, 4, 2, 4, 4)  # 4 channels; 5 frames -> 2, 32 px -> 4 (the 8x, 4x autoencoder)
    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=noise)
    # by hand: channels last with a zero conditioning latent and mask, the longest prompt's tokens, time 1000 t,
    # RoPE positions of the 1x2x2 patches and the pipeline's scale at 32 px
    tt = t[:, None, None, None, None]
    x_t = ((1 - tt) * x + tt * noise).permute(0, 2, 3, 4, 1)
    hidden = torch.cat([x_t, torch.zeros_like(x_t), torch.zeros(*x_t.shape[:-1], 1)], dim=-1)
    n = max(lengths)
    pred = model(hidden_states=hidden, encoder_hidden_states=cond["embeds"][:, :n], pooled_projections=cond["pooled"],
                 timestep=1000 * t, visual_rope_pos=[torch.arange(2), torch.arange(2), torch.arange(2)],
                 text_rope_pos=torch.arange(n), scale_factor=Kandinsky5T2VPipeline._get_scale_factor(None, 32, 32),
                 return_dict=False)  # the tensor itself (diffusers' class returns no tuple)
    target = (noise - x).permute(0, 2, 3, 4, 1)
    torch.testing.assert_close(losses, ((pred - target) ** 2).mean((1, 2, 3, 4)), rtol=1e-6, atol=1e-7)


def test_samples_equal_the_pipelines_own_clips(tmp_path, text):
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5T2VPipeline

    from opendit.families import LoadedModel
    from opendit.families.wrapped.kandinsky5 import SCHEDULER
    from opendit.seeding import sampling_generator
    family, cfg, enc, model = _parts(text, save_tiny_hunyuan_vae(tmp_path / "vae"))
    loaded = LoadedModel(family, model, enc, cfg, (4, 2, 4, 4), "random")
    sample_cfg = cfglib.SampleConfig(prompts=PROMPTS, cfg_scale=3.0, num_sampling_steps=3, seed=5)
    ours = family.sample_batch(loaded, family.make_sampler(sample_cfg, cfg), range(2, 5), sample_cfg.prompts,
                               sample_cfg, torch.device("cpu"))
    pipe = Kandinsky5T2VPipeline(model, enc.vae, enc.text.model, enc.text.tokenizer, enc.text.pipeline.text_encoder_2,
                                 enc.text.pipeline.tokenizer_2, FlowMatchEulerDiscreteScheduler(**SCHEDULER))
    noise = torch.randn(3, 4, 2, 4, 4, generator=sampling_generator(5, 2)).permute(0, 2, 3, 4, 1)
    latents = torch.cat([noise, torch.zeros_like(noise), torch.zeros(*noise.shape[:-1], 1)], dim=-1)
    theirs = pipe(prompt=[*PROMPTS, PROMPTS[0]], negative_prompt=[""] * 3, latents=latents, height=32, width=32,
                  num_frames=5, num_inference_steps=3, guidance_scale=3.0, max_sequence_length=16,
                  output_type="np").frames
    assert ours.shape == (3, 5, 32, 32, 3)
    np.testing.assert_array_equal(ours, (theirs * 255).round().astype(np.uint8))


def test_lora_takes_the_official_lora_configs_linears():
    from opendit.families import get_family
    family = get_family("kandinsky5")
    model = family.models["kandinsky5-t2v-debug"].build(in_channels=4)
    found = [n for n, _ in model.named_modules() if re.fullmatch(family.lora_targets, n)]
    official = ("self_attention.to_query", "self_attention.to_key", "self_attention.to_value",
                "self_attention.out_layer", "cross_attention.to_query", "cross_attention.to_key",
                "cross_attention.to_value", "cross_attention.out_layer", "feed_forward.in_layer",
                "feed_forward.out_layer")
    wanted = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(official)]
    assert found == wanted and len(found) == 2 * 6 + 2 * 10  # the text blocks have no cross-attention
