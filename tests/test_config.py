"""Flags: derived from the config dataclasses (shared options and each family's) with help, defaults and the
registries' valid values; settings a cache or the data decide are never silently replaced. The flag reference
(docs/flags.md) is checked in tests/test_docs.py."""
import dataclasses
import os
import subprocess
import sys

import pytest

import tests.text_family  # noqa: F401  (registers the "shapes" family)
import tests.toy_family  # noqa: F401  (registers the "toy" family)
from opendit import config as cfglib
from opendit import shared_options
from opendit.options import help_of
from tests.test_train import ROOT


@pytest.mark.parametrize("script", ["train.py", "sample.py", "preprocess.py"])
def test_help_shows_sections_help_defaults_and_choices(script):
    # the same families on both sides: the built-in ones and the two tests/ defines (imported above)
    env = {**os.environ, "OPENDIT_FAMILIES": "tests.toy_family,tests.text_family", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    cls = {"train.py": cfglib.TrainConfig, "sample.py": cfglib.SampleConfig,
           "preprocess.py": cfglib.PreprocessConfig}[script]
    for f in dataclasses.fields(cls):  # every flag explains itself
        assert help_of(f), f"--{f.name} has no help text"
        assert " ".join(help_of(f).split())[:30] in text, f"--{f.name}'s help is not shown"
    for title in cls.SECTIONS.values():
        assert f"{title}:" in out.stdout
    if script == "train.py":
        assert "--plugin {ddp,zero2,zero3,fsdp,hsdp,gemini}" in text and "(default: ddp)" in text
        assert "one of: DiT-Ti/2" in text and "DiT-XL/2" in text and "--mixed_precision {fp32,bf16,fp16}" in text
    if script == "sample.py":
        # the defaults of steps, sampler and guidance are the model family's, and the help says which: each
        # family's own words (defaults_help), and the methods each model's parallel plan declares
        assert "--sampler {ddpm,ddim,euler,unipc}" in text and "DiT 250; video DiTs 250" in text
        assert "flux-schnell 4, other FLUX 50; Wan2.1 50" in text and "dsp (Latte)" in text
    if script == "preprocess.py":
        # more than 8 choices: listed in the help, NAME in the usage
        from opendit.families import FAMILIES
        assert "one of: " + ", ".join(n for n in FAMILIES if n not in ("toy", "shapes")) + ", toy, shapes" in text
        assert "--dtype {float32,float16}" in text


def test_choices_come_from_the_registries():
    from opendit.booster.plugins import PLUGINS
    from opendit.families import all_models

    parser = cfglib.build_parser(cfglib.TrainConfig, None)
    actions = {a.dest: a for a in parser._actions}
    assert actions["plugin"].choices == list(PLUGINS) and actions["model"].choices == list(all_models())
    with pytest.raises(SystemExit):
        parser.parse_args(["--plugin", "zero9"])


def test_explicit_num_classes_at_the_old_default_is_kept_for_a_folder(tmp_path):
    """--num_classes 10 given for 12 class folders is an error, not silently replaced; left out, it is 12."""
    from PIL import Image

    from tests.test_train import run_trainer, tiny_cfg

    for c in range(12):
        (tmp_path / "data" / f"c{c:02d}").mkdir(parents=True)
        Image.new("RGB", (8, 8), (c * 20, 0, 0)).save(tmp_path / "data" / f"c{c:02d}" / "a.png")
    common = dict(dataset="folder", data_path=str(tmp_path / "data"), batch_size=4, max_steps=1)
    with pytest.raises(ValueError, match="--num_classes 10 is fewer than the 12 classes"):
        run_trainer(tiny_cfg(tmp_path / "o", num_classes=10, **common))
    trainer, _ = run_trainer(tiny_cfg(tmp_path / "o", **common))
    assert trainer.cfg.num_classes == 12 and trainer.model.num_classes == 12
    saved = cfglib.load_yaml(cfglib.TrainConfig, trainer.run_dir / "config.yaml")
    assert saved.num_classes == 12 and saved.vae_scale == 0.18215 and saved.image_size == 8  # resolved values


def test_options_come_in_sections_and_shared_flags_are_declared_once():
    """train.py's and sample.py's options are named sections; the speed and sequence-parallel flags both scripts
    take are one declaration, so their help texts cannot drift apart."""
    train, sample = shared_options.TrainOptions, shared_options.SampleOptions
    assert {"model and data", "optimizer", "checkpoints and resuming", "parallelism", "speed"} <= \
        set(train.SECTIONS.values())
    for shared in (shared_options.SpeedOptions, shared_options.SequenceParallelOptions):
        for f in dataclasses.fields(shared):
            helps = [help_of(next(g for g in dataclasses.fields(cls) if g.name == f.name)) for cls in (train, sample)]
            assert helps[0] == helps[1] == help_of(f), f.name
