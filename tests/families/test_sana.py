"""Sana through diffusers' SanaTransformer2DModel: what is special to it (the command line, resume, folders and FLOPs:
test_conformance.py). Its prompts are SanaPipeline's own Gemma-2 encoding without the complex human instruction (as
diffusers' training example); the loss is that example's (DC-AE latents times their scale, timesteps 1000 t, target
noise - x) through diffusers' forward; sampled images equal SanaPipeline's own, called with prompt strings, through a
tiny AutoencoderDC; the official single-file layout converts onto the registered models."""
import numpy as np
import pytest
import torch

from opendit import config as cfglib
from tests.families.parts import assert_official_file_loads, debug_parts, release_converted

CAPTIONS = ["a handwritten one", "the digit twenty two"]


def save_tiny_dc_ae(folder) -> str:
    """A tiny random AutoencoderDC (2x downsampling, 4 latent channels, DC-AE f32c32's scaling factor)."""
    from diffusers import AutoencoderDC
    torch.manual_seed(0)
    AutoencoderDC(latent_channels=4, encoder_block_types="ResBlock", decoder_block_types="ResBlock",
                  encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8), encoder_layers_per_block=(1, 1),
                  decoder_layers_per_block=(1, 1), encoder_qkv_multiscales=((), ()), decoder_qkv_multiscales=((), ()),
                  upsample_block_type="interpolate", downsample_block_type="Conv",
                  scaling_factor=0.41407).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("sana")
    return debug_parts("sana-debug", root, save_tiny_dc_ae(root / "vae"), image_size=32)


def _pipeline(enc, model, scheduler=None):
    from diffusers import SanaPipeline
    return SanaPipeline(enc.text.tokenizer, enc.text.model, enc.vae, model, scheduler)


def test_prompts_are_the_pipelines_without_the_complex_human_instruction(parts):
    family, cfg, enc, model = parts
    cond = enc.encode(CAPTIONS, "cpu")
    pipe = _pipeline(enc, model)
    embeds, mask, _, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False, device="cpu",
                                            max_sequence_length=16, complex_human_instruction=None)
    assert torch.equal(cond["embeds"], embeds) and torch.equal(cond["mask"], mask.bool())
    assert cond["mask"].sum(1).tolist() == [1 + len(c.split()) for c in CAPTIONS]  # <bos> and the words
    instructed, _, _, _ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False, device="cpu",
                                             max_sequence_length=16, complex_human_instruction=["describe:"])
    assert not torch.equal(instructed, embeds)  # the instruction would change what the model is given


def test_the_loss_is_the_training_examples(parts):
    family, cfg, enc, model = parts
    objective = family.objective(cfg, enc)
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    x, cond = objective.prepare((images, CAPTIONS), torch.device("cpu"), train=False)
    latents = enc.vae.encode(images).latent * enc.vae.config.scaling_factor  # the DC-AE's, scaled
    assert x.shape == (2, 4, 16, 16) and torch.equal(x, latents)
    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=noise)
    x_t = (1 - t[:, None, None, None]) * x + t[:, None, None, None] * noise
    embeds, mask, _, _ = _pipeline(enc, model).encode_prompt(CAPTIONS, do_classifier_free_guidance=False,
                                                             device="cpu", max_sequence_length=16)
    out = model(hidden_states=x_t, encoder_hidden_states=embeds, encoder_attention_mask=mask, timestep=t * 1000,
                return_dict=False)[0]
    by_hand = ((out - (noise - x)) ** 2).mean((1, 2, 3))
    torch.testing.assert_close(losses, by_hand, rtol=1e-6, atol=1e-7)


