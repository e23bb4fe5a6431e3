"""A LoRA file opendit writes for a diffusers-transformer model (FLUX.2 [klein], Z-Image) loads into the model's own
diffusers pipeline (load_lora_weights) and samples what opendit's LoRA checkpoint samples; unloaded, the pipeline
samples something else (the adapters mattered). And gpu_check.sh's step benchmark of these models runs on the CPU."""
import types

import numpy as np
import pytest
import torch

from opendit import config as cfglib
from tests.test_train import run_trainer
from tests.test_video_family import cli


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from opendit.families.wrapped.flux2 import save_tiny_qwen3
    return save_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.mark.parametrize("model", ["flux2-klein-debug", "z-image-debug"])
def test_a_lora_file_loads_into_the_pipeline_and_samples_the_same(tmp_path, qwen, model):
    from opendit.checkpoint import load_weights
    from opendit.families import family_of
    from opendit.families.wrapped.glue import PixelSpace
    from opendit.seeding import sampling_generator

    common = dict(model=model, dataset="captioned_digits", image_size=8, vae="none", text_encoder=qwen, batch_size=4,
                  log_every=1, num_workers=0)
    run_trainer(cfglib.TrainConfig(**common, max_steps=2, outputs=str(tmp_path / "base"), lr=1e-3, ema_decay=0.9))
    base = next((tmp_path / "base").glob("*/checkpoints/step-000002/ema.safetensors"))
    # lr high enough that the adapters move the samples
    run_trainer(cfglib.TrainConfig(**common, max_steps=3, outputs=str(tmp_path / "lora"), lr=3e-2, lora_rank=4,
                                   init_weights=str(base), ckpt_every=3, ema_decay=0.0))
    step = next((tmp_path / "lora").glob("*/checkpoints/step-000003"))
    out = tmp_path / "samples"
    cli("sample.py", "--ckpt", step, "--prompts", "a handwritten one", "--num_samples", "2", "--num_sampling_steps",
        "3", "--cfg_scale", "1", "--npz", "--out", out)
    ours = np.load(out / "samples.npz")["arr_0"]

    family = family_of(model)
    cfg = family.resolve_config(cfglib.TrainConfig(**common))
    enc = family.load_encoders(cfg, torch.device("cpu"), training=False)
    shape = family.latent_shape(cfg, enc)
    transformer = family.build_model(cfg, shape)
    transformer.load_state_dict(load_weights(str(base)))
    pipe = family.glue.pipeline(transformer, PixelSpace(1), None)
    pipe.load_lora_weights(str(step / "lora.safetensors"))  # the diffusers / PEFT layout
    noise = torch.randn(2, *shape, generator=sampling_generator(0, 0))
    cond = enc.encode(["a handwritten one"] * 2, "cpu")
    call = family.glue.pipeline_call(types.SimpleNamespace(cfg=cfg), cfglib.SampleConfig(cfg_scale=1.0), cond, cond)

    def images():
        found = pipe(latents=noise, height=8, width=8, num_inference_steps=3, output_type="np", **call).images
        return (np.asarray(found) * 255).round().astype(np.uint8)  # as the pipeline's PIL images
    with_lora = images()
    assert np.abs(ours.astype(int) - with_lora.astype(int)).max() <= 1
    pipe.unload_lora_weights()
    assert not np.array_equal(images(), with_lora)


@pytest.mark.parametrize("model, rank", [("flux2-klein-debug", 4), ("z-image-debug", 0), ("qwen-image-debug", 4),
                                         ("hunyuanvideo1.5-debug", 4)])
def test_the_gpu_step_benchmark_runs_on_cpu(model, rank):
    """benchmarks/wrapped_step.py (gpu_check.sh's FLUX.2 / Z-Image / Qwen-Image rows) on the debug models: finite,
    and LoRA trains only the adapters."""
    from benchmarks.wrapped_step import step_figures

    args = types.SimpleNamespace(model=model, image_size=16, lora_rank=rank, batch_size=2, steps=2, grad_checkpoint=1,
                                 device="cpu")
    found = step_figures(args)
    assert np.isfinite(found["loss"]) and found["step_s"] > 0
    assert (found["trainable"] < found["params"] / 4) if rank else found["trainable"] == found["params"]
