"""sample.py's --ckpt: what is not a checkpoint, or a checkpoint with a corrupt piece, is a clear error naming the
file and the fix (never a raw unpickler or safetensors traceback); a step folder's settings come from its
config.yaml, else its ema.json, else the config kept in trainer.pt."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from opendit.checkpoint import CheckpointCorruptError
from opendit.config import SampleConfig
from opendit.inference import load_model
from tests.test_train import ROOT, run_trainer, tiny_cfg

CPU = torch.device("cpu")
FLAGS = dict(model="DiT-debug", image_size=8, num_classes=10)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    run_trainer(tiny_cfg(out, max_steps=1))
    return next((out / "000-DiT-debug" / "checkpoints").glob("step-*"))


@pytest.fixture
def step(trained, tmp_path):
    """A fresh copy of the trained step folder (runs/000-x/checkpoints/step-000001), free to damage."""
    copy = tmp_path / "000-DiT-debug" / "checkpoints" / trained.name
    shutil.copytree(trained, copy)
    return copy


def load(ckpt, **flags):
    return load_model(SampleConfig(ckpt=str(ckpt), **flags), CPU)


@pytest.mark.parametrize("flags", [{}, FLAGS])
def test_a_file_that_is_not_a_checkpoint_says_so_and_lists_what_is_accepted(tmp_path, flags):
    notes = tmp_path / "notes.txt"
    notes.write_text("remember to sample at cfg 4\n")
    with pytest.raises(ValueError, match=r"notes.txt' is not a checkpoint .*\.safetensors.*step-XXXXXX.*official DiT "
                                         r"\.pt.*diffusers DiT folder.*official Latte \.pt.*flux1-dev"):
        load(notes, **flags)


@pytest.mark.parametrize("name", ["empty.pt", "empty.safetensors", "empty"])
def test_an_empty_file_is_named(tmp_path, name):
    (tmp_path / name).write_bytes(b"")
    with pytest.raises(CheckpointCorruptError, match=rf"{name}' is empty \(0 bytes"):
        load(tmp_path / name, **FLAGS)


def test_a_missing_path_and_a_folder_that_is_not_a_checkpoint(tmp_path, step):
    with pytest.raises(FileNotFoundError, match="no/such/ema.safetensors' does not exist; pass an EMA export"):
        load("no/such/ema.safetensors")
    (tmp_path / "pictures").mkdir()
    (tmp_path / "pictures" / "cat.png").write_bytes(b"\x89PNG")
    with pytest.raises(ValueError, match=r"pictures' is a folder but not a checkpoint.*cat.png.*Accepted"):
        load(tmp_path / "pictures")
    run_folder = step.parent.parent  # a run folder: the error points at its newest step folder
    with pytest.raises(ValueError, match=rf"not a checkpoint.*pass one, e.g. .*{step.name}"):
        load(run_folder)


def test_a_corrupt_ema_export_in_a_step_folder_names_it_and_the_fix(step):
    with open(step / "ema.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(step / "ema.safetensors") // 2)
    with pytest.raises(CheckpointCorruptError, match=r"ema.safetensors has \d+ bytes, the manifest says \d+.*delete "
                                                     r"it to sample from the step folder's own shards"):
        load(step)
    os.remove(step / "ema.safetensors")  # the fix: the same EMA weights from the DCP shards
    assert load(step).model.input_size == 8


def test_a_corrupt_standalone_export_is_a_clear_error(step, tmp_path):
    export = tmp_path / "ema.safetensors"
    data = (step / "ema.safetensors").read_bytes()
    export.write_bytes(data[: len(data) // 2])  # truncated copy, no manifest beside it
    shutil.copy(step / "ema.json", tmp_path / "ema.json")
    with pytest.raises(CheckpointCorruptError, match=r"ema.safetensors is not a readable safetensors file.*truncated"):
        load(export)
    export.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!garbage!" + data[24:])  # a bad header
    with pytest.raises(CheckpointCorruptError, match=r"ema.safetensors is not a readable safetensors file"):
        load(export)


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\xfa", b"[1, 2, 3]"])
def test_a_corrupt_ema_json_sidecar_is_named(step, tmp_path, content):
    shutil.copy(step / "ema.safetensors", tmp_path / "ema.safetensors")
    (tmp_path / "ema.json").write_bytes(content)
    with pytest.raises(CheckpointCorruptError, match=r"ema.json \(the settings written beside an EMA export\) is "
                                                     r"corrupt.*pass --model"):
        load(tmp_path / "ema.safetensors")
    os.remove(step / "config.yaml")  # in a step folder, ema.json is read when config.yaml is absent
    (step / "ema.json").write_bytes(content)
    with pytest.raises(CheckpointCorruptError, match="ema.json"):
        load(step)


@pytest.mark.parametrize("content", [b"model: [unclosed", b"\xff\xfe\xfa binary", b"just some words",
                                     b"no_such_option: 3\n"])
def test_a_corrupt_config_yaml_is_named(step, content):
    (step / "config.yaml").write_bytes(content)
    with pytest.raises(CheckpointCorruptError, match=r"config.yaml is not a readable training config.*copy it from "
                                                     r"the run folder"):
        load(step)


def test_a_step_folder_without_config_yaml_takes_ema_json_then_trainer_pt(step):
    os.remove(step / "config.yaml")  # before: "cannot tell the model", ema.json beside it was ignored
    loaded = load(step)
    assert loaded.cfg.model == "DiT-debug" and loaded.model.num_classes == 10
    os.remove(step / "ema.json")  # then the config train.py keeps in trainer.pt's extra
    assert load(step).cfg.model == "DiT-debug"


def test_a_corrupt_step_folder_read_through_its_shards_is_named(step):
    os.remove(step / "ema.safetensors")
    with open(step / "meta.json", "wb") as f:
        f.write(b"{broken")
    with pytest.raises(CheckpointCorruptError, match="meta.json"):
        load(step)


def test_sample_py_on_notes_txt_is_one_clear_line(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("e" * 64)  # a text file starting with 'e': the unpickler once read it as opcode 101
    out = subprocess.run([sys.executable, "sample.py", "--ckpt", str(notes), "--model", "DiT-debug", "--image_size",
                          "8", "--num_classes", "10", "--out", str(tmp_path / "s")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode != 0
    assert "notes.txt' is not a checkpoint" in out.stderr and "KeyError" not in out.stderr, out.stderr[-3000:]
