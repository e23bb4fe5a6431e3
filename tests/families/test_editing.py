"""Editing pairs and reference images: the pair datasets (a target folder with its control folder, the edit-digits
demo), FLUX.1 Kontext's loss as its pipeline prepares the sequence, its samples as FluxKontextPipeline's own, the CLI
run (train, resume exactly, sample with --image), a LoRA of it in FluxKontextPipeline, and the errors of a pair or a
reference given where none fits."""
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from opendit import config as cfglib
from opendit.data import EditDigitsDataset, EditPairsDataset
from tests.run_each import run_here, sample_here, trains_and_resumes_exactly
from tests.test_train import run_trainer

MODEL = "flux1-kontext-debug-diffusers"


@pytest.fixture(scope="module")
def text_encoder(tmp_path_factory):
    from opendit.families.wrapped.tiny_text import write_text_encoder
    return write_text_encoder(MODEL, tmp_path_factory.mktemp("text") / "clip_t5", "edit_digits")


def options(text: str, **more) -> dict:
    return {**dict(model=MODEL, dataset="edit_digits", image_size=16, vae="none", text_encoder=text, batch_size=4,
                   num_workers=0, log_every=1, lr=1e-3), **more}


def _image(path, size, value: int):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (value, value, value)).save(path)


def _pairs(root, targets: dict, controls: dict):
    for name, value in targets.items():
        _image(root / "targets" / f"{name}.png", (16, 16), value)
        (root / "targets" / f"{name}.txt").write_text(f"make it {name}")
    for name, (size, value) in controls.items():
        _image(root / "controls" / f"{name}.png", size, value)
    return str(root / "targets"), str(root / "controls")


def write_pairs(root, size: int = 16, channels: int = 1, count: int = 8) -> tuple[str, str]:
    """`count` edit-digit pairs as files: root/t/ the targets with their instructions, root/c/ two controls each
    (name_0: the pair's control, name_1: another digit); -> (targets folder, controls folder)."""
    data = EditDigitsDataset(size, channels=channels)
    (root / "t").mkdir(parents=True), (root / "c").mkdir()

    def save(pixels, path):  # [C, H, W] in [-1, 1]
        array = np.uint8(pixels.add(1).mul(127.5).round().permute(1, 2, 0).numpy())
        Image.fromarray(array[..., 0] if channels == 1 else array).save(path)
    for i in range(count):
        target, control, caption = data[i]
        save(target, root / "t" / f"{i}.png")
        (root / "t" / f"{i}.txt").write_text(caption)
        for k, image in enumerate((control[0], data[i + count][0])):
            save(image, root / "c" / f"{i}_{k}.png")
    return str(root / "t"), str(root / "c")


def test_targets_meet_their_controls_by_name_and_the_unmatched_are_counted_and_named(tmp_path, caplog):
    targets, controls = _pairs(tmp_path, {"a": 10, "b": 20, "c": 30, "sub/d": 40},
                               {"a": ((12, 20), 110), "b": ((16, 16), 120), "sub/d": ((16, 16), 140),
                                "z": ((16, 16), 250)})
    with caplog.at_level(logging.WARNING):
        data = EditPairsDataset(targets, 16, control_directory=controls)
    assert (len(data), data.num_without_control, data.num_unmatched_controls, data.controls_per_target) == (3, 1, 1, 1)
    assert "1 target(s) without a control" in caplog.text and ": c" in caplog.text
    assert "1 control(s) that no target is named as: z" in caplog.text
    found = {caption: (target, control) for target, control, caption in (data[i] for i in range(3))}
    target, control = found["make it a"]
    assert target.shape == (3, 16, 16) and control.shape == (1, 3, 16, 16)  # a 12 x 20 control: resized, cropped
    assert torch.allclose(control, torch.full_like(control, 110 / 127.5 - 1), atol=1e-2)
    assert torch.allclose(found["make it sub/d"][1], torch.full((1, 3, 16, 16), 140 / 127.5 - 1), atol=1e-2)


def test_several_controls_of_a_target_come_in_their_numbers_order_and_counts_must_agree(tmp_path):
    controls = {f"a_{i}": ((16, 16), 10 * i) for i in (10, 2, 0)} | {f"b_{i}": ((16, 16), 5) for i in (0, 1, 2)}
    targets, folder = _pairs(tmp_path, {"a": 1, "b": 2}, controls)
    data = EditPairsDataset(targets, 16, control_directory=folder)
    _, control, _ = data[0]
    assert data.controls_per_target == 3
    assert [round(float(c.mean() + 1) * 127.5) for c in control] == [0, 20, 100]
    (tmp_path / "controls" / "b_2.png").unlink()
    with pytest.raises(ValueError, match="different numbers of controls"):
        EditPairsDataset(targets, 16, control_directory=folder)
    with pytest.raises(ValueError, match="--control_directory"):
        EditPairsDataset(targets, 16)


