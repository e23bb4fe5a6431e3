"""Run configs as files (`--config run.toml` / `.yaml`): the same run as the flags, bit for bit; a run's own
config.yaml runs it again; flags override the file; every mistake in a file is one line naming the file."""
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from opendit import config as cfglib
from opendit.cli import parse_config
from tests.test_train import ROOT, run_trainer

FLAGS = ["--model", "DiT-debug", "--dataset", "digits", "--image_size", "8", "--batch_size", "16", "--max_steps", "4",
         "--log_every", "1", "--ckpt_every", "4", "--num_workers", "0", "--lr", "1e-3", "--ema_decay", "0.9"]
TOML = """
model = "DiT-debug"
[model_and_data]
dataset = "digits"
image_size = 8
num_workers = 0
[schedule]
batch_size = 16
max_steps = 4
[optimizer]
lr = 1e-3
[ema]
ema_decay = 0.9
[logging_and_validation]
log_every = 1
[checkpoints_and_resuming]
ckpt_every = 4
"""


def _weights(trainer):
    return load_file(trainer.run_dir / "checkpoints" / "step-000004" / "ema.safetensors")


def _parse(cls, argv):
    return parse_config(cls, None, argv)


def test_a_toml_run_and_its_config_yaml_train_what_the_flags_train_bitwise(tmp_path):
    (tmp_path / "run.toml").write_text(TOML)
    from_flags = _parse(cfglib.TrainConfig, [*FLAGS, "--outputs", str(tmp_path / "a")])
    from_file = _parse(cfglib.TrainConfig, ["--config", str(tmp_path / "run.toml"), "--outputs", str(tmp_path / "b")])
    assert from_file == cfglib.TrainConfig(**{**vars(from_flags), "outputs": str(tmp_path / "b")})
    flags_run, flags_losses = run_trainer(from_flags)
    file_run, file_losses = run_trainer(from_file)
    assert file_losses == flags_losses
    a, b = _weights(flags_run), _weights(file_run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the config.yaml a run writes (resolved values included) is a config file that runs it again
    again = _parse(cfglib.TrainConfig, ["--config", str(file_run.run_dir / "config.yaml"), "--outputs",
                                        str(tmp_path / "c")])
    again_run, again_losses = run_trainer(again)
    assert again_losses == flags_losses
    c = _weights(again_run)
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_flags_override_the_file_and_yaml_tables_are_mappings(tmp_path):
    (tmp_path / "run.yaml").write_text("model: DiT-debug\nschedule: {batch_size: 8, max_steps: 3}\n"
                                       "optimizer:\n  lr: 1e-4\n  weight_decay: 0\n")
    cfg = _parse(cfglib.TrainConfig, ["--config", str(tmp_path / "run.yaml"), "--max_steps", "9"])
    assert (cfg.model, cfg.batch_size, cfg.max_steps) == ("DiT-debug", 8, 9)
    assert cfg.lr == 1e-4 and isinstance(cfg.weight_decay, float)  # YAML's "1e-4" string and an int, as floats
    (tmp_path / "s.toml").write_text('ckpt = "x.safetensors"\n[sampling]\nprompts = ["a", "b"]\ncfg_scale = 4\n'
                                     '[step_caches]\ncache = "fbcache"\n')
    sample = _parse(cfglib.SampleConfig, ["--config", str(tmp_path / "s.toml"), "--seed", "3"])
    assert (sample.prompts, sample.cfg_scale, sample.cache, sample.seed) == (["a", "b"], 4.0, "fbcache", 3)
    (tmp_path / "p.toml").write_text('[data]\nfamily = "flux"\n[cache]\nout = "cache"\nshard_size = 16\n')
    cache = _parse(cfglib.PreprocessConfig, ["--config", str(tmp_path / "p.toml")])
    assert (cache.family, cache.out, cache.shard_size) == ("flux", "cache", 16)


@pytest.mark.parametrize("name, text, match", [
    ("run.toml", "[optimizer]\nlearning_rate = 1e-4\n", r"run.toml: \[optimizer\] learning_rate: no such option"),
    ("run.toml", "[optimizer]\nlrr = 1e-4\n", r"no such option; did you mean 'lr'\?"),
    ("run.toml", "[schedule]\nlr = 1e-4\n", r"\[schedule\] lr: lr belongs in \[optimizer\]"),
    ("run.toml", "[optimiser]\nlr = 1e-4\n", r"\[optimiser\]: no such table; did you mean 'optimizer'\?"),
    ("run.toml", 'max_steps = "10"\n', r"max_steps: '10' is a str; max_steps must be of type int"),
    ("run.toml", "lr = true\n", r"lr: True is a bool; lr must be of type float"),
    ("run.toml", 'plugin = "zero9"\n', r"plugin: 'zero9' is not one of: ddp, zero2"),
    ("run.toml", "model = \"DiT-debug\"\nmax_steps = = 3\n", r"run.toml: not valid TOML: .*line 2"),
    ("run.yaml", "model: DiT-debug\nschedule:\n  max_steps: [3\n", r"run.yaml: not valid YAML at line 4"),
    ("run.yaml", "- 1\n- 2\n", r"run.yaml: must hold a table of options"),
    ("run.json", "{}", r"run.json: a config file is .toml, .yaml or .yml"),
])
def test_a_bad_file_is_one_line_naming_file_key_and_fix(tmp_path, capsys, name, text, match):
    (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as stop:
        _parse(cfglib.TrainConfig, ["--config", str(tmp_path / name)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and re.search(match, err), err
    assert (tmp_path / name).read_text() == text  # the user's file is left as it was


def test_a_missing_config_file_or_a_folder_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _parse(cfglib.SampleConfig, ["--config", str(tmp_path / "nope.toml")])
    assert "nope.toml: no such config file" in capsys.readouterr().err
    (tmp_path / "run.toml").mkdir()
    with pytest.raises(SystemExit):
        _parse(cfglib.TrainConfig, ["--config", str(tmp_path / "run.toml")])
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "run.toml" in err and err.count("\n") == 1


def test_the_docs_example_trains_through_train_py(tmp_path):
    """docs/training.md's TOML example, as a user copies it, with flags overriding its length and folder."""
    doc = (ROOT / "docs" / "training.md").read_text()
    example = re.search(r"```toml\n(# digits.toml.*?)```", doc, re.S).group(1)
    (tmp_path / "digits.toml").write_text(example)
    out = subprocess.run([sys.executable, "train.py", "--config", str(tmp_path / "digits.toml"), "--max_steps", "2",
                          "--outputs", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    saved = cfglib.load_yaml(cfglib.TrainConfig, next((tmp_path / "out").iterdir()) / "config.yaml")
    assert (saved.model, saved.batch_size, saved.max_steps, saved.lr, saved.ema_decay, saved.sample_every) == \
        ("DiT-Ti/4", 64, 2, 1e-3, 0.995, 250)
