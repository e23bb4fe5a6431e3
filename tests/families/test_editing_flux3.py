"""FLUX.3 as an editing model: the references reach its reference-image branch (image_cond_hidden_states /
image_cond_ids) as the pipeline's own VAE-encoder and image-cond steps prepare them, that branch trains on editing pairs
and stays frozen and untouched in a text-to-image run; the command line trains on pairs, resumes exactly, and
sample.py --image gives Flux3ModularPipeline's own images with `image` (a tiny AutoencoderKLFlux2 throughout: FLUX.3's
latents are normalised by its batch-norm statistics)."""
import numpy as np
import pytest
import torch
from PIL import Image

from opendit import config as cfglib
from tests.families.test_editing import write_pairs
from tests.run_each import sample_here, trains_and_resumes_exactly
from tests.test_train import run_trainer

MODEL = "flux3-debug"


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from opendit.families.wrapped.tiny_text import write_text_encoder
    from tests.test_flux2_family import save_tiny_flux2_vae
    root = tmp_path_factory.mktemp("flux3_editing")
    return write_text_encoder(MODEL, root / "text", "edit_digits"), save_tiny_flux2_vae(root / "vae")


def options(parts, **more) -> dict:
    text, vae = parts
    return {**dict(model=MODEL, dataset="edit_digits", image_size=16, vae=vae, text_encoder=text, batch_size=4,
                   num_workers=0, log_every=1, lr=1e-3), **more}


def _image_cond(trainer) -> tuple[dict, dict]:
    """({name: tensor} of the reference-image branch after the run, the same as the run built it: its seed)."""
    from opendit.distributed import unwrap_model
    cfg, family = trainer.cfg, trainer.family
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.global_seed)
        initial = family.build_model(cfg, family.latent_shape(cfg, trainer.encoders, trainer.dataset))
    trained = dict(unwrap_model(trainer.model).named_parameters())
    names = family.glue.unused_parameters(initial)  # as a text-to-image run names the branch
    assert names and all(".image_cond." in n for n in names)
    return {n: trained[n] for n in names}, {n: initial.get_parameter(n) for n in names}


def test_references_join_as_the_pipelines_image_cond_steps_prepare_them_and_train_the_branch(parts):
    """Two controls per target: their latents as Flux3VaeEncoderStep encodes the pipeline's condition images, packed
    with their ids (l = -1, -2) by Flux3PrepareImageCondLatentsStep; the loss on the target's tokens; every parameter,
    the reference-image branch's too, gets a gradient."""
    from diffusers.modular_pipelines.flux3.before_denoise import (Flux3PrepareImageCondLatentsStep,
                                                                 Flux3TextRoPEInputsStep, _prepare_image_ids)
    from diffusers.modular_pipelines.flux3.encoders import Flux3VaeEncoderStep

    from opendit.families import FAMILIES
    from opendit.families.wrapped.glue import pack
    family = FAMILIES["flux3"]
    cfg = family.resolve_config(cfglib.TrainConfig(**options(parts), outputs="unused"))
    enc = family.load_encoders(cfg, torch.device("cpu"), training=True)
    torch.manual_seed(0)
    model = family.build_model(cfg, family.latent_shape(cfg, enc)).eval()
    assert all(p.requires_grad for p in model.parameters())  # pairs: the reference-image branch trains
    targets, controls = torch.rand(2, 3, 16, 16) * 2 - 1, torch.rand(2, 2, 3, 16, 16) * 2 - 1
    objective = family.objective(cfg, enc)
    x, cond = objective.prepare((targets, controls, ["mirror it", "the next digit"]), torch.device("cpu"),
                                train=False)
    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=noise)

    encode = Flux3VaeEncoderStep().init_pipeline()
    encode.update_components(vae=enc.vae)
    latents = encode(condition_images=list(controls.unbind(1)), output="image_cond_latents")
    prepared = Flux3PrepareImageCondLatentsStep().init_pipeline()(
        image_cond_latents=latents, dtype=torch.float32, output=["image_cond_hidden_states", "image_cond_ids"])
    assert prepared["image_cond_hidden_states"].shape == (2, 2 * 16, 16)
    assert prepared["image_cond_ids"][:, 3].unique().tolist() == [-2, -1]
    x_t = (1 - t.view(-1, 1, 1, 1)) * x + t.view(-1, 1, 1, 1) * noise
    txt_ids = Flux3TextRoPEInputsStep._prepare_text_ids(cond["embeds"])
    pred = model(hidden_states=pack(x_t), encoder_hidden_states=cond["embeds"], timestep=t, txt_ids=txt_ids,
                 img_ids=_prepare_image_ids(4, 4, 0.5), **prepared, return_dict=False)[0]
    torch.testing.assert_close(losses, ((pred - pack(noise - x)) ** 2).mean((1, 2)), rtol=1e-6, atol=1e-7)

    losses.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
               if ".image_cond." in n)
    assert all(p.grad is not None for p in model.parameters())


