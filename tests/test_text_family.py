"""The seam, as a user would extend it: a family defined in tests/ (tests/text_family.py) with its own option,
dataset, text encoder and prompts plugs in through OPENDIT_FAMILIES and runs through the unchanged train.py
(validation, prompt previews, exact resume), sample.py (--prompt) and preprocess.py (its embeddings cached, then
trained on)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml
from PIL import Image

import tests.text_family  # registers the "shapes" family in this process too
from opendit import config as cfglib
from tests.test_train import ROOT

ENV = {**os.environ, "OPENDIT_FAMILIES": "tests.text_family", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
TRAIN = ["--model", "Shapes-S", "--word_dim", "8", "--batch_size", "16", "--lr", "1e-3", "--log_every", "1",
         "--num_workers", "0"]


def run(script: str, *args, status: int = 0) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, script, *map(str, args)], cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == status, out.stderr[-3000:]
    return out


def losses(run_dir, kind: str = "train") -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    key = "loss" if kind == "train" else "val_loss"
    return [(r["step"], r[key]) for r in records if r.get("kind", "train") == kind and key in r]


def test_its_option_and_dataset_join_the_flags():
    text = " ".join(cfglib.build_parser(cfglib.TrainConfig, None).format_help().split())  # argparse's wrapping undone
    assert "shapes family options:" in text and "--word_dim" in text and "shapes: built in: 8x8 grey bars" in text
    family = tests.text_family.ShapesFamily()
    assert family.resolve_config(cfglib.TrainConfig(model="Shapes-S", dataset="shapes")).word_dim == 16
    with pytest.raises(ValueError, match="--word_dim 0: must be an integer > 0"):
        cfglib.check_config(cfglib.TrainConfig(model="Shapes-S", dataset="shapes", word_dim=0))
    # a run records the shared options and its own family's only: a process without this module reads a DiT run
    dit, shapes = (cfglib.run_record(cfglib.TrainConfig(model=m)) for m in ("DiT-S/2", "Shapes-S"))
    assert "learn_sigma" in dit and "word_dim" not in dit and "t5" not in dit
    assert "word_dim" in shapes and "t5" not in shapes and set(dit) < set(shapes)


@pytest.mark.slow
def test_a_family_from_outside_trains_resumes_samples_and_caches_through_the_entry_points(tmp_path):
    out = tmp_path / "runs"
    run("train.py", *TRAIN, "--dataset", "shapes", "--max_steps", "4", "--ckpt_every", "2", "--val_every", "2",
        "--val_samples", "8", "--sample_every", "4", "--preview_steps", "2", "--outputs", out)
    run_dir = out / "000-Shapes-S"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["word_dim"] == 8
    full = losses(run_dir)
    assert [s for s, _ in full] == [1, 2, 3, 4] and [s for s, _ in losses(run_dir, "val")] == [2, 4]
    grid = np.asarray(Image.open(run_dir / "previews" / "step-000004.png"))
    assert grid.shape == (2 + 4 * 66, 2 + 2 * 66, 3)  # a row per prompt (4), 2 samples of each, 8 px -> 64 px

    # resumed from step 2 (in the same run folder): steps 3 and 4 repeat exactly
    run("train.py", *TRAIN, "--dataset", "shapes", "--max_steps", "4", "--ckpt_every", "2", "--val_every", "2",
        "--val_samples", "8", "--outputs", out, "--load", run_dir / "checkpoints" / "step-000002")
    assert losses(run_dir)[4:] == full[2:]

    samples = tmp_path / "samples"
    run("sample.py", "--ckpt", "latest", "--outputs", out, "--prompt", "a vertical bar on the left",
        "a horizontal bar at the top", "--num_samples", "4", "--num_sampling_steps", "3", "--npz", "--out", samples)
    images = np.load(samples / "samples.npz")["arr_0"]
    assert images.shape == (4, 8, 8, 3) and images.dtype == np.uint8 and (samples / "grid.png").is_file()

    cache = tmp_path / "cache"
    run("preprocess.py", "--family", "shapes", "--dataset", "shapes", "--image_size", "8", "--vae", "none",
        "--word_dim", "8", "--batch_size", "16", "--num_workers", "0", "--out", cache)
    manifest = json.loads((cache / "manifest.json").read_text())
    assert (manifest["word_dim"], manifest["embeddings"], manifest["count"]) == (8, ["words"], 64)
    cached = tmp_path / "cached"
    run("train.py", "--model", "Shapes-S", "--dataset", "latents", "--data_path", cache, "--batch_size", "16",
        "--max_steps", "2", "--log_every", "1", "--num_workers", "0", "--outputs", cached)
    record = yaml.safe_load((cached / "000-Shapes-S" / "config.yaml").read_text())
    assert record["word_dim"] is None and record["decided"]["word_dim"] == 8  # the cache's, not an option given
    assert [s for s, _ in losses(cached / "000-Shapes-S")] == [1, 2]
    wrong = run("train.py", "--model", "Shapes-S", "--dataset", "latents", "--data_path", cache, "--word_dim", "16",
                "--max_steps", "1", "--outputs", cached, status=2)
    assert "--word_dim 16 disagrees with the latent cache" in wrong.stderr
