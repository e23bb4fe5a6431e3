"""Krea 2 through diffusers' own Krea2Transformer2DModel: what is special to it (the command line, exact resume, the
FLOP count: test_conformance.py). Prompts are the pipeline's own encoding (Qwen-Image's template padded in the
middle, 12 tapped Qwen3-VL layers); the loss is diffusers' Krea 2 DreamBooth example's through diffusers' forward;
sampled images equal Krea2Pipeline's own bitwise (a tiny Qwen-Image VAE); Krea's single-file layout converts onto
the registered models."""
import numpy as np
import pytest
import torch

from opendit import config as cfglib
from tests.families.parts import assert_official_file_loads, release_converted
from tests.test_qwenimage_family import save_tiny_qwen_vae

CAPTIONS = ["a handwritten one", "the digit seven seven seven"]  # 3 and 5 words: padded apart


@pytest.fixture(scope="module")
def qwen3vl(tmp_path_factory):
    from opendit.families.wrapped.tiny_text import write_text_encoder
    return write_text_encoder("krea2-debug", tmp_path_factory.mktemp("qwen3vl"))


def _parts(encoder, vae):
    from opendit.families import get_family
    family = get_family("krea2")
    cfg = family.resolve_config(cfglib.TrainConfig(model="krea2-debug", dataset="captioned_digits", image_size=16,
                                                   vae=vae, text_encoder=encoder, batch_size=2, outputs="unused"))
    encoders = family.load_encoders(cfg, torch.device("cpu"), training=True)
    torch.manual_seed(0)
    return family, cfg, encoders, family.build_model(cfg, family.latent_shape(cfg, encoders)).eval()