def test_the_edit_digits_demo_makes_each_edit():
    data = EditDigitsDataset(16)
    mirror, rotate, thicker, following = (next(i for i in range(len(data)) if data.edits[i] == e) for e in (1, 2, 3, 0))
    target, control, caption = data[mirror]
    assert caption == "mirror it" and torch.equal(target, control[0].flip(-1))
    target, control, caption = data[rotate]
    assert caption == "rotate it a quarter turn" and torch.equal(target, control[0].rot90(1, (1, 2)))
    target, control, _ = data[thicker]
    assert (target >= control[0]).all() and (target > control[0]).any()
    _, _, caption = data[following]
    assert caption == "the next digit" and data.labels[following] == (data._labels[following] + 1) % 10


def test_kontexts_loss_is_the_pipelines_sequence_with_the_loss_on_the_target(text_encoder):
    """The reference joins the sequence as FluxKontextPipeline.prepare_latents makes it (its latents and its ids,
    first coordinate 1), without noise; the loss covers the target's tokens only."""
    from diffusers import FluxKontextPipeline

    from opendit.families import FAMILIES
    from opendit.families.wrapped.glue import patchify
    family = FAMILIES["flux1"]
    cfg = family.resolve_config(cfglib.TrainConfig(**options(text_encoder), outputs="unused"))
    enc = family.load_encoders(cfg, torch.device("cpu"), training=True)
    torch.manual_seed(0)
    model = family.build_model(cfg, family.latent_shape(cfg, enc)).eval()
    data = EditDigitsDataset(16)
    targets, controls, captions = (torch.stack([data[i][0] for i in range(2)]),
                                   torch.stack([data[i][1] for i in range(2)]), [data[i][2] for i in range(2)])
    objective = family.objective(cfg, enc)
    x, cond = objective.prepare((targets, controls, captions), torch.device("cpu"), train=False)
    t, noise = torch.tensor([0.3, 0.8]), torch.randn(2, 1, 16, 16)
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=patchify(noise))
    pipe = FluxKontextPipeline(None, enc.vae, None, None, None, None, model)
    noisy = (1 - t[:, None, None, None]) * targets + t[:, None, None, None] * noise
    latents, references, ids, reference_ids = pipe.prepare_latents(
        controls[:, 0], 2, 1, 16, 16, torch.float32, "cpu", latents=pipe._pack_latents(noisy, 2, 1, 16, 16))
    out = model(hidden_states=torch.cat([latents, references], 1), timestep=t, guidance=torch.ones(2),
                pooled_projections=cond["pooled"], encoder_hidden_states=cond["embeds"], txt_ids=torch.zeros(16, 3),
                img_ids=torch.cat([ids, reference_ids]), return_dict=False)[0][:, :latents.size(1)]
    by_hand = ((out - pipe._pack_latents(noise - targets, 2, 1, 16, 16)) ** 2).mean((1, 2))
    torch.testing.assert_close(losses, by_hand, rtol=1e-6, atol=1e-7)


