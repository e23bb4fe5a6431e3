"""Qwen-Image-Edit (2509/2511) on editing pairs: the prompt sees the references as QwenImageEditPlusPipeline shows
them to Qwen2.5-VL, the references join the sequence as its prepare_latents makes them (at its reference area), the
loss covers the target; the CLI run with two controls a target trains, resumes exactly and samples as the pipeline
itself does from the prompt strings and images (its own text encoder and processor); a latent cache of its pairs
trains as the pairs; what an edit-only model refuses.
The debug model edits through a tiny AutoencoderKLQwenImage that downsamples 16x (the release's: 8x): the pipeline
hands references to the VAE at about 1024 x 1024 whatever the target's size, 1,024 tokens each here."""
import numpy as np
import pytest
import torch
from PIL import Image

from opendit import config as cfglib
from tests.families.test_editing import write_pairs
from tests.run_each import run_here, sample_here, trains_and_resumes_exactly
from tests.test_train import run_trainer

MODEL = "qwen-image-edit-debug"


def save_tiny_qwen_vae_16x(folder) -> str:
    from diffusers import AutoencoderKLQwenImage
    torch.manual_seed(0)
    AutoencoderKLQwenImage(base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False] * 4, latents_mean=[0.1, -0.2, 0.3, 0.0],
                           latents_std=[1.5, 0.8, 2.0, 1.0]).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """(text encoder folder, VAE folder, a folder of 6 pairs: 64-px targets with two controls each)."""
    from opendit.families.wrapped.tiny_text import write_text_encoder
    root = tmp_path_factory.mktemp("qwen_edit")
    text = write_text_encoder(MODEL, root / "text", "edit_digits")
    write_pairs(root, size=64, channels=3, count=6)
    return text, save_tiny_qwen_vae_16x(root / "vae"), root


def options(parts, **more) -> dict:
    text, vae, root = parts
    return {**dict(model=MODEL, dataset="edit_pairs", data_path=str(root / "t"), control_directory=str(root / "c"),
                   image_size=64, vae=vae, text_encoder=text, batch_size=2, num_workers=0, log_every=1, lr=1e-3),
            **more}


def _pipeline(model, vae, text: str):
    """QwenImageEditPlusPipeline with its own text encoder, tokenizer and processor read from `text`."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from opendit.families.wrapped.qwenimage import SCHEDULER, image_text_processor
    return QwenImageEditPlusPipeline(FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae,
                                     Qwen2_5_VLForConditionalGeneration.from_pretrained(text).eval(),
                                     AutoTokenizer.from_pretrained(text), image_text_processor().from_pretrained(text),
                                     model)


def test_the_prompt_and_the_sequence_are_the_pipelines_with_the_loss_on_the_target(parts):
    """Two references per target: the prompt embedding is the pipeline's encode_prompt of the instruction with the
    references at its condition area ("Picture 1: ... Picture 2: ..."); their latents follow the target's tokens as
    its prepare_latents makes them from the references at its reference area (grids in img_shapes; 2511's time 0 for
    them inside the model); the loss is on the target's tokens."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE,
                                                                             calculate_dimensions)

    from opendit.data import EditPairsDataset
    from opendit.families import FAMILIES
    from opendit.families.wrapped.glue import pack
    from opendit.families.wrapped.references import control_images
    family = FAMILIES["qwenimage"]
    cfg = family.resolve_config(cfglib.TrainConfig(**options(parts), outputs="unused"))
    enc = family.load_encoders(cfg, torch.device("cpu"), training=True)
    torch.manual_seed(0)
    model = family.build_model(cfg, family.latent_shape(cfg, enc)).eval()
    assert model.config.zero_cond_t
    data = EditPairsDataset(str(parts[2] / "t"), 64, control_directory=str(parts[2] / "c"))
    items = [data[i] for i in (0, 1)]
    targets, controls = torch.stack([t for t, _, _ in items]), torch.stack([c for _, c, _ in items])
    captions = [c for _, _, c in items]
    objective = family.objective(cfg, enc)
    x, cond = objective.prepare((targets, controls, captions), torch.device("cpu"), train=False)
    assert cond["references"].shape == (2, 2, 16, 32, 32)  # 1024 x 1024 at 16x down, 2 x 2 patches
    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=noise)

    pipe = _pipeline(model, enc.vae, parts[0])
    by_hand = []
    for b, images in enumerate(control_images(controls)):
        shown = [pipe.image_processor.resize(image, h, w) for image in images
                 for w, h in [calculate_dimensions(CONDITION_IMAGE_SIZE, 1.0)]]
        embeds, mask = pipe.encode_prompt(captions[b], image=shown, device="cpu")
        vae_images = [pipe.image_processor.preprocess(image, h, w).unsqueeze(2) for image in images
                      for w, h in [calculate_dimensions(VAE_IMAGE_SIZE, 1.0)]]
        _, reference_tokens = pipe.prepare_latents(vae_images, 1, 4, 64, 64, torch.float32, "cpu", None,
                                                   latents=torch.zeros(1, 4, 16))
        noisy = pack((1 - t[b]) * x[b:b + 1] + t[b] * noise[b:b + 1])  # the target's tokens: as the t2i model's
        out = model(hidden_states=torch.cat([noisy, reference_tokens], 1), encoder_hidden_states=embeds,
                    encoder_hidden_states_mask=mask, timestep=t[b:b + 1], img_shapes=[[(1, 2, 2), (1, 32, 32),
                                                                                       (1, 32, 32)]],
                    return_dict=False)[0][:, :4]
        by_hand.append(((out - pack(noise[b:b + 1] - x[b:b + 1])) ** 2).mean())
        n = embeds.shape[1]
        assert mask is None and torch.equal(cond["embeds"][b, :n], embeds[0])
        assert cond["mask"][b, :n].all() and not cond["mask"][b, n:].any()
    torch.testing.assert_close(losses, torch.stack(by_hand), rtol=1e-5, atol=1e-6)


