"""Kandinsky 5.0 Image Lite through diffusers' Kandinsky5Transformer3DModel: what is special to it (the command line,
exact resume, pixel-space sampling at a size the pipeline would replace, a latent cache:
tests/families/test_conformance.py; the feed it shares with the video model: test_kandinsky5.py). Prompts are the
image pipeline's own encoding (its template's 40 tokens dropped); the loss is the pipeline's parametrisation through
diffusers' forward (one frame, FLUX.1's latents scaled and not shifted, RoPE unscaled); sampled images equal
Kandinsky5T2IPipeline's own bitwise at one of its listed sizes (a tiny 8x AutoencoderKL)."""
import numpy as np
import pytest
import torch

from opendit import config as cfglib
from tests.families.test_kandinsky5 import with_random_modulations
from tests.test_zimage_family import save_tiny_flux_vae


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    from opendit.families.wrapped.tiny_text import write_text_encoder
    return write_text_encoder("kandinsky5-t2i-debug", tmp_path_factory.mktemp("text"), "digits")


def save_tiny_8x_vae(folder) -> str:
    """AutoencoderKL 4 wide, 4 levels (8x down, as the pipeline assumes), one resnet a level, 4 channels."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                  block_out_channels=(4,) * 4, layers_per_block=0, latent_channels=4, norm_num_groups=4,
                  mid_block_add_attention=False, scaling_factor=0.3611, shift_factor=0.1159).save_pretrained(folder)
    return str(folder)


def _parts(text, vae, image_size):
    from opendit.families import get_family
    family = get_family("kandinsky5image")
    cfg = family.resolve_config(cfglib.TrainConfig(model="kandinsky5-t2i-debug", dataset="captioned_digits",
                                                   image_size=image_size, vae=vae, text_encoder=text, batch_size=2,
                                                   num_workers=0, outputs="unused"))
    encoders = family.load_encoders(cfg, torch.device("cpu"), training=True)
    torch.manual_seed(0)
    return family, cfg, encoders, with_random_modulations(family.build_model(cfg, family.latent_shape(cfg, encoders)))


def test_prompts_and_loss_follow_the_pipeline_and_its_parametrisation(tmp_path, text):
    family, cfg, enc, model = _parts(text, save_tiny_flux_vae(tmp_path / "vae"), 16)
    pipe = enc.text.pipeline
    template = pipe.prompt_template.split("{}")[0]
    assert len(enc.text.tokenizer(template).input_ids) == pipe.prompt_template_encode_start_idx == 40
    captions = ["a handwritten seven", "the digit twenty two"]  # two lengths: padded, masked, cut
    cond = enc.encode(captions, "cpu")
    theirs, pooled, cu_seqlens = pipe.encode_prompt(captions, max_sequence_length=16, device="cpu",
                                                    dtype=torch.float32)
    lengths = cu_seqlens.diff().tolist()
    assert cond["mask"].sum(1).tolist() == lengths and lengths[0] != lengths[1]
    for e, m, t, n in zip(cond["embeds"], cond["mask"], theirs, lengths):
        torch.testing.assert_close(e[m], t[:n], rtol=0, atol=0)
    torch.testing.assert_close(cond["pooled"], pooled, rtol=0, atol=0)

    objective = family.objective(cfg, enc)
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    torch.manual_seed(1)
    x, cond = objective.prepare((images, captions), torch.device("cpu"), train=False)
    torch.manual_seed(1)
    posterior = enc.vae.encode(images).latent_dist
    torch.testing.assert_close(x, posterior.sample() * 0.3611)  # scaled, not shifted: the pipeline's decoding
    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=noise)
    # by hand: one frame channels last, the longest prompt's tokens, time 1000 t, RoPE of the 2x2 patches unscaled
    tt = t[:, None, None, None]
    x_t = ((1 - tt) * x + tt * noise).permute(0, 2, 3, 1)[:, None]
    n = max(lengths)
    pred = model(hidden_states=x_t, encoder_hidden_states=cond["embeds"][:, :n], pooled_projections=cond["pooled"],
                 timestep=1000 * t, visual_rope_pos=[torch.arange(1), torch.arange(4), torch.arange(4)],
                 text_rope_pos=torch.arange(n), scale_factor=[1.0, 1.0, 1.0], return_dict=False)
    target = (noise - x).permute(0, 2, 3, 1)[:, None]
    torch.testing.assert_close(losses, ((pred - target) ** 2).mean((1, 2, 3, 4)), rtol=1e-6, atol=1e-7)


def test_samples_equal_the_pipelines_own_images_at_a_listed_size(tmp_path, text):
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5T2IPipeline

    from opendit.families import LoadedModel
    from opendit.families.wrapped.kandinsky5_image import SCHEDULER
    from opendit.seeding import sampling_generator
    family, cfg, enc, model = _parts(text, save_tiny_8x_vae(tmp_path / "vae"), 1024)
    loaded = LoadedModel(family, model, enc, cfg, (4, 128, 128), "random")
    sample_cfg = cfglib.SampleConfig(prompts=["a handwritten seven"], cfg_scale=3.0, num_sampling_steps=1, seed=5)
    ours = family.sample_batch(loaded, family.make_sampler(sample_cfg, cfg), range(3, 4), sample_cfg.prompts,
                               sample_cfg, torch.device("cpu"))
    pipe = Kandinsky5T2IPipeline(model, enc.vae, enc.text.model, enc.text.tokenizer, enc.text.pipeline.text_encoder_2,
                                 enc.text.pipeline.tokenizer_2, FlowMatchEulerDiscreteScheduler(**SCHEDULER))
    noise = torch.randn(1, 4, 128, 128, generator=sampling_generator(5, 3))
    theirs = pipe(prompt=["a handwritten seven"], negative_prompt=[""], latents=noise.permute(0, 2, 3, 1)[:, None],
                  height=1024, width=1024, num_inference_steps=1, guidance_scale=3.0, max_sequence_length=16,
                  output_type="np").image
    assert ours.shape == (1, 1024, 1024, 3)
    np.testing.assert_array_equal(ours, (theirs * 255).round().astype(np.uint8))
