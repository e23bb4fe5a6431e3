"""FLUX.2 [dev] through diffusers' Flux2Transformer2DModel and Flux2Pipeline: flux2-dev-debug conditioned by a tiny
local Mistral3 (the release's text encoder class). Prompts are the pipeline's own encode_prompt (its system message,
three hidden layers stacked) bitwise; the training loss is the recipe's with the guidance embedding given
TRAIN_GUIDANCE; sampled images equal Flux2Pipeline's own (prompts as text, embedded guidance = --cfg_scale); it
trains and samples from the command line; a Qwen3 folder given to [dev] is named in the error."""
import numpy as np
import pytest
import torch

from opendit import config as cfglib
from tests.run_each import run_here
from tests.test_flux2_family import save_tiny_flux2_vae


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    from opendit.families.wrapped.flux2 import save_tiny_mistral3
    return save_tiny_mistral3(tmp_path_factory.mktemp("mistral3"))


def dev_cfg(outputs, mistral, **kw):
    base = dict(model="flux2-dev-debug", dataset="captioned_digits", image_size=16, vae="none", text_encoder=mistral,
                batch_size=2, max_steps=2, num_workers=0, outputs=str(outputs))
    return cfglib.TrainConfig(**{**base, **kw})


def _family_parts(mistral, vae_folder):
    from opendit.families import get_family
    family = get_family("flux2")
    cfg = family.resolve_config(dev_cfg("unused", mistral, vae=vae_folder))
    encoders = family.load_encoders(cfg, torch.device("cpu"), training=True)
    torch.manual_seed(0)
    model = family.build_model(cfg, family.latent_shape(cfg, encoders)).eval()
    return family, cfg, encoders, model


def test_prompts_are_the_pipelines_and_the_loss_gives_the_guidance_embedding(tmp_path, mistral):
    from diffusers import Flux2Pipeline

    from opendit.families.wrapped.flux2 import TRAIN_GUIDANCE
    family, cfg, enc, model = _family_parts(mistral, save_tiny_flux2_vae(tmp_path / "vae"))
    assert model.config.guidance_embeds
    prompts = ["a handwritten one", "the digit two"]
    pipe = Flux2Pipeline(None, enc.vae, enc.text.model, enc.text.tokenizer, model)
    theirs, _ = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=48, text_encoder_out_layers=(1, 2, 3))
    ours = enc.encode(prompts, "cpu")["embeds"]
    assert ours.shape == (2, 48, 48)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert not torch.equal(ours[0], ours[1])  # the prompts reach the embedding past the system message

    x, cond = family.objective(cfg, enc).prepare((torch.rand(2, 3, 16, 16) * 2 - 1, prompts), torch.device("cpu"),
                                                 train=False)
    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    losses, _ = family.objective(cfg, enc).losses(model, x, cond, t_frac=t, noise=noise)
    x_t = (1 - t[:, None, None, None]) * x + t[:, None, None, None] * noise

    def by_hand(guidance):
        pred = model(hidden_states=Flux2Pipeline._pack_latents(x_t), encoder_hidden_states=cond["embeds"], timestep=t,
                     guidance=torch.full((2,), guidance), img_ids=Flux2Pipeline._prepare_latent_ids(x_t),
                     txt_ids=Flux2Pipeline._prepare_text_ids(cond["embeds"]), return_dict=False)[0]
        return ((pred - Flux2Pipeline._pack_latents(noise - x)) ** 2).mean((1, 2))
    torch.testing.assert_close(losses, by_hand(TRAIN_GUIDANCE), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(losses, by_hand(TRAIN_GUIDANCE + 3))  # the guidance input matters


def test_samples_equal_the_pipelines_own_images(tmp_path, mistral):
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline

    from opendit.families import LoadedModel
    from opendit.families.wrapped.flux2 import SCHEDULER
    from opendit.seeding import sampling_generator
    family, cfg, enc, model = _family_parts(mistral, save_tiny_flux2_vae(tmp_path / "vae"))
    loaded = LoadedModel(family, model, enc, cfg, (16, 4, 4), "random")
    prompts = ["a handwritten one", "the digit seven"]
    sample_cfg = cfglib.SampleConfig(prompts=prompts, cfg_scale=2.5, num_sampling_steps=3, seed=5)
    ours = family.sample_batch(loaded, family.make_sampler(sample_cfg, cfg), range(2, 5), prompts, sample_cfg,
                               torch.device("cpu"))
    pipe = Flux2Pipeline(FlowMatchEulerDiscreteScheduler(**SCHEDULER), enc.vae, enc.text.model, enc.text.tokenizer,
                         model)
    noise = torch.randn(3, 16, 4, 4, generator=sampling_generator(5, 2))
    theirs = pipe(prompt=[*prompts, prompts[0]], latents=noise, height=16, width=16, num_inference_steps=3,
                  guidance_scale=2.5, max_sequence_length=48, text_encoder_out_layers=(1, 2, 3),
                  output_type="pil").images
    assert ours.shape == (3, 16, 16, 3)
    np.testing.assert_array_equal(ours, np.stack([np.asarray(im) for im in theirs]))


def test_trains_and_samples_from_the_command_line(tmp_path, mistral):
    run_here("train.py", "--model", "flux2-dev-debug", "--dataset", "captioned_digits", "--image_size", "8", "--vae",
        "none", "--text_encoder", mistral, "--batch_size", "2", "--max_steps", "2", "--num_workers", "0",
        "--outputs", tmp_path)
    out = tmp_path / "samples"
    run_here("sample.py", "--ckpt", "latest", "--outputs", tmp_path, "--prompts", "a handwritten one",
        "--num_sampling_steps", "2", "--cfg_scale", "3", "--npz", "--out", out)
    images = np.load(out / "samples.npz")["arr_0"]
    assert images.shape == (1, 8, 8, 3) and images.dtype == np.uint8


def test_a_qwen3_text_encoder_for_dev_is_named(tmp_path):
    from opendit.families import get_family
    from opendit.families.wrapped.flux2 import save_tiny_qwen3
    qwen = save_tiny_qwen3(tmp_path / "qwen3")
    with pytest.raises(ValueError, match="a Qwen3ForCausalLM, not the Mistral3 model flux2-dev-debug is conditioned "
                                         "by .*tiny_text flux2-dev-debug DIR"):
        get_family("flux2").glue.text_encoder(qwen, "cpu", torch.float32, "flux2-dev-debug")
