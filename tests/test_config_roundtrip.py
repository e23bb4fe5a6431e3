"""What a run records is a --config that runs it again, for every registered family's debug model: train.py's
config.yaml trains the same losses and weights bit for bit, sample.py's (beside its samples) samples the same
pixels, preprocess.py's (in its cache) writes the same cache. What the data decided (a captioned set's 0 classes, a
family's default scale) sits apart in the file's `decided` table, which the rerun decides again and sample.py reads."""
import hashlib
import json

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from opendit import config as cfglib
from tests.run_each import losses_of, run_here
from opendit.families import FAMILIES
from tests.families.test_conformance import cached_families
from tests.families.tiny_vaes import VAE_WRITERS
from tests.test_streaming_families import TABLE


def _sd_vae(root, channels=4):
    from tests.test_train import save_tiny_vae
    return save_tiny_vae(root / "vae", channels)


def _flux_vae(root):
    from tests.test_zimage_family import save_tiny_flux_vae
    return save_tiny_flux_vae(root / "vae")


def _flux2_vae(root):
    from tests.test_flux2_family import save_tiny_flux2_vae
    return save_tiny_flux2_vae(root / "vae")


def _qwen_vae(root):
    from tests.test_qwenimage_family import save_tiny_qwen_vae
    return save_tiny_qwen_vae(root / "vae")


def _wan_vae(root):
    from opendit.families.wan.vae import save_tiny_wan_vae
    return save_tiny_wan_vae(root / "vae")


def _video_vae(root):
    from tests.test_hunyuanvideo15_family import save_tiny_video_vae
    return save_tiny_video_vae(root / "vae")


# family -> (its VAE written under a folder, the cache's image size, frames of a clip)
CACHES = {"dit": (_sd_vae, 16, None), "video": (_sd_vae, 16, 3), "flux": (lambda root: _sd_vae(root, 16), 16, None),
          "flux1": (_flux_vae, 16, None), "zimage": (_flux_vae, 16, None), "flux2": (_flux2_vae, 16, None),
          "qwenimage": (_qwen_vae, 16, None), "wan": (_wan_vae, 32, 5), "wan21": (_wan_vae, 32, 5),
          "hunyuanvideo15": (_video_vae, 32, 5)}
# the other families of the diffusers kind: those whose VAE class has a tiny writer (tests/families/tiny_vaes.py)
for _family in cached_families():
    CACHES.setdefault(_family, (lambda root, f=_family: VAE_WRITERS[FAMILIES[f].glue.vae_class](root / "vae"), 16,
                                None))
# families whose VAE class has no tiny writer there yet: their config round trip runs, their cache's does not
UNCACHED = {f for f in TABLE if f not in CACHES}


def _data(family: str) -> str:
    return "moving_digits" if TABLE[family][3] else "digits" if family == "dit" else "captioned_digits"


def _flags(settings: dict) -> list:
    return [word for key, value in settings.items() for word in (f"--{key}", value)]


def test_every_registered_family_is_in_the_tables():
    assert set(CACHES) <= set(TABLE)  # TABLE's own test keeps it equal to the registry
    assert UNCACHED <= {f for f in FAMILIES if hasattr(FAMILIES[f], "glue")}  # every other family's cache is tested


@pytest.mark.parametrize("family", sorted(TABLE))
def test_train_and_sample_config_yaml_rerun_their_runs_bitwise(tmp_path, family):
    model, encoders, settings, _ = TABLE[family]
    run_here("train.py", "--model", model, "--dataset", _data(family), *_flags({**encoders(tmp_path), **settings}),
             "--batch_size", 4, "--max_steps", 2, "--ckpt_every", 2, "--log_every", 1, "--num_workers", 0,
             "--lr", 1e-3, "--ema_decay", 0.9, "--outputs", tmp_path / "a")
    first = next((tmp_path / "a").iterdir())
    record = yaml.safe_load((first / "config.yaml").read_text())
    assert record["model"] == model and record["max_steps"] == 2
    classes = 10 if family in ("dit", "video") else 0  # labelled digits, or captions
    assert record["num_classes"] == (classes or None), "a value the data decided among the options"
    run_here("train.py", "--config", first / "config.yaml", "--outputs", tmp_path / "b")
    again = next((tmp_path / "b").iterdir())
    assert losses_of(again) == losses_of(first)
    weights = [load_file(run / "checkpoints" / "step-000002" / "ema.safetensors") for run in (first, again)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    # sample.py reads the decided values: a captioned family's checkpoint says 0 classes
    step = first / "checkpoints" / "step-000002"
    assert cfglib.load_yaml(cfglib.TrainConfig, step / "config.yaml").num_classes == classes

    prompts = [] if classes else ["--prompts", "a handwritten seven"]
    run_here("sample.py", "--ckpt", step, "--num_samples", 2, "--num_sampling_steps", 2, "--npz", *prompts,
             "--out", tmp_path / "s1")
    run_here("sample.py", "--config", tmp_path / "s1" / "config.yaml", "--out", tmp_path / "s2")
    a, b = (np.load(tmp_path / out / "samples.npz")["arr_0"] for out in ("s1", "s2"))
    assert np.array_equal(a, b)


def _digests(folder) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "config.yaml"}


@pytest.mark.parametrize("family", sorted(CACHES))
def test_preprocess_config_yaml_writes_the_same_cache(tmp_path, family):
    model, encoders, _, _ = TABLE[family]
    write_vae, size, frames = CACHES[family]
    clip = ["--num_frames", frames] if frames else []
    run_here("preprocess.py", "--family", family, "--model", model, "--dataset", _data(family), "--image_size", size,
             *clip, "--vae", write_vae(tmp_path), *_flags(encoders(tmp_path)), "--batch_size", 256,
             "--num_workers", 0, "--out", tmp_path / "c1")
    record = yaml.safe_load((tmp_path / "c1" / "config.yaml").read_text())
    assert record["family"] == family and record["image_size"] == size
    run_here("preprocess.py", "--config", tmp_path / "c1" / "config.yaml", "--out", tmp_path / "c2")
    assert _digests(tmp_path / "c1") == _digests(tmp_path / "c2")
    assert json.loads((tmp_path / "c2" / "manifest.json").read_text())["count"] > 0


def test_a_memory_budget_run_records_the_planned_options_and_leaves_the_rest_to_the_data(tmp_path):
    common = ["--model", "DiT-debug", "--dataset", "digits", "--image_size", 8, "--batch_size", 16, "--max_steps", 1,
              "--num_workers", 0]
    run_here("train.py", *common, "--memory_budget", "4,8", "--outputs", tmp_path / "a")
    record = yaml.safe_load(next((tmp_path / "a").glob("*/config.yaml")).read_text())
    # before: the planner's stand-in class count (ImageNet's 1000) was recorded, and trained, as a choice
    assert record["num_classes"] is None and record["decided"]["num_classes"] == 10
    assert record["memory_budget"] == "4,8"