def test_an_editing_run_trains_resumes_exactly_and_samples_as_the_pipeline(tmp_path, text_encoder, one_thread):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline

    from opendit.families.wrapped.flux1 import SCHEDULER
    from opendit.families.wrapped.glue import pack
    from opendit.inference import load_model
    from opendit.seeding import sampling_generator
    trains_and_resumes_exactly(options(text_encoder), tmp_path)
    reference = tmp_path / "seven.png"
    Image.fromarray(np.uint8(EditDigitsDataset(16)[7][0][0].add(1).mul(127.5).round())).save(reference)
    sample_here("--ckpt", "latest", "--outputs", tmp_path / "cli", "--image", reference, "--prompts", "mirror it",
                "the next digit", "--num_sampling_steps", "2", "--seed", "3", "--npz", "--out", tmp_path / "s")
    ours = np.load(tmp_path / "s" / "samples.npz")["arr_0"]
    assert ours.shape == (2, 16, 16, 3)
    loaded = load_model(cfglib.SampleConfig(ckpt="latest", outputs=str(tmp_path / "cli")), torch.device("cpu"))
    enc, prompts = loaded.encoders, ["mirror it", "the next digit"]
    cond, negative = enc.encode(prompts, "cpu"), enc.encode(["", ""], "cpu")
    pipe = FluxKontextPipeline(FlowMatchEulerDiscreteScheduler(**SCHEDULER), enc.vae, None, None, None, None,
                               loaded.model)
    theirs = pipe(image=[Image.open(reference).convert("L")] * 2, prompt_embeds=cond["embeds"],
                  pooled_prompt_embeds=cond["pooled"], negative_prompt_embeds=negative["embeds"],
                  negative_pooled_prompt_embeds=negative["pooled"], guidance_scale=2.5, max_sequence_length=16,
                  latents=pack(torch.randn(2, 4, 8, 8, generator=sampling_generator(3, 0))), height=16, width=16,
                  max_area=256, _auto_resize=False, num_inference_steps=2, output_type="np").images
    assert np.array_equal(ours[..., 0], (theirs[..., 0] * 255).round().astype(np.uint8))
    folder = tmp_path / "per_prompt"  # one reference per prompt: each sample its own, in one pipeline call
    folder.mkdir()
    Image.open(reference).save(folder / "0.png")
    Image.fromarray(np.uint8(EditDigitsDataset(16)[9][0][0].add(1).mul(127.5).round())).save(folder / "1.png")
    sample_here("--ckpt", "latest", "--outputs", tmp_path / "cli", "--image", folder, "--prompts", "mirror it",
                "the next digit", "--num_sampling_steps", "2", "--seed", "3", "--npz", "--out", tmp_path / "s2")
    theirs = pipe(image=[Image.open(folder / f"{i}.png").convert("L") for i in (0, 1)], prompt_embeds=cond["embeds"],
                  pooled_prompt_embeds=cond["pooled"], negative_prompt_embeds=negative["embeds"],
                  negative_pooled_prompt_embeds=negative["pooled"], guidance_scale=2.5, max_sequence_length=16,
                  latents=pack(torch.randn(2, 4, 8, 8, generator=sampling_generator(3, 0))), height=16, width=16,
                  max_area=256, _auto_resize=False, num_inference_steps=2, output_type="np").images
    ours = np.load(tmp_path / "s2" / "samples.npz")["arr_0"]
    assert np.array_equal(ours[..., 0], (theirs[..., 0] * 255).round().astype(np.uint8))


def test_pairs_for_a_model_without_references_and_an_image_it_cannot_take_are_one_error_each(tmp_path,
                                                                                            text_encoder):
    from opendit.families import FAMILIES
    family = FAMILIES["flux1"]
    with pytest.raises(ValueError, match="flux1-debug-diffusers takes no reference image.*train flux1-kontext"):
        family.resolve_config(cfglib.TrainConfig(**options(text_encoder, model="flux1-debug-diffusers"),
                                                 outputs="unused"))
    plain = cfglib.TrainConfig(**options(text_encoder, model="flux1-debug-diffusers", dataset="captioned_digits"),
                               outputs="unused")
    with pytest.raises(ValueError, match="--image x.png: flux1-debug-diffusers takes no reference image"):
        family.make_sampler(cfglib.SampleConfig(image="x.png"), plain)


def test_a_dataset_config_lists_pairs_with_their_control_directory(tmp_path, text_encoder):
    from opendit.data.mixture import read_dataset_config
    from opendit.families import FAMILIES
    targets, controls = _pairs(tmp_path, {"a": 10, "b": 20}, {"a": ((16, 16), 110), "b": ((16, 16), 120)})
    config = tmp_path / "data.toml"
    config.write_text(f'[[datasets]]\nkind = "edit_pairs"\npath = "{targets}"\ncontrol_directory = "{controls}"\n'
                      f'trigger = "sks"\n')
    family = FAMILIES["flux1"]
    cfg = cfglib.TrainConfig(**options(text_encoder, dataset_config=str(config)), outputs="unused")
    entries = read_dataset_config(config, cfg, family.datasets)
    assert entries[0].settings["control_directory"] == controls
    config.write_text(config.read_text() + '\n[[datasets]]\nkind = "captioned_digits"\n')
    with pytest.raises(ValueError, match="editing pairs and single images in one run"):
        read_dataset_config(config, cfg, family.datasets)


