"""train_video.sh's recipes: each one's command line parses into a TrainConfig with the values the recipe names
(a flag renamed or mistyped fails here, not on a user's GPU) and, where it trains a Wan2.2 expert, fills in that
expert's folder."""
import os
import subprocess

import pytest

from opendit import config as cfglib
from opendit.cli import parse_config
from opendit.families import family_of
from tests.test_train import ROOT

RECIPES = {
    "wan_digits": {}, "wan22_i2v_digits": {}, "moving_digits": {},
    "wan_t2v_1_3b": dict(WAN="/models/wan", DATA="/data/clips.csv"),
    "wan22_ti2v_5b": dict(WAN="/models/ti2v", DATA="/data/clips.csv"),
    "wan22_a14b_expert": dict(WAN="/models/a14b", EXPERT="low", DATA="/data/clips.csv", NGPU="8"),
    "ucf101": dict(DATA="/data/ucf101.csv"),
}


def recipe_args(tmp_path, recipe: str, env: dict) -> list[str]:
    """The arguments train_video.sh passes on (python and torchrun replaced by a stub that prints them)."""
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    for name in ("python", "torchrun"):
        (stub / name).write_text('#!/bin/sh\n[ "$1" = -m ] && exit 0\nprintf "%s\\n" "$@"\n')
        (stub / name).chmod(0o755)
    out = subprocess.run(["bash", "train_video.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "RECIPE": recipe,
                              "ENC": str(tmp_path / "enc"), **env})
    assert out.returncode == 0, out.stderr
    args = out.stdout.splitlines()
    return args[args.index("train.py") + 1:]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_each_recipe_parses(tmp_path, recipe):
    cfg = parse_config(cfglib.TrainConfig, None, recipe_args(tmp_path, recipe, RECIPES[recipe]))
    assert family_of(cfg.model).models[cfg.model]  # a registered model
    if recipe == "wan22_i2v_digits":
        assert cfg.model == "Wan2.2-I2V-debug" and cfg.vae == "none"
    if recipe == "wan22_a14b_expert":
        assert (cfg.model, cfg.expert, cfg.plugin, cfg.sequence_parallel_size) == ("Wan2.2-I2V-A14B", "low", "zero3", 4)
    if recipe == "wan22_ti2v_5b":
        assert cfg.model == "Wan2.2-TI2V-5B" and cfg.num_frames % 4 == 1 and cfg.image_size % 32 == 0