def test_samples_equal_the_pipelines_own_images(parts):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from opendit.families import LoadedModel
    from opendit.families.wrapped.sana import SCHEDULER
    from opendit.seeding import sampling_generator
    family, cfg, enc, model = parts
    loaded = LoadedModel(family, model, enc, cfg, (4, 16, 16), "random")
    sample_cfg = cfglib.SampleConfig(prompts=CAPTIONS, cfg_scale=3.0, num_sampling_steps=3, seed=5)
    ours = family.sample_batch(loaded, family.make_sampler(sample_cfg, cfg), range(2, 5), CAPTIONS, sample_cfg,
                               torch.device("cpu"))
    pipe = _pipeline(enc, model, FlowMatchEulerDiscreteScheduler(**SCHEDULER))
    noise = torch.randn(3, 4, 16, 16, generator=sampling_generator(5, 2))
    theirs = pipe(prompt=[CAPTIONS[0], CAPTIONS[1], CAPTIONS[0]], negative_prompt="", latents=noise, height=32,
                  width=32, num_inference_steps=3, guidance_scale=3.0, max_sequence_length=16,
                  complex_human_instruction=None, use_resolution_binning=False, output_type="pil").images
    assert ours.shape == (3, 32, 32, 3)
    np.testing.assert_array_equal(ours, np.stack([np.asarray(im) for im in theirs]))


# Sana's official names, read off diffusers' converter (convert_sana_transformer_to_diffusers) in reverse: {diffusers
# prefix: official} outside the blocks, within a block, and the projections the release fuses
OFFICIAL_TOP = {"patch_embed.proj.": "x_embedder.proj.", "time_embed.linear.": "t_block.1.",
                "time_embed.emb.timestep_embedder.linear_1.": "t_embedder.mlp.0.",
                "time_embed.emb.timestep_embedder.linear_2.": "t_embedder.mlp.2.",
                "caption_projection.linear_1.": "y_embedder.y_proj.fc1.",
                "caption_projection.linear_2.": "y_embedder.y_proj.fc2.", "caption_norm.": "attention_y_norm.",
                "proj_out.": "final_layer.linear.", "scale_shift_table": "final_layer.scale_shift_table"}
OFFICIAL_BLOCK = {"scale_shift_table": "scale_shift_table", "attn1.to_out.0.": "attn.proj.",
                  "attn2.to_q.": "cross_attn.q_linear.", "attn2.to_out.0.": "cross_attn.proj.",
                  "ff.conv_inverted.": "mlp.inverted_conv.conv.", "ff.conv_depth.": "mlp.depth_conv.conv.",
                  "ff.conv_point.": "mlp.point_conv.conv."}
OFFICIAL_FUSED = {"attn.qkv.weight": ("attn1", "qkv", "weight"),
                  "cross_attn.kv_linear.weight": ("attn2", "kv", "weight"),
                  "cross_attn.kv_linear.bias": ("attn2", "kv", "bias")}


def official_layout(state: dict, sample_size: int, max_sequence_length: int = 300) -> dict:
    """A diffusers state dict in Sana's official layout; the two tensors the converter drops (the positional table,
    the learned empty caption) are zeros of the release code's shapes."""
    out = {}
    for key, value in state.items():
        if not key.startswith("transformer_blocks."):
            out[next(new + key[len(old):] for old, new in OFFICIAL_TOP.items() if key.startswith(old))] = value
            continue
        _, i, rest = key.split(".", 2)
        old = next((old for old in OFFICIAL_BLOCK if rest.startswith(old)), None)
        if old is not None:  # else a projection fused below
            out[f"blocks.{i}.{OFFICIAL_BLOCK[old]}{rest[len(old):]}"] = value
    for i in range(len({k.split(".")[1] for k in state if k.startswith("transformer_blocks.")})):
        for name, (attn, projections, kind) in OFFICIAL_FUSED.items():
            out[f"blocks.{i}.{name}"] = torch.cat([state[f"transformer_blocks.{i}.{attn}.to_{p}.{kind}"]
                                                  for p in projections])
    width, caption = state["scale_shift_table"].shape[1], state["caption_projection.linear_1.weight"].shape[1]
    device = state["scale_shift_table"].device
    out["pos_embed"] = torch.zeros(1, sample_size ** 2, width, device=device)
    out["y_embedder.y_embedding"] = torch.zeros(max_sequence_length, caption, device=device)
    return out


def test_the_official_single_file_converts_onto_the_registered_models(tmp_path, parts):
    family, cfg, _, model = parts
    assert_official_file_loads(family, model, lambda state: official_layout(state, model.config.sample_size),
                               tmp_path / "sana.safetensors")
    release_size = family.models["sana-1.6b-1024"].arch["sample_size"]
    converted, shapes = release_converted(family, "sana-1.6b-1024", lambda state: official_layout(state, release_size),
                                          in_channels=32)
    assert converted == shapes