def test_a_kontext_lora_loads_into_flux_kontext_pipeline_and_edits_as_opendit_samples(tmp_path, text_encoder,
                                                                                    one_thread):
    """A LoRA trained on pairs (on a random base), in the diffusers / PEFT layout opendit writes, loaded into
    FluxKontextPipeline (load_lora_weights) edits the reference as sample.py does with opendit's LoRA checkpoint."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline

    from opendit.checkpoint import load_weights
    from opendit.families import FAMILIES
    from opendit.families.wrapped.flux1 import SCHEDULER
    from opendit.families.wrapped.glue import PixelSpace, pack
    from opendit.seeding import sampling_generator
    run = options(text_encoder)
    run_trainer(cfglib.TrainConfig(**run, max_steps=1, outputs=str(tmp_path / "base")))
    base = next((tmp_path / "base").glob("*/checkpoints/step-000001/ema.safetensors"))
    run_trainer(cfglib.TrainConfig(**{**run, "lr": 3e-2}, max_steps=2, ckpt_every=2, lora_rank=4, ema_decay=0.0,
                                   init_weights=str(base), outputs=str(tmp_path / "lora")))
    step = next((tmp_path / "lora").glob("*/checkpoints/step-000002"))
    reference = tmp_path / "two.png"
    Image.fromarray(np.uint8(EditDigitsDataset(16)[2][1][0, 0].add(1).mul(127.5).round())).save(reference)
    run_here("sample.py", "--ckpt", step, "--image", reference, "--prompts", "mirror it", "--num_sampling_steps", "2",
             "--npz", "--out", tmp_path / "ours")
    ours = np.load(tmp_path / "ours" / "samples.npz")["arr_0"][..., 0]
    family = FAMILIES["flux1"]
    cfg = family.resolve_config(cfglib.TrainConfig(**run, outputs="unused"))
    enc = family.load_encoders(cfg, torch.device("cpu"), training=False)
    model = family.build_model(cfg, family.latent_shape(cfg, enc))
    model.load_state_dict(load_weights(str(base)))
    pipe = FluxKontextPipeline(FlowMatchEulerDiscreteScheduler(**SCHEDULER), PixelSpace(1), None, None, None, None,
                               model)
    cond = enc.encode(["mirror it"], "cpu")

    def edit():
        return pipe(image=[Image.open(reference).convert("L")], prompt_embeds=cond["embeds"],
                    pooled_prompt_embeds=cond["pooled"], guidance_scale=2.5, max_sequence_length=16,
                    latents=pack(torch.randn(1, 4, 8, 8, generator=sampling_generator(0, 0))), height=16, width=16,
                    max_area=256, _auto_resize=False, num_inference_steps=2, output_type="np").images[..., 0]
    without = edit()
    pipe.load_lora_weights(str(step / "lora.safetensors"))
    with_lora = (edit() * 255).round().astype(np.uint8)
    assert np.abs(ours.astype(int) - with_lora.astype(int)).max() <= 1
    assert not np.array_equal((without * 255).round().astype(np.uint8), with_lora)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from opendit.families.wrapped.tiny_text import write_text_encoder
    return write_text_encoder("flux2-klein-debug", tmp_path_factory.mktemp("qwen3") / "qwen3", "edit_digits")


def test_flux2s_references_join_the_sequence_as_its_pipeline_prepares_them(qwen3):
    """Two references per target: their latents and 4-D ids (time coordinates 10 and 20) as
    Flux2KleinPipeline.prepare_image_latents makes them, without noise; the loss on the target's tokens."""
    from diffusers import Flux2KleinPipeline

    from opendit.families import FAMILIES
    from opendit.families.wrapped.glue import patchify
    family = FAMILIES["flux2"]
    cfg = family.resolve_config(cfglib.TrainConfig(**options(qwen3, model="flux2-klein-debug"), outputs="unused"))
    enc = family.load_encoders(cfg, torch.device("cpu"), training=True)
    torch.manual_seed(0)
    model = family.build_model(cfg, family.latent_shape(cfg, enc)).eval()
    data = EditDigitsDataset(16)
    targets = torch.stack([data[i][0] for i in (1, 2)])
    references = [data[i][1] for i in (3, 4)]  # [1, 1, 16, 16] each: the same two for both targets
    controls = torch.cat(references, dim=0)[None].expand(2, -1, -1, -1, -1)
    objective = family.objective(cfg, enc)
    x, cond = objective.prepare((targets, controls, ["mirror it", "the next digit"]), torch.device("cpu"),
                                train=False)
    t, noise = torch.tensor([0.3, 0.8]), torch.randn(2, 1, 16, 16)
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=patchify(noise))
    pipe = Flux2KleinPipeline(None, enc.vae, None, None, model)
    latents, ids = pipe._pack_latents(patchify((1 - t.view(-1, 1, 1, 1)) * targets + t.view(-1, 1, 1, 1) * noise)), \
        pipe._prepare_latent_ids(patchify(targets))
    reference_latents, reference_ids = pipe.prepare_image_latents(references, 2, None, "cpu", torch.float32)
    assert reference_ids[0, :, 0].unique().tolist() == [10, 20]
    out = model(hidden_states=torch.cat([latents, reference_latents], 1), encoder_hidden_states=cond["embeds"],
                timestep=t, img_ids=torch.cat([ids, reference_ids], 1), txt_ids=pipe._prepare_text_ids(cond["embeds"]),
                return_dict=False)[0][:, :latents.size(1)]
    by_hand = ((out - pipe._pack_latents(patchify(noise - targets))) ** 2).mean((1, 2))
    torch.testing.assert_close(losses, by_hand, rtol=1e-6, atol=1e-7)


