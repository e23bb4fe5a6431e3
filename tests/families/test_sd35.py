"""Stable Diffusion 3.5 through diffusers' own SD3Transformer2DModel, beyond the conformance table: prompts are
StableDiffusion3Pipeline's own encode_prompt (CLIP-L + CLIP-G zero-padded to T5's width, then T5's tokens); the loss
is the SD3 DreamBooth example's without preconditioning (model time 1000 t, target noise - x) through diffusers'
forward; sampled images equal the pipeline's own bitwise (prompt strings through its three encoders, a tiny SD3-style
VAE); the last block's text queries, frozen, would get only zero gradients; the official single-file layout of both
releases converts onto the registered models' keys and shapes."""
import re

import numpy as np
import pytest
import torch

from opendit import config as cfglib

CAPTIONS = ["a handwritten one", "the digit twenty two"]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    from opendit.families.wrapped.tiny_text import write_text_encoder
    return write_text_encoder("sd3.5-debug", tmp_path_factory.mktemp("sd35_text"))


@pytest.fixture(scope="module")
def vae(tmp_path_factory):
    """A tiny AutoencoderKL shaped like SD3's (16 latent channels, no quant convs, its shift and scale), 2x down."""
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("sd35_vae")
    AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                  block_out_channels=(8, 8), layers_per_block=1, latent_channels=16, norm_num_groups=8,
                  sample_size=16, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
                  use_post_quant_conv=False).save_pretrained(folder)
    return str(folder)


def _parts(text, vae):
    from opendit.families import get_family
    family = get_family("sd35")
    cfg = family.resolve_config(cfglib.TrainConfig(model="sd3.5-debug", dataset="captioned_digits", image_size=16,
                                                   vae=vae, text_encoder=text, batch_size=2, num_workers=0,
                                                   outputs="unused"))
    encoders = family.load_encoders(cfg, torch.device("cpu"), training=True)
    torch.manual_seed(0)
    return family, cfg, encoders, family.build_model(cfg, family.latent_shape(cfg, encoders)).eval()


def _pipeline(text, **components):
    """StableDiffusion3Pipeline holding the three text encoders and tokenizers of the folder `text`."""
    from diffusers import StableDiffusion3Pipeline
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel
    parts = {}
    for suffix, encoder_class in (("", CLIPTextModelWithProjection), ("_2", CLIPTextModelWithProjection),
                                  ("_3", T5EncoderModel)):
        parts[f"text_encoder{suffix}"] = encoder_class.from_pretrained(f"{text}/text_encoder{suffix}").eval()
        parts[f"tokenizer{suffix}"] = AutoTokenizer.from_pretrained(f"{text}/tokenizer{suffix}")
    return StableDiffusion3Pipeline(**{"transformer": None, "scheduler": None, "vae": None, **parts, **components})


def test_prompts_are_the_pipelines_own_and_the_loss_is_the_recipes(text, vae):
    family, cfg, enc, model = _parts(text, vae)
    cond = enc.encode(CAPTIONS, "cpu")
    with torch.no_grad():  # as the pipeline's __call__ runs it
        embeds, _, pooled, _ = _pipeline(text).encode_prompt(CAPTIONS, None, None, device="cpu",
                                                              do_classifier_free_guidance=False,
                                                              max_sequence_length=16)
    assert embeds.shape == (2, 77 + 16, 64) and pooled.shape == (2, 16 + 32)  # CLIP's 77 tokens, then T5's 16
    torch.testing.assert_close(cond["embeds"], embeds, rtol=0, atol=0)
    torch.testing.assert_close(cond["pooled"], pooled, rtol=0, atol=0)
    assert not embeds[:, :77, 48:].any() and embeds[:, 77:, 48:].any()  # CLIP-L + CLIP-G zero-padded to T5's width

    objective = family.objective(cfg, enc)
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    torch.manual_seed(1)
    x, cond = objective.prepare((images, CAPTIONS), torch.device("cpu"), train=False)
    torch.manual_seed(1)
    z = family.glue.encode_images(enc.vae, images)  # the same posterior sample
    torch.testing.assert_close(x, (z - 0.0609) * 1.5305, rtol=0, atol=0)
    assert x.shape == (2, 16, 8, 8)  # the model patches the latent grid itself
    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=noise)
    sigma = t[:, None, None, None]
    pred = model(hidden_states=(1 - sigma) * x + sigma * noise, timestep=1000 * t, encoder_hidden_states=embeds,
                 pooled_projections=pooled, return_dict=False)[0]
    torch.testing.assert_close(losses, ((pred - (noise - x)) ** 2).mean((1, 2, 3)), rtol=1e-6, atol=1e-7)


def test_samples_equal_the_pipelines_own_images(text, vae):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from opendit.families import LoadedModel
    from opendit.families.wrapped.sd35 import SCHEDULER
    from opendit.seeding import sampling_generator
    family, cfg, enc, model = _parts(text, vae)
    loaded = LoadedModel(family, model, enc, cfg, (16, 8, 8), "random")
    sample_cfg = cfglib.SampleConfig(prompts=["a handwritten one", "the digit seven"], cfg_scale=3.0,
                                     num_sampling_steps=3, seed=5)
    ours = family.sample_batch(loaded, family.make_sampler(sample_cfg, cfg), range(2, 5), sample_cfg.prompts,
                               sample_cfg, torch.device("cpu"))
    pipe = _pipeline(text, transformer=model, scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=enc.vae)
    noise = torch.randn(3, 16, 8, 8, generator=sampling_generator(5, 2))
    theirs = pipe(prompt=["a handwritten one", "the digit seven", "a handwritten one"], negative_prompt=[""] * 3,
                  latents=noise, height=16, width=16, num_inference_steps=3, guidance_scale=3.0,
                  max_sequence_length=16, output_type="pil").images
    assert ours.shape == (3, 16, 16, 3)
    np.testing.assert_array_equal(ours, np.stack([np.asarray(im) for im in theirs]))


