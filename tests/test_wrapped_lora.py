"""LoRA files opendit writes for a diffusers-transformer model (FLUX.2 [klein], Z-Image, Qwen-Image), in both layouts,
load into the model's own diffusers pipeline (load_lora_weights, whose converters read the kohya/ComfyUI layout:
FLUX.2's under BFL's fused module names) and sample what opendit's LoRA checkpoint samples; unloaded, the pipeline
samples something else (the adapters mattered); sample.py --lora with the kohya file on the base samples the same too.
And gpu_check.sh's step benchmark of these models runs on the CPU."""
import types

import numpy as np
import pytest
import torch

from opendit import config as cfglib
from tests.run_each import run_here
from tests.test_train import run_trainer


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from opendit.families.wrapped.flux2 import save_tiny_qwen3
    return save_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def qwen25vl(tmp_path_factory):
    from opendit.families.wrapped.qwenimage import save_tiny_qwen25vl
    return save_tiny_qwen25vl(tmp_path_factory.mktemp("qwen25vl"))


def diffusers_pipeline(common: dict, base) -> tuple:
    """(the model's own diffusers pipeline on the `base` weights file, its transformer, images()) for the training
    settings `common`; images() samples "a handwritten one" twice (8 px, 3 steps, no guidance) from fixed noise, as
    uint8 arrays like the pipeline's PIL images (sample.py --npz writes the same)."""
    from opendit.checkpoint import load_weights
    from opendit.families import family_of
    from opendit.families.wrapped.glue import PixelSpace
    from opendit.seeding import sampling_generator

    family = family_of(common["model"])
    cfg = family.resolve_config(cfglib.TrainConfig(**common))
    enc = family.load_encoders(cfg, torch.device("cpu"), training=False)
    shape = family.latent_shape(cfg, enc)
    transformer = family.build_model(cfg, shape)
    transformer.load_state_dict(load_weights(str(base)))
    pipe = family.glue.pipeline(transformer, PixelSpace(1), None)
    noise = torch.randn(2, *shape, generator=sampling_generator(0, 0))
    cond = enc.encode(["a handwritten one"] * 2, "cpu")
    call = family.glue.pipeline_call(types.SimpleNamespace(cfg=cfg), cfglib.SampleConfig(cfg_scale=1.0), cond, cond)

    def images():
        found = pipe(latents=family.glue.pipeline_latents(noise), height=8, width=8, num_inference_steps=3,
                     output_type="np", **call).images
        return (np.asarray(found) * 255).round().astype(np.uint8)  # as the pipeline's PIL images
    return pipe, transformer, images


@pytest.mark.parametrize("model", ["flux2-klein-debug", "z-image-debug", "qwen-image-debug"])
def test_lora_files_load_into_the_pipeline_and_sample_the_same(tmp_path, qwen, qwen25vl, model):
    encoder = qwen25vl if model == "qwen-image-debug" else qwen
    common = dict(model=model, dataset="captioned_digits", image_size=8, vae="none", text_encoder=encoder,
                  batch_size=4, log_every=1, num_workers=0)
    run_trainer(cfglib.TrainConfig(**common, max_steps=2, outputs=str(tmp_path / "base"), lr=1e-3, ema_decay=0.9))
    base = next((tmp_path / "base").glob("*/checkpoints/step-000002/ema.safetensors"))
    # lr high enough that the adapters move the samples
    run_trainer(cfglib.TrainConfig(**common, max_steps=3, outputs=str(tmp_path / "lora"), lr=3e-2, lora_rank=4,
                                   init_weights=str(base), ckpt_every=3, ema_decay=0.0))
    step = next((tmp_path / "lora").glob("*/checkpoints/step-000003"))
    sampling = ["--prompts", "a handwritten one", "--num_samples", "2", "--num_sampling_steps", "3", "--cfg_scale", "1",
                "--npz"]
    run_here("sample.py", "--ckpt", step, *sampling, "--out", tmp_path / "ours")
    ours = np.load(tmp_path / "ours" / "samples.npz")["arr_0"]
    run_here("sample.py", "--ckpt", base, "--model", model, "--text_encoder", encoder, "--vae", "none",
        "--image_size", "8", "--lora", step / "lora_kohya.safetensors", *sampling, "--out", tmp_path / "kohya")
    np.testing.assert_array_equal(np.load(tmp_path / "kohya" / "samples.npz")["arr_0"], ours)

    pipe, _, images = diffusers_pipeline(common, base)
    without = images()
    for file in ("lora.safetensors", "lora_kohya.safetensors"):  # the diffusers / PEFT layout, kohya / ComfyUI's
        pipe.load_lora_weights(str(step / file))
        with_lora = images()
        assert np.abs(ours.astype(int) - with_lora.astype(int)).max() <= 1, file
        pipe.unload_lora_weights()
        assert not np.array_equal(without, with_lora), file