def test_flux2_trains_on_two_controls_a_target_and_samples_them_as_its_pipeline(tmp_path, qwen3, one_thread):
    """A folder of pairs with two controls per target (name_0, name_1) trains from the command line (64 px through a
    tiny AutoencoderKLFlux2: the pipelines take references of 64 px and more); sample.py --image a.png,b.png gives
    Flux2KleinPipeline's own images with image=[a, b] (at the sample size, as opendit hands them over)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline

    from opendit.data.transforms import resize_crop
    from opendit.families.wrapped.flux2 import SCHEDULER
    from opendit.inference import load_model
    from opendit.seeding import sampling_generator
    from tests.test_flux2_family import save_tiny_flux2_vae
    targets, controls = write_pairs(tmp_path)
    run = options(qwen3, model="flux2-klein-debug", dataset="edit_pairs", data_path=targets,
                  control_directory=controls, image_size=64, vae=save_tiny_flux2_vae(tmp_path / "vae"))
    run_here("train.py", *[a for k, v in run.items() for a in (f"--{k}", str(v))], "--max_steps", "2",
             "--outputs", tmp_path / "run")
    pair = [tmp_path / "c" / "0_0.png", tmp_path / "c" / "0_1.png"]
    sample_here("--ckpt", "latest", "--outputs", tmp_path / "run", "--image", ",".join(map(str, pair)), "--prompts",
                "mirror it", "the next digit", "--num_sampling_steps", "2", "--cfg_scale", "1", "--npz", "--out",
                tmp_path / "s")
    ours = np.load(tmp_path / "s" / "samples.npz")["arr_0"]
    loaded = load_model(cfglib.SampleConfig(ckpt="latest", outputs=str(tmp_path / "run")), torch.device("cpu"))
    cond = loaded.encoders.encode(["mirror it", "the next digit"], "cpu")
    pipe = Flux2KleinPipeline(FlowMatchEulerDiscreteScheduler(**SCHEDULER), loaded.encoders.vae, None, None,
                              loaded.model)
    theirs = pipe(image=[resize_crop(Image.open(p).convert("RGB"), 64, 64) for p in pair],
                  prompt_embeds=cond["embeds"], guidance_scale=1.0, max_sequence_length=16,
                  text_encoder_out_layers=(1, 2, 3), height=64, width=64, num_inference_steps=2, output_type="np",
                  latents=torch.randn(2, *loaded.latent_shape, generator=sampling_generator(0, 0))).images
    assert ours.shape == (2, 64, 64, 3)
    assert np.array_equal(ours, (theirs * 255).round().astype(np.uint8))


@pytest.mark.parametrize("family, arch, pipeline, model", [
    ("flux1", "FLUX1_DEV", "FluxKontextPipeline", "flux1-kontext-dev-diffusers"),
    ("flux1", "FLUX1_DEV", "FluxPipeline", "flux1-dev-diffusers"),
    ("qwenimage", "QWEN_IMAGE", "QwenImageEditPlusPipeline", "qwen-image-edit-2509"),
    ("qwenimage", "QWEN_IMAGE", "QwenImagePipeline", "qwen-image")])
def test_a_pipeline_folder_names_which_model_of_one_architecture_it_holds(tmp_path, family, arch, pipeline, model):
    """FLUX.1-dev and Kontext [dev], Qwen-Image and Qwen-Image-Edit-2509 share an architecture: a pipeline folder's
    model_index.json (its pipeline class) tells them apart; an edit-only model's run defaults to pairs."""
    import importlib
    import json

    from opendit.families import FAMILIES
    config = getattr(importlib.import_module(f"opendit.families.wrapped.{family}"), arch)
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(
        {"_class_name": FAMILIES[family].glue.transformer_class, **config}))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    settings, _ = FAMILIES[family].recognize_checkpoint(str(tmp_path))
    assert settings["model"] == model
    assert settings["dataset"] == ("edit_pairs" if model.startswith("qwen-image-edit") else "captions")