def test_prompts_and_loss_follow_the_pipeline_and_the_recipe(tmp_path, qwen3vl, one_thread):
    from diffusers import Krea2Pipeline
    family, cfg, enc, model = _parts(qwen3vl, save_tiny_qwen_vae(tmp_path / "vae"))
    pipe = Krea2Pipeline(None, enc.vae, enc.text.model, enc.text.tokenizer, model)
    tokens = enc.text.tokenizer
    assert len(tokens(pipe.prompt_template_encode_prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    assert len(tokens(pipe.prompt_template_encode_suffix).input_ids) == 5
    cond = enc.encode(CAPTIONS, "cpu")
    theirs, their_mask = pipe.encode_prompt(list(CAPTIONS), device="cpu", max_sequence_length=16)
    assert cond["embeds"].shape == (2, 16, 12, 16) and torch.equal(cond["embeds"], theirs)
    assert torch.equal(cond["mask"], their_mask) and cond["mask"].sum(1).tolist() == [3 + 5, 5 + 5]

    objective = family.objective(cfg, enc)
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    x, cond = objective.prepare((images, CAPTIONS), torch.device("cpu"), train=False)
    assert x.shape == (2, 16, 4, 4)  # 4 latent channels in 2x2 patches; 16 px / the 2x VAE / 2
    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=noise)

    # by hand, as the example: latents packed by the pipeline's rule, timestep sigma, target noise - x
    def unpatched(z):  # [B, 4C, h, w] with channels (c, dy, dx) -> [B, C, 2h, 2w]
        return z.view(2, 4, 2, 2, 4, 4).permute(0, 1, 4, 2, 5, 3).reshape(2, 4, 8, 8)
    x0, eps = unpatched(x), unpatched(noise)
    x_t = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * eps
    pred = model(hidden_states=pipe._pack_latents(x_t, 2, 4, 8, 8), encoder_hidden_states=cond["embeds"],
                 timestep=t, position_ids=Krea2Pipeline.prepare_position_ids(16, 4, 4, "cpu"),
                 encoder_attention_mask=cond["mask"], return_dict=False)[0]
    target = pipe._pack_latents(eps - x0, 2, 4, 8, 8)
    torch.testing.assert_close(losses, ((pred - target) ** 2).mean((1, 2)), rtol=1e-6, atol=1e-7)


def test_samples_equal_the_pipelines_own_images(tmp_path, qwen3vl, one_thread):
    from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline

    from opendit.families import LoadedModel
    from opendit.families.wrapped.glue import pack
    from opendit.families.wrapped.krea2 import SCHEDULER
    from opendit.seeding import sampling_generator
    family, cfg, enc, model = _parts(qwen3vl, save_tiny_qwen_vae(tmp_path / "vae"))
    loaded = LoadedModel(family, model, enc, cfg, (16, 4, 4), "random")
    sample_cfg = cfglib.SampleConfig(prompts=["a handwritten one", "the digit seven"], cfg_scale=3.0,
                                     num_sampling_steps=3, seed=5)
    ours = family.sample_batch(loaded, family.make_sampler(sample_cfg, cfg), range(2, 5), sample_cfg.prompts,
                               sample_cfg, torch.device("cpu"))
    pipe = Krea2Pipeline(FlowMatchEulerDiscreteScheduler(**SCHEDULER), enc.vae, enc.text.model, enc.text.tokenizer,
                         model)
    noise = torch.randn(3, 16, 4, 4, generator=sampling_generator(5, 2))
    theirs = pipe(prompt=["a handwritten one", "the digit seven", "a handwritten one"], negative_prompt=[""] * 3,
                  latents=pack(noise), height=16, width=16, num_inference_steps=3, guidance_scale=2.0,
                  max_sequence_length=16, output_type="pil").images
    assert ours.shape == (3, 16, 16, 3)
    np.testing.assert_array_equal(ours, np.stack([np.asarray(im) for im in theirs]))
    with pytest.raises(ValueError, match="--cfg_scale 0.5: Krea 2's pipeline guides only above 1"):
        family.glue.pipeline_call(loaded, cfglib.SampleConfig(cfg_scale=0.5), {}, {})


# Krea's single-file names, read off diffusers' converter (convert_krea2_transformer_checkpoint_to_diffusers) in
# reverse: {diffusers prefix: official}, then {diffusers part: official} anywhere in a key (the text fusion's blocks
# are named as the main blocks are; the converter renames both alike)
OFFICIAL_PREFIXES = {"img_in.": "first.", "time_embed.linear_1.": "tmlp.0.", "time_embed.linear_2.": "tmlp.2.",
                     "time_mod_proj.": "tproj.1.", "txt_in.norm.weight": "txtmlp.0.scale",
                     "txt_in.linear_1.": "txtmlp.1.", "txt_in.linear_2.": "txtmlp.3.", "text_fusion.": "txtfusion.",
                     "transformer_blocks.": "blocks.", "final_layer.linear.": "last.linear.",
                     "final_layer.norm.weight": "last.norm.scale",
                     "final_layer.scale_shift_table": "last.modulation.lin"}
OFFICIAL_PARTS = {".attn.to_q.": ".attn.wq.", ".attn.to_k.": ".attn.wk.", ".attn.to_v.": ".attn.wv.",
                  ".attn.to_out.0.": ".attn.wo.", ".attn.to_gate.": ".attn.gate.",
                  ".attn.norm_q.weight": ".attn.qknorm.qnorm.scale", ".attn.norm_k.weight": ".attn.qknorm.knorm.scale",
                  ".ff.": ".mlp.", ".norm1.weight": ".prenorm.scale", ".norm2.weight": ".postnorm.scale",
                  ".scale_shift_table": ".mod.lin"}


def official_layout(state: dict) -> dict:
    """A diffusers state dict in Krea's single-file layout (ComfyUI's model.diffusion_model. prefix), each block's
    six modulation vectors flattened into one as the release stores them."""
    out = {}
    for key, value in state.items():
        name = next((new + key[len(old):] for old, new in OFFICIAL_PREFIXES.items() if key.startswith(old)), key)
        for old, new in OFFICIAL_PARTS.items():
            name = name.replace(old, new)
        flat = key.startswith("transformer_blocks.") and key.endswith(".scale_shift_table")
        out["model.diffusion_model." + name] = value.flatten() if flat else value
    return out


def test_the_official_single_file_converts_onto_the_registered_models(tmp_path, qwen3vl, one_thread):
    family, _, _, model = _parts(qwen3vl, "none")
    assert_official_file_loads(family, model, official_layout, tmp_path / "krea2.safetensors")
    converted, shapes = release_converted(family, "krea2", official_layout, in_channels=64)
    assert converted == shapes
