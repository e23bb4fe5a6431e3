"""Qwen-Image 2.1 through diffusers' QwenImage21Transformer2DModel: what is special to it (the command line, resume,
folders and FLOPs: test_conformance.py). Its prompts are the pipeline's own encoding (the processor's system turn
dropped as the pipeline's hand-written template splits it); its RGBA latents are the pipeline's own of opaque images;
the loss is diffusers' Qwen-Image 2.1 training example's by hand (prompts cut to the batch's longest, `img_mask` over
[prompt, image slots], the prediction's image tail); sampled images equal QwenImage21Pipeline's own bitwise, called
with prompt strings (RGBA, a tiny VAE of the release's class); ComfyUI's single file converts onto the release
model."""
import numpy as np
import pytest
import torch

from opendit import config as cfglib
from tests.families.parts import debug_parts

CAPTIONS = ["a handwritten one", "the digit twenty two"]


def save_tiny_vae(folder) -> str:
    """A tiny random AutoencoderKLQwenImage21: RGBA in and out as the release's, 16x down (four downsamplings), 8
    latent channels with statistics of their own."""
    from diffusers import AutoencoderKLQwenImage21
    torch.manual_seed(0)
    AutoencoderKLQwenImage21(base_dim=4, decoder_base_dim=4, z_dim=8, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
                             temperal_downsample=[False, True, True, True],
                             latents_mean=[0.1 * i - 0.3 for i in range(8)],
                             latents_std=[0.5 + 0.25 * i for i in range(8)]).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwenimage21")
    return debug_parts("qwen-image-2.1-debug", root, save_tiny_vae(root / "vae"), image_size=64)


def their_pipeline(enc, model=None, scheduler=None):
    """diffusers' own QwenImage21Pipeline with the text encoder folder's processor."""
    from diffusers import QwenImage21Pipeline
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(enc.text.tokenizer.name_or_path)
    return QwenImage21Pipeline(scheduler, enc.vae, enc.text.model, processor, model)


def test_prompts_are_the_pipelines_own_encoding(parts):
    family, cfg, enc, model = parts
    pipe = their_pipeline(enc)
    system_turn = pipe.prompt_template_t2i.split("<|im_start|>user")[0]
    assert len(pipe.processor(text=[system_turn]).input_ids[0]) == pipe._drop_idx == 12
    theirs, their_mask, image_slots = pipe.encode_prompt(CAPTIONS, device="cpu")
    cond = enc.encode(CAPTIONS, "cpu")
    n = theirs.shape[1]
    assert torch.equal(cond["mask"][:, :n], their_mask.bool()) and not cond["mask"][:, n:].any()
    assert torch.equal(cond["embeds"][:, :n], theirs * their_mask[..., None]) and not cond["embeds"][:, n:].any()
    assert not image_slots.any()  # no condition image
    words = [len(enc.text.tokenizer(c).input_ids) for c in CAPTIONS]
    assert cond["mask"].sum(1).tolist() == [w + 8 for w in words]  # <|im_start|>user\n ... <|im_end|>\n + 3


