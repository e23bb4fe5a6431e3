"""End-to-end: train.py's Trainer and sample.py on the digits demo, in one process and under torchrun (the run folder,
bad input, latents through a VAE, sequence parallelism). DiT-debug's command-line run, exact resume and sampling: the
conformance table (tests/families/test_conformance.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image

from opendit import config as cfglib

ROOT = Path(__file__).resolve().parents[1]


def tiny_cfg(outputs, **kw):
    base = dict(model="DiT-debug", dataset="digits", image_size=8, batch_size=16, max_steps=6, log_every=1,
                ckpt_every=100, num_workers=0, outputs=str(outputs), lr=1e-3, ema_decay=0.9)
    return cfglib.TrainConfig(**{**base, **kw})


def run_trainer(cfg):
    from opendit.training.loop import Trainer

    try:
        trainer = Trainer(cfg)
        return trainer, trainer.train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_loss_is_finite_and_falls(tmp_path):
    _, losses = run_trainer(tiny_cfg(tmp_path, max_steps=40, log_every=10, lr=2e-3))
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0], losses


def test_run_folder_holds_config_log_tensorboard_and_checkpoints(tmp_path):
    trainer, _ = run_trainer(tiny_cfg(tmp_path, max_steps=4, ckpt_every=2, keep_last=1))
    run = trainer.run_dir
    assert run.name == "000-DiT-debug"
    assert cfglib.load_yaml(cfglib.TrainConfig, run / "config.yaml").max_steps == 4
    assert any((run / "tensorboard").iterdir())
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000004"]  # keep_last=1
    assert (run / "checkpoints" / "step-000004" / "ema.safetensors").is_file()


@pytest.mark.parametrize("overrides, match", [
    (dict(model="DiT-XXL/2"), "valid names: .*DiT-S/2"),
    (dict(image_size=9), "multiple of patch size"),
    (dict(dataset="folder", data_path=None), "--data_path"),
    (dict(dataset="folder", data_path="/nonexistent/imagenet"), "/nonexistent/imagenet"),
    (dict(dataset="cifar"), "valid names: digits, folder"),
    (dict(plugin="zero9"), "zero2"),
    (dict(dp_replicate=2), "dp_replicate"),
    (dict(batch_size=10, grad_accum=4), "divisible"),
])
def test_bad_input_gives_clear_error(tmp_path, overrides, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        run_trainer(tiny_cfg(tmp_path, **overrides))


def save_tiny_vae(folder, latent_channels: int = 4):
    """A 4-level AutoencoderKL (8x downsampling; 4 latent channels like SD's VAE, 16 like FLUX's) with 8-wide
    layers."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                  block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=latent_channels,
                  norm_num_groups=8, sample_size=32).save_pretrained(folder)
    return str(folder)


def test_vae_image_size_must_be_multiple_of_its_downsampling_times_patch(tmp_path):
    from opendit.encoders import load_vae
    from opendit.families.latent import latent_geometry

    vae = load_vae(save_tiny_vae(tmp_path / "vae"))
    assert latent_geometry(256, vae, 3, 2) == (32, 4)
    assert latent_geometry(16, None, 1, 2) == (16, 1)
    with pytest.raises(ValueError, match="8 \\(the VAE's downsampling\\) x patch size = 16"):
        latent_geometry(72, vae, 3, 2)


def test_latent_training_then_sampling_through_a_local_vae(tmp_path):
    """--vae <local folder>: digits become RGB, the DiT trains on 4x4x4 latents, samples decode to 32px RGB."""
    from opendit.config import SampleConfig
    from opendit.inference import complete_sample_config, load_model

    vae_dir = save_tiny_vae(tmp_path / "vae")
    trainer, losses = run_trainer(tiny_cfg(tmp_path / "out", image_size=32, vae=vae_dir, max_steps=3))
    assert trainer.dataset.channels == 3 and all(np.isfinite(losses))
    cfg = SampleConfig(ckpt="latest", outputs=str(tmp_path / "out"), num_sampling_steps=3, cfg_scale=2.0)
    loaded = load_model(cfg, torch.device("cpu"))
    assert (loaded.model.input_size, loaded.model.in_channels, loaded.cfg.vae) == (4, 4, vae_dir)
    family = loaded.family
    cfg = complete_sample_config(family, cfg, loaded.cfg)
    images = family.sample_batch(loaded, family.make_sampler(cfg, loaded.cfg), range(0, 2), [0, 1], cfg,
                                 torch.device("cpu"))
    assert images.shape == (2, 32, 32, 3) and images.dtype == np.uint8


