"""ERNIE-Image through diffusers' ErnieImageTransformer2DModel: what is special to it (the command line, resume,
folders and FLOPs: test_conformance.py). Its prompts are the pipeline's own encode_prompt, padded with a mask whose
lengths reach the forward as text_lens; the loss is the pipeline's parametrisation (model time 1000 t, target
noise - x) through diffusers' forward fed as the pipeline feeds it; the latents are what the pipeline's decoding
inverts (2x2 patches, batch-norm statistics with eps 1e-5); sampled images equal ErnieImagePipeline's own, called
with prompt strings; single files under model.diffusion_model. convert onto the release's keys."""
import numpy as np
import pytest
import torch

from opendit import config as cfglib

CAPTIONS = ["a handwritten one", "the digit twenty two"]  # two lengths: padded and masked


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from opendit.families import get_family
    from opendit.families.wrapped.tiny_text import write_text_encoder
    from tests.test_flux2_family import save_tiny_flux2_vae
    root = tmp_path_factory.mktemp("ernieimage")
    family = get_family("ernieimage")
    cfg = family.resolve_config(cfglib.TrainConfig(
        model="ernie-image-debug", dataset="captioned_digits", image_size=16, vae=save_tiny_flux2_vae(root / "vae"),
        text_encoder=write_text_encoder("ernie-image-debug", root / "text"), outputs="unused"))
    encoders = family.load_encoders(cfg, torch.device("cpu"), training=True)
    return family, cfg, encoders


def _model(parts, random: bool = True):
    """The debug model; random: every weight drawn (diffusers zero-initialises the shared modulation and the final
    Linear, so a new model's output is zero)."""
    family, cfg, encoders = parts
    torch.manual_seed(0)
    model = family.build_model(cfg, family.latent_shape(cfg, encoders)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3) if random else p.zero_()
    return model


def _pipeline(encoders, model=None, scheduler=None):
    from diffusers import ErnieImagePipeline
    return ErnieImagePipeline(model, encoders.vae, encoders.text.model, encoders.text.tokenizer, scheduler)


def test_prompts_are_the_pipelines_own_encoding(parts):
    _, _, enc = parts
    long = " ".join(["one two three"] * 8)  # 24 words: the pipeline's tokenizer truncates at max_sequence_length
    captions = [*CAPTIONS, long, ""]
    cond = enc.encode(captions, "cpu")
    theirs = _pipeline(enc).encode_prompt(captions, "cpu")
    assert cond["mask"].sum(1).tolist() == [len(e) for e in theirs] == [4, 5, 16, 1]
    for e, m, t in zip(cond["embeds"], cond["mask"], theirs):
        assert torch.equal(e[m], t) and not e[~m].any()


def test_the_loss_is_the_pipelines_parametrisation_through_diffusers_forward(parts):
    family, cfg, enc = parts
    model = _model(parts)
    objective = family.objective(cfg, enc)
    x, cond = objective.prepare((torch.rand(2, 3, 16, 16) * 2 - 1, CAPTIONS), torch.device("cpu"), train=False)
    assert x.shape == (2, 16, 4, 4)  # the 2x VAE's 4 channels in 2x2 patches
    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=noise)
    x_t = (1 - t[:, None, None, None]) * x + t[:, None, None, None] * noise
    pipe = _pipeline(enc, model)
    text, lengths = pipe._pad_text(pipe.encode_prompt(CAPTIONS, "cpu"), "cpu", torch.float32, 16)  # as it samples
    out = model(x_t, 1000 * t, text, lengths, return_dict=False)[0]
    by_hand = ((out - (noise - x)) ** 2).mean((1, 2, 3))
    torch.testing.assert_close(losses, by_hand, rtol=1e-6, atol=1e-7)


def test_latents_are_what_the_pipelines_decoding_inverts(parts):
    """With a model whose output is zero, the pipeline's Euler steps keep the latents it is given: its image of
    to_model(z) is the VAE's decoding of z (the batch-norm statistics with eps 1e-5, as the pipeline decodes)."""
    family, _, enc = parts
    z = torch.randn(2, 4, 8, 8)
    x = family.glue.to_model_space(enc.vae, z)
    images = _pipeline(enc, _model(parts, random=False), _scheduler())(
        prompt=CAPTIONS, latents=x, height=16, width=16, num_inference_steps=2, guidance_scale=1.0,
        output_type="pt").images
    with torch.no_grad():
        decoded = (enc.vae.decode(z).sample / 2 + 0.5).clamp(0, 1)
    torch.testing.assert_close(images, decoded, rtol=0, atol=1e-6)


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    from opendit.families.wrapped.ernieimage import SCHEDULER
    return FlowMatchEulerDiscreteScheduler(**SCHEDULER)


def test_samples_equal_the_pipelines_own_images(parts):
    from opendit.families import LoadedModel
    from opendit.seeding import sampling_generator
    family, cfg, enc = parts
    model = _model(parts)
    loaded = LoadedModel(family, model, enc, cfg, (16, 4, 4), "random")
    sample_cfg = cfglib.SampleConfig(prompts=CAPTIONS, cfg_scale=3.0, num_sampling_steps=3, seed=5)
    ours = family.sample_batch(loaded, family.make_sampler(sample_cfg, cfg), range(1, 4), CAPTIONS, sample_cfg,
                               torch.device("cpu"))
    noise = torch.randn(3, 16, 4, 4, generator=sampling_generator(5, 1))
    theirs = _pipeline(enc, model, _scheduler())(
        prompt=[CAPTIONS[1], CAPTIONS[0], CAPTIONS[1]], negative_prompt="", latents=noise, height=16, width=16,
        num_inference_steps=3, guidance_scale=3.0, output_type="pil").images
    assert ours.shape == (3, 16, 16, 3)
    np.testing.assert_array_equal(ours, np.stack([np.asarray(im) for im in theirs]))


def test_an_official_single_file_converts_onto_the_release(parts, tmp_path):
    """The original layout (diffusers' names under model.diffusion_model.): the release's keys and shapes, on the
    meta device, through diffusers' converter; a file of the debug model in that layout is recognised and loads
    whole."""
    from diffusers import ErnieImageTransformer2DModel
    from safetensors.torch import save_file

    from opendit.families.wrapped.ernieimage import ERNIE_IMAGE
    family = parts[0]
    with torch.device("meta"):
        release = ErnieImageTransformer2DModel(**ERNIE_IMAGE).state_dict()
    converted = family.glue.convert_official({"model.diffusion_model." + k: v for k, v in release.items()})
    assert {k: v.shape for k, v in converted.items()} == {k: v.shape for k, v in release.items()}

    state = _model(parts).state_dict()
    path = tmp_path / "ernie-image.safetensors"
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in state.items()}, path)
    assert family.recognize_checkpoint(str(path)) is not None
    loaded = family.load_weights(str(path))
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())