def test_an_editing_run_trains_the_branch_resumes_exactly_and_samples_as_the_pipeline(tmp_path, parts, one_thread):
    """A folder of pairs with two controls per target trains from the command line at 64 px (the pipeline pads a
    single reference to 64 px and more); resumed, the run's losses are the uninterrupted run's; the reference-image
    branch has trained; sample.py --image a.png,b.png gives Flux3ModularPipeline's own images with image=[a, b]."""
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, Flux3AutoBlocks, Flux3ModularPipeline

    from opendit.data.transforms import resize_crop
    from opendit.families.wrapped.flux3 import SCHEDULER
    from opendit.inference import load_model
    from opendit.seeding import sampling_generator
    targets, controls = write_pairs(tmp_path)
    run = options(parts, dataset="edit_pairs", data_path=targets, control_directory=controls, image_size=64)
    trainer, _ = trains_and_resumes_exactly(run, tmp_path)
    trained, initial = _image_cond(trainer)
    assert all(p.requires_grad for p in trained.values())
    assert all(not torch.equal(trained[n], initial[n]) for n in trained)

    pair = [tmp_path / "c" / "0_0.png", tmp_path / "c" / "0_1.png"]
    prompts = ["mirror it", "the next digit"]
    sample_here("--ckpt", "latest", "--outputs", tmp_path / "cli", "--image", ",".join(map(str, pair)), "--prompts",
                *prompts, "--num_sampling_steps", "2", "--npz", "--out", tmp_path / "s")
    ours = np.load(tmp_path / "s" / "samples.npz")["arr_0"]
    loaded = load_model(cfglib.SampleConfig(ckpt="latest", outputs=str(tmp_path / "cli")), torch.device("cpu"))
    cond, negative = loaded.encoders.encode(prompts, "cpu"), loaded.encoders.encode(["", ""], "cpu")
    blocks = Flux3AutoBlocks()  # prompts as embeddings: no upsampler, no text encoder
    blocks.sub_blocks.pop("prompt_upsampler"), blocks.sub_blocks.pop("text_encoder")
    pipe = Flux3ModularPipeline(blocks=blocks)
    pipe.update_components(vae=loaded.encoders.vae, transformer=loaded.model,
                           scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
                           guider=ClassifierFreeGuidance(guidance_scale=3.5))  # flux3-debug's cfg_scale
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(image=[resize_crop(Image.open(p).convert("RGB"), 64, 64) for p in pair],
                  prompt_embeds=cond["embeds"], negative_prompt_embeds=negative["embeds"], height=64, width=64,
                  num_inference_steps=2, output="images", output_type="np",
                  latents=torch.randn(2, *loaded.latent_shape, generator=sampling_generator(0, 0)))
    assert ours.shape == (2, 64, 64, 3)
    assert np.array_equal(ours, (theirs * 255).round().astype(np.uint8))


def test_a_text_to_image_run_leaves_the_reference_branch_frozen_and_untouched(tmp_path, parts, one_thread):
    """No gradient reaches the branch a text-to-image run never feeds: frozen, so the run keeps it as built."""
    trainer, losses = run_trainer(cfglib.TrainConfig(**options(parts, dataset="captioned_digits"), max_steps=2,
                                                     outputs=str(tmp_path)))
    assert all(np.isfinite(losses))
    trained, initial = _image_cond(trainer)
    assert all(not p.requires_grad and p.grad is None for p in trained.values())
    assert all(torch.equal(trained[n], initial[n]) for n in trained)