def _run(args, nproc=1, env=None):
    cmd = [sys.executable, *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@pytest.mark.slow
def test_torchrun_two_processes_then_sample_one_and_two_processes_agree(tmp_path):
    _run(["train.py", "--model", "DiT-debug", "--image_size", "8", "--batch_size", "8", "--max_steps", "3",
          "--log_every", "1", "--num_workers", "0", "--outputs", str(tmp_path / "out")], nproc=2)
    ckpt = tmp_path / "out" / "000-DiT-debug" / "checkpoints" / "step-000003"
    assert (ckpt / "ema.safetensors").is_file()
    common = ["sample.py", "--ckpt", str(ckpt), "--num_sampling_steps", "5", "--num_samples", "6",
              "--batch_size", "2", "--cfg_scale", "2", "--npz"]
    one = _run([*common, "--out", str(tmp_path / "s1")])
    two = _run([*common, "--out", str(tmp_path / "s2")], nproc=2)
    # a progress bar over the denoising steps of each batch, on rank 0 only (3 batches, then 2 of each rank)
    assert one.stderr.count("sampling: 100%") == 3 and two.stderr.count("sampling: 100%") == 2, two.stderr
    for i in range(6):
        a = np.asarray(Image.open(tmp_path / "s1" / "images" / f"{i:06d}.png"))
        b = np.asarray(Image.open(tmp_path / "s2" / "images" / f"{i:06d}.png"))
        assert np.array_equal(a, b), f"sample {i} differs between 1 and 2 processes"
    _run([*common, "--out", str(tmp_path / "s3"), "--sequence_parallel_size", "2"], nproc=2)
    for i in range(6):  # sequence parallel sampling: same images up to rounding of the split reductions
        a = np.asarray(Image.open(tmp_path / "s1" / "images" / f"{i:06d}.png")).astype(int)
        c = np.asarray(Image.open(tmp_path / "s3" / "images" / f"{i:06d}.png")).astype(int)
        assert np.abs(a - c).max() <= 1, f"sample {i}: SP differs by {np.abs(a - c).max()} levels"
    arr = np.load(tmp_path / "s1" / "samples.npz")["arr_0"]
    assert arr.shape == (6, 8, 8, 3) and arr.dtype == np.uint8
    assert (tmp_path / "s1" / "grid.png").is_file()


def _logged_losses(outputs):
    log = Path(outputs) / "000-DiT-debug" / "log.jsonl"
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


SP_PLUGINS = ["ddp", "zero2"]


@pytest.fixture(scope="module")
def sp_runs(tmp_path_factory):
    """train.py with each SP_PLUGINS plugin in one process (in the test's) and at 2 SP ranks (all plugins in one
    torchrun launch) -> the outputs root holding <plugin>/one and <plugin>/sp."""
    from tests.run_each import run_each, run_here

    root = tmp_path_factory.mktemp("sp_train")
    args = {p: ["--model", "DiT-debug", "--image_size", "8", "--batch_size", "8", "--max_steps", "3", "--log_every",
                "1", "--num_workers", "0", "--plugin", p] for p in SP_PLUGINS}
    for p in SP_PLUGINS:
        run_here("train.py", *args[p], "--outputs", root / p / "one")
    run_each("train.py", [[*args[p], "--outputs", root / p / "sp", "--sequence_parallel_size", "2"]
                          for p in SP_PLUGINS], nproc=2)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("plugin", SP_PLUGINS)
def test_torchrun_sequence_parallel_training_equals_one_process(sp_runs, plugin):
    np.testing.assert_allclose(_logged_losses(sp_runs / plugin / "sp"), _logged_losses(sp_runs / plugin / "one"),
                               rtol=1e-5)
