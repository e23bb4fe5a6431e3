"""--async_ckpt: checkpoints written in the background hold what a synchronous save holds, a resume from one
equals the uninterrupted run, and a kill during the background write leaves the previous checkpoint as the newest
complete one."""
import errno
import json
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file

from opendit.checkpoint import load_weights
from opendit.checkpoint.manifest import read_manifest
from tests.agents import DEBUG_ARGS, FAULT_TRAIN, ROOT, checkpoints, clean_env, losses
from tests.test_train import run_trainer, tiny_cfg


def _same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_background_checkpoints_equal_synchronous_ones_and_resume_exactly(tmp_path):
    _, full = run_trainer(tiny_cfg(tmp_path / "sync", max_steps=6, ckpt_every=3))
    trainer, background = run_trainer(tiny_cfg(tmp_path / "async", max_steps=6, ckpt_every=3, async_ckpt=True))
    assert background == full  # saving in the background changes nothing of the training
    assert trainer.last_checkpoint.endswith("step-000006")  # the end of the run waited for the last save
    for step in ("step-000003", "step-000006"):
        sync, bg = (tmp_path / kind / "000-DiT-debug" / "checkpoints" / step for kind in ("sync", "async"))
        assert read_manifest(str(bg)).keys() == read_manifest(str(sync)).keys()  # the same files, all listed
        for key in ("model", "ema"):  # (verified against the manifest as they are read)
            _same_tensors(load_weights(str(bg), key=key), load_weights(str(sync), key=key))
        _same_tensors(load_file(bg / "ema.safetensors"), load_file(sync / "ema.safetensors"))
        settings = [yaml.safe_load((d / "config.yaml").read_text()) for d in (bg, sync)]
        assert [{k: v for k, v in c.items() if k not in ("async_ckpt", "outputs")} for c in settings] == \
            [{k: v for k, v in settings[1].items() if k not in ("async_ckpt", "outputs")}] * 2
    _, resumed = run_trainer(tiny_cfg(tmp_path / "async", max_steps=6, ckpt_every=3, async_ckpt=True,
                                      load=str(tmp_path / "async" / "000-DiT-debug" / "checkpoints" / "step-000003")))
    assert resumed == full[3:]  # the optimizer states and RNGs were copied at step 3, not later


def test_a_kill_during_a_background_save_keeps_the_previous_checkpoint_and_resume_is_exact(tmp_path):
    args = [*DEBUG_ARGS, "--max_steps", "6", "--ckpt_every", "2", "--async_ckpt", "--load", "auto"]
    killed = subprocess.run([sys.executable, FAULT_TRAIN, *args, "--outputs", str(tmp_path / "killed")], cwd=ROOT,
                            capture_output=True, text=True, env=clean_env({"OPENDIT_FAULT": "killsaving:4:0"}),
                            timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    run = tmp_path / "killed" / "000-DiT-debug"
    assert checkpoints(tmp_path / "killed") == ["step-000002"]  # step 4's write was cut short
    assert (run / "checkpoints" / ".tmp-step-000004").is_dir()
    assert [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    texts = {}
    for outputs in ("killed", "whole"):
        out = subprocess.run([sys.executable, "train.py", *args, "--outputs", str(tmp_path / outputs)], cwd=ROOT,
                             capture_output=True, text=True, env=clean_env(), timeout=300)
        texts[outputs] = out.stdout + out.stderr
        assert out.returncode == 0, texts[outputs]
    assert "resuming from" in texts["killed"] and "step-000002" in texts["killed"], texts["killed"]
    steps = ["step-000002", "step-000004", "step-000006"]
    assert checkpoints(tmp_path / "killed") == checkpoints(tmp_path / "whole") == steps
    assert not (run / "checkpoints" / ".tmp-step-000004").exists()  # the leftover was cleared
    assert losses(tmp_path / "killed") == losses(tmp_path / "whole")


def _stalled_writes(monkeypatch, effect):
    from opendit.checkpoint.save import RecordingWriter

    write_data = RecordingWriter.write_data

    def stalled(self, plan, planner):
        effect()
        return write_data(self, plan, planner)
    monkeypatch.setattr(RecordingWriter, "write_data", stalled)


def test_the_step_may_change_the_weights_while_the_background_write_runs(tmp_path, monkeypatch):
    from opendit.checkpoint.async_save import AsyncCheckpointer

    _stalled_writes(monkeypatch, lambda: time.sleep(1.0))
    model = torch.nn.Linear(4, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    saver = AsyncCheckpointer()
    blocked = saver.save(str(tmp_path), 1, model)
    assert saver.in_flight and blocked < 1.0  # the call did not wait for the stalled write
    with torch.no_grad():  # the next optimizer step, while the write is stalled
        for p in model.parameters():
            p.add_(1.0)
    path = saver.wait()
    _same_tensors(load_weights(path, key="model"), before)  # what the save was asked for, not what came after
    assert saver.wait() is None and not saver.in_flight


def test_a_failed_background_write_is_raised_by_the_next_wait_and_commits_nothing(tmp_path, monkeypatch):
    from opendit.checkpoint.async_save import AsyncCheckpointer

    def full_disk():
        raise OSError(errno.ENOSPC, "No space left on device")
    _stalled_writes(monkeypatch, full_disk)
    saver = AsyncCheckpointer()
    saver.save(str(tmp_path), 1, torch.nn.Linear(4, 4))
    with pytest.raises(OSError, match="step-000001.*disk full"):
        saver.wait()
    assert not (tmp_path / "step-000001").exists()


def test_ckpt_blocking_benchmark_smoke(tmp_path):
    """benchmarks/ckpt_blocking.py on DiT-debug: a sync and an async row, the checkpoints removed after."""
    from tests.run_each import cli
    out = cli("benchmarks/ckpt_blocking.py", "--model", "DiT-debug", "--saves", "1", "--out", tmp_path / "ckpt")
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| sync", "| async"))]
    assert len(rows) == 2 and all(float(r.split("|")[3]) > 0 for r in rows), out.stdout
    assert "x shorter with --async_ckpt" in out.stdout, out.stdout
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