def test_a_kohya_flux2_file_under_bfl_names_loads_as_diffusers_reads_it(tmp_path):
    """A FLUX.2 LoRA as kohya / musubi-tuner / ComfyUI write it: BFL's module names, one A shared by the rows of a
    fused qkv, alpha != rank. opendit applies to each diffusers Linear the update diffusers' own converter
    (Flux2KleinPipeline.lora_state_dict) gives it, and every tensor of the file lands somewhere."""
    from diffusers import Flux2KleinPipeline
    from safetensors.torch import save_file

    from opendit.families import family_of
    from opendit.lora import linear_names, load_adapters
    from opendit.lora.formats import kohya_name
    from opendit.lora.run import family_kohya_map, family_module_map

    family = family_of("flux2-klein-debug")
    model = family.models["flux2-klein-debug"].build()
    kohya = family_kohya_map(family, model)
    torch.manual_seed(0)
    state, rank = {}, 4
    for name, parts in kohya.items():
        rows = sum(len(r) for _, r in parts)
        inputs = dict(model.named_modules())[parts[0][0]].in_features
        key = kohya_name(name)
        state |= {f"{key}.lora_down.weight": torch.randn(rank, inputs),
                  f"{key}.lora_up.weight": torch.randn(rows, rank), f"{key}.alpha": torch.tensor(2.0)}
    path = str(tmp_path / "bfl_kohya.safetensors")
    save_file(state, path)
    ours = load_adapters(path, family_module_map(family, model), linear_names(model), kohya)
    theirs = Flux2KleinPipeline.lora_state_dict(path)
    targets = {k.removeprefix("transformer.").removesuffix(".lora_A.weight") for k in theirs if "lora_A" in k}
    assert set(ours) == targets and len(targets) == sum(len(parts) for parts in kohya.values())
    for target in targets:  # diffusers bakes alpha / rank into the weights it converts
        A, B = (theirs[f"transformer.{target}.lora_{ab}.weight"] for ab in "AB")
        torch.testing.assert_close(ours[target].delta(), B @ A, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model, rank, references, frames", [  # frames: a clip their VAE takes (1 + 4k, 1 + 8k)
    ("flux2-klein-debug", 4, 0, None), ("z-image-debug", 0, 0, None), ("qwen-image-debug", 4, 0, None),
    ("chroma-debug", 4, 0, None), ("hunyuanvideo1.5-debug", 4, 0, 17), ("ltx2-debug", 4, 0, 17),
    ("flux1-kontext-debug-diffusers", 4, 1, None)])
def test_the_gpu_step_benchmark_runs_on_cpu(model, rank, references, frames):
    """benchmarks/wrapped_step.py (gpu_check.sh's FLUX.2 / Z-Image / Qwen-Image / Chroma / LTX-2 / editing rows) on
    the debug models: finite, and LoRA trains only the adapters."""
    from benchmarks.wrapped_step import step_figures

    args = types.SimpleNamespace(model=model, image_size=32 if model == "ltx2-debug" else 16, lora_rank=rank,
                                 batch_size=2, steps=2, grad_checkpoint=1, device="cpu", num_frames=frames,
                                 references=references)
    found = step_figures(args)
    assert np.isfinite(found["loss"]) and found["step_s"] > 0
    assert (found["trainable"] < found["params"] / 4) if rank else found["trainable"] == found["params"]