def test_latents_and_loss_follow_the_pipeline_and_the_recipe(parts):
    from diffusers import QwenImage21Pipeline
    family, cfg, enc, model = parts
    images = torch.rand(2, 3, 64, 64) * 2 - 1
    mean, _ = family.glue.posterior(enc.vae, images)  # opaque RGBA, as the pipeline converts images
    rgba = torch.cat([images, torch.ones(2, 1, 64, 64)], dim=1)
    theirs = their_pipeline(enc)._encode_vae_image(rgba[:, :, None], None)[:, :, 0]
    assert torch.equal(family.glue.to_model_space(enc.vae, mean), theirs)
    objective = family.objective(cfg, enc)
    x, cond = objective.prepare((images, CAPTIONS), torch.device("cpu"), train=False)
    assert x.shape == (2, 8, 4, 4)  # 64 px / 16, unpatched
    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=noise)
    # by hand, as diffusers' training example: prompts padded to the batch's longest, image slots after them
    n = int(cond["mask"].sum(1).max())
    x_t = (1 - t[:, None, None, None]) * x + t[:, None, None, None] * noise
    image_slots = torch.cat([torch.zeros(2, n, dtype=torch.bool), torch.ones(2, 4, dtype=torch.bool)], dim=1)
    pred = model(hidden_states=QwenImage21Pipeline._pack_latents(x_t, 2, 8, 4, 4),
                 encoder_hidden_states=cond["embeds"][:, :n], encoder_hidden_states_mask=cond["mask"][:, :n],
                 timestep=t, img_shapes=[[(1, 4, 4)]] * 2, img_mask=image_slots, return_dict=False)[0][:, -16:]
    pred = QwenImage21Pipeline._unpack_latents(pred, 64, 64, 16)[:, :, 0]
    torch.testing.assert_close(losses, ((pred - (noise - x)) ** 2).mean((1, 2, 3)), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"even number of rows and columns \(given 3x4\).*multiple of"):
        objective.losses(model, x[:, :, :3], cond, t_frac=t)


def test_samples_equal_the_pipelines_own_images(parts):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from opendit.families import LoadedModel
    from opendit.families.wrapped.glue import pack
    from opendit.families.wrapped.qwenimage21 import SCHEDULER
    from opendit.seeding import sampling_generator
    family, cfg, enc, model = parts
    loaded = LoadedModel(family, model, enc, cfg, (8, 4, 4), "random")
    sample_cfg = cfglib.SampleConfig(prompts=CAPTIONS, cfg_scale=3.0, num_sampling_steps=3, seed=5)
    ours = family.sample_batch(loaded, family.make_sampler(sample_cfg, cfg), range(2, 5), CAPTIONS, sample_cfg,
                               torch.device("cpu"))
    pipe = their_pipeline(enc, model, FlowMatchEulerDiscreteScheduler(**SCHEDULER))
    noise = torch.randn(3, 8, 4, 4, generator=sampling_generator(5, 2))
    theirs = pipe(prompt=[CAPTIONS[i % 2] for i in range(2, 5)], negative_prompt=[""] * 3, latents=pack(noise),
                  height=64, width=64, num_inference_steps=3, true_cfg_scale=3.0, output_type="pil").images
    assert ours.shape == (3, 64, 64, 4)  # RGBA, as its VAE decodes
    np.testing.assert_array_equal(ours, np.stack([np.asarray(im) for im in theirs]))


def official_layout(state: dict) -> dict:
    """ComfyUI's single file of a diffusers state dict, as diffusers' converter reads it: the model.diffusion_model.
    prefix, each SwiGLU's gate and up projections fused (gate rows first)."""
    out = {}
    for key, value in state.items():
        if key.endswith("img_mlp.gate_layer.weight"):
            up = state[key.replace("gate_layer", "proj")]
            out["model.diffusion_model." + key.replace("gate_layer", "gate_up")] = torch.cat([value, up])
        elif not key.endswith("img_mlp.proj.weight"):
            out["model.diffusion_model." + key] = value
    return out


def test_the_official_single_file_converts_onto_the_release_model(parts, tmp_path):
    from safetensors.torch import save_file
    family, cfg, enc, model = parts
    with torch.device("meta"):
        release = family.models["qwen-image-2.1"].build(in_channels=64).state_dict()
    converted = family.glue.convert_official(official_layout(release))
    assert {k: v.shape for k, v in converted.items()} == {k: v.shape for k, v in release.items()}
    save_file(official_layout(model.state_dict()), tmp_path / "qwen_image_2.1.safetensors")
    path = str(tmp_path / "qwen_image_2.1.safetensors")
    assert family.recognize_checkpoint(path) is not None
    loaded = family.load_weights(path)
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
