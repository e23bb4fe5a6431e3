"""The proof that a family is one folder (tests/bars_family/): a small text-to-video family with its own model,
VAE-like encoder, text encoder, dataset and option runs through the unchanged train.py (previews as clips),
torchrun with sequence parallelism (losses equal to one process's), a LoRA on its trained weights, sample.py
(--prompt, clips) and preprocess.py (its posteriors and text vectors cached, then trained on). Adding it touched
no file outside its folder but this test; nothing in opendit/ names it."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.test_train import ROOT

ENV = {**os.environ, "OPENDIT_FAMILIES": "tests.bars_family", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
TRAIN = ["--model", "Bars-S", "--text_width", "8", "--num_frames", "4", "--batch_size", "8", "--lr", "1e-3",
         "--log_every", "1", "--num_workers", "0"]


def run(*args, torchrun: int = 0) -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"] \
        if torchrun else [sys.executable]
    out = subprocess.run([*launch, *map(str, args)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def losses(run_dir) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r.get("kind", "train") == "train" and "loss" in r]


def test_nothing_in_opendit_names_the_family():
    names = ("bars_family", "Bars-S", "BarsFamily", "moving_bars")
    found = [str(p) for p in (ROOT / "opendit").rglob("*.py") if any(n in p.read_text() for n in names)]
    assert not found, f"opendit names the test family in {found}"


@pytest.mark.slow
def test_a_video_family_folder_trains_with_sp_and_lora_samples_and_caches(tmp_path):
    plain, split = tmp_path / "plain", tmp_path / "sp"
    run("train.py", *TRAIN, "--dataset", "moving_bars", "--max_steps", "3", "--ckpt_every", "3",
        "--sample_every", "3", "--preview_steps", "2", "--outputs", plain)
    run_dir = plain / "000-Bars-S"
    assert (run_dir / "previews" / "step-000003.gif").is_file()  # clips: the family's writer animates the grid
    run("train.py", *TRAIN, "--dataset", "moving_bars", "--max_steps", "3", "--sequence_parallel_size", "2",
        "--outputs", split, torchrun=2)
    assert np.allclose(losses(split / "000-Bars-S"), losses(run_dir), rtol=1e-5, atol=1e-6)

    lora = tmp_path / "lora"
    run("train.py", *TRAIN, "--dataset", "moving_bars", "--max_steps", "2", "--ckpt_every", "2", "--lora_rank", "2",
        "--init_weights", run_dir / "checkpoints" / "step-000003" / "ema.safetensors", "--outputs", lora)
    assert len(losses(lora / "000-Bars-S")) == 2

    samples = tmp_path / "samples"
    run("sample.py", "--ckpt", "latest", "--outputs", lora, "--prompt", "a bar moving left", "a bar moving up",
        "--num_samples", "2", "--num_sampling_steps", "3", "--cfg_scale", "2", "--npz", "--out", samples)
    clips = np.load(samples / "samples.npz")["arr_0"]
    assert clips.shape == (2, 4, 8, 8, 3) and clips.dtype == np.uint8 and (samples / "grid.gif").is_file()

    cache, cached = tmp_path / "cache", tmp_path / "cached"
    run("preprocess.py", "--family", "bars", "--dataset", "moving_bars", "--image_size", "8", "--num_frames", "4",
        "--text_width", "8", "--batch_size", "8", "--num_workers", "0", "--out", cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    assert (manifest["text_width"], manifest["num_frames"], manifest["embeddings"]) == (8, 4, ["letters"])
    run("train.py", "--model", "Bars-S", "--dataset", "latents", "--data_path", cache, "--batch_size", "8",
        "--max_steps", "2", "--log_every", "1", "--num_workers", "0", "--outputs", cached)
    assert len(losses(cached / "000-Bars-S")) == 2