def test_an_edit_run_trains_resumes_exactly_and_samples_as_the_pipeline(tmp_path, parts, one_thread):
    """Train from the command line on pairs with two controls a target, resume exactly, and sample.py --image a,b
    gives QwenImageEditPlusPipeline's own images from the prompt strings and the two images (its text encoder and
    processor encode them there), one prompt per call as it samples, with its true CFG."""
    from opendit.data.transforms import resize_crop
    from opendit.families.wrapped.glue import pack
    from opendit.inference import load_model
    from opendit.seeding import sampling_generator
    trains_and_resumes_exactly(options(parts), tmp_path, steps=1)
    pair = [parts[2] / "c" / "0_0.png", parts[2] / "c" / "0_1.png"]
    prompts = ["mirror it", "the next digit"]
    sample_here("--ckpt", "latest", "--outputs", tmp_path / "cli", "--image", ",".join(map(str, pair)), "--prompts",
                *prompts, "--num_sampling_steps", "2", "--seed", "3", "--npz", "--out", tmp_path / "s")
    ours = np.load(tmp_path / "s" / "samples.npz")["arr_0"]
    assert ours.shape == (2, 64, 64, 3)
    loaded = load_model(cfglib.SampleConfig(ckpt="latest", outputs=str(tmp_path / "cli")), torch.device("cpu"))
    pipe = _pipeline(loaded.model, loaded.encoders.vae, parts[0])
    images = [resize_crop(Image.open(p).convert("RGB"), 64, 64) for p in pair]
    noise = torch.randn(2, *loaded.latent_shape, generator=sampling_generator(3, 0))
    for i, prompt in enumerate(prompts):
        theirs = pipe(image=images, prompt=prompt, negative_prompt="", true_cfg_scale=4.0, height=64, width=64,
                      num_inference_steps=2, latents=pack(noise[i:i + 1]),
                      output_type="np").images
        assert np.array_equal(ours[i], (theirs[0] * 255).round().astype(np.uint8)), prompt


def test_a_cache_of_its_pairs_trains_as_the_pairs(tmp_path, parts, one_thread):
    """preprocess.py stores each pair's controls at the pipeline's reference area, its instruction's prompt with the
    pictures and the empty instruction's with them (its caption dropout); a run on the cache loads no text encoder
    and logs the losses of a run on the pairs (caption dropout at 0.5)."""
    cache = tmp_path / "cache"
    run = options(parts, max_steps=3, caption_dropout_prob=0.5)
    run_here("preprocess.py", "--family", "qwenimage", "--model", MODEL, "--dataset", "edit_pairs", "--data_path",
             run["data_path"], "--control_directory", run["control_directory"], "--image_size", "64", "--vae",
             run["vae"], "--text_encoder", run["text_encoder"], "--out", cache, "--batch_size", "2",
             "--num_workers", "0")
    cached = {**run, "dataset": "latents", "data_path": str(cache)}
    del cached["control_directory"]
    trainer, on_cache = run_trainer(cfglib.TrainConfig(**cached, outputs=str(tmp_path / "c")))
    assert trainer.encoders.text is None
    _, on_pairs = run_trainer(cfglib.TrainConfig(**run, outputs=str(tmp_path / "p")))
    np.testing.assert_allclose(on_cache, on_pairs, rtol=1e-5)


def test_an_edit_only_model_refuses_what_it_cannot_do(parts, tmp_path):
    """Single images, previews (they give no reference), pixel space (references of about 1024 x 1024 pixels) and
    sampling without --image: one error line each, naming the fix."""
    from opendit.families import FAMILIES
    family = FAMILIES["qwenimage"]
    with pytest.raises(ValueError, match="trains on editing pairs"):
        family.resolve_config(cfglib.TrainConfig(**options(parts, dataset="captioned_digits"), outputs="unused"))
    with pytest.raises(ValueError, match="--sample_every 5: .* sample.py --image"):
        family.resolve_config(cfglib.TrainConfig(**options(parts, sample_every=5), outputs="unused"))
    with pytest.raises(ValueError, match="pixel space.*--vae"):
        run_trainer(cfglib.TrainConfig(**options(parts, vae="none", max_steps=1), outputs=str(tmp_path / "p")))
    with pytest.raises(ValueError, match="edits images: give the reference image"):
        family.make_sampler(cfglib.SampleConfig(ckpt="unused"),
                            family.resolve_config(cfglib.TrainConfig(**options(parts), outputs="unused")))