def test_the_frozen_text_queries_of_the_last_block_would_get_only_zero_gradients():
    from diffusers import SD3Transformer2DModel

    from opendit.families.wrapped.sd35 import SD35_DEBUG
    torch.manual_seed(0)
    model = SD3Transformer2DModel(**{**SD35_DEBUG, "in_channels": 4, "out_channels": 4})
    out = model(hidden_states=torch.randn(2, 4, 8, 8), timestep=torch.tensor([300.0, 800.0]),
                encoder_hidden_states=torch.randn(2, 20, 64), pooled_projections=torch.randn(2, 48),
                return_dict=False)[0]
    out.square().mean().backward()
    zero = {n for n, p in model.named_parameters() if not p.grad.any()}
    assert zero == {"transformer_blocks.1.attn.add_q_proj.weight", "transformer_blocks.1.attn.add_q_proj.bias",
                    "transformer_blocks.1.attn.norm_added_q.weight"}


# the official name of each diffusers name, read off diffusers' converter (convert_sd3_transformer_checkpoint_to_
# diffusers) the other way round; q, k and v are one fused qkv there
OFFICIAL_NAMES = [
    (r"^pos_embed\.pos_embed$", "pos_embed"), (r"^pos_embed\.proj\.", "x_embedder.proj."),
    (r"^time_text_embed\.timestep_embedder\.linear_([12])\.", lambda m: f"t_embedder.mlp.{2 * int(m[1]) - 2}."),
    (r"^time_text_embed\.text_embedder\.linear_([12])\.", lambda m: f"y_embedder.mlp.{2 * int(m[1]) - 2}."),
    (r"^proj_out\.", "final_layer.linear."), (r"^norm_out\.linear\.", "final_layer.adaLN_modulation.1."),
    (r"^transformer_blocks\.(\d+)\.(attn2?)\.to_q\.", r"joint_blocks.\1.x_block.\2.qkv."),
    (r"^transformer_blocks\.(\d+)\.attn\.add_q_proj\.", r"joint_blocks.\1.context_block.attn.qkv."),
    (r"^transformer_blocks\.(\d+)\.(attn2?)\.norm_([qk])\.", r"joint_blocks.\1.x_block.\2.ln_\3."),
    (r"^transformer_blocks\.(\d+)\.attn\.norm_added_([qk])\.", r"joint_blocks.\1.context_block.attn.ln_\2."),
    (r"^transformer_blocks\.(\d+)\.(attn2?)\.to_out\.0\.", r"joint_blocks.\1.x_block.\2.proj."),
    (r"^transformer_blocks\.(\d+)\.attn\.to_add_out\.", r"joint_blocks.\1.context_block.attn.proj."),
    (r"^transformer_blocks\.(\d+)\.norm1\.linear\.", r"joint_blocks.\1.x_block.adaLN_modulation.1."),
    (r"^transformer_blocks\.(\d+)\.norm1_context\.linear\.", r"joint_blocks.\1.context_block.adaLN_modulation.1."),
    (r"^transformer_blocks\.(\d+)\.ff\.net\.0\.proj\.", r"joint_blocks.\1.x_block.mlp.fc1."),
    (r"^transformer_blocks\.(\d+)\.ff\.net\.2\.", r"joint_blocks.\1.x_block.mlp.fc2."),
    (r"^transformer_blocks\.(\d+)\.ff_context\.net\.0\.proj\.", r"joint_blocks.\1.context_block.mlp.fc1."),
    (r"^transformer_blocks\.(\d+)\.ff_context\.net\.2\.", r"joint_blocks.\1.context_block.mlp.fc2."),
    (r"^context_embedder\.", "context_embedder."),
]


def _official_layout(model) -> dict:
    """The release's single-file layout of `model` on the meta device (model.diffusion_model.* as Stability AI's
    files name it): every diffusers tensor under its official name, q/k/v fused (k and v go into q's qkv)."""
    layout = {}
    for name, tensor in model.state_dict().items():
        if re.search(r"\.(to_[kv]|add_[kv]_proj)\.", name):
            continue
        official = next(re.sub(pattern, new, name) for pattern, new in OFFICIAL_NAMES if re.search(pattern, name))
        fused = 3 if re.search(r"\.(to_q|add_q_proj)\.", name) else 1
        layout["model.diffusion_model." + official] = torch.empty(fused * tensor.shape[0], *tensor.shape[1:],
                                                                  device="meta")
    return layout


@pytest.mark.parametrize("name", ["sd3.5-large", "sd3.5-medium"])
def test_the_official_layout_converts_onto_the_registered_model(name):
    from diffusers.loaders import single_file_utils

    from opendit.families import get_family
    family = get_family("sd35")
    with torch.device("meta"):
        model = family.models[name].build(in_channels=16)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    official = _official_layout(model)
    assert all(any(k.endswith(key) for k in official) for key in family.glue.official_key)
    left = dict(official)  # the converter pops what it reads: it reads every official tensor
    converted = getattr(single_file_utils, family.glue.official_converter)(left)
    assert not left and {k: tuple(v.shape) for k, v in converted.items()} == expected
