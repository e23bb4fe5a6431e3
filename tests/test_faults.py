"""Faults during training: a non-finite step, preemption signals, a killed rank under torchrun --max-restarts, a
hung peer. Faults are injected by tests/fault_train.py (train.py with one step patched); see docs/reliability.md."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from opendit.training.guard import NonFiniteTrainingError
from opendit.training.loop import Trainer
from tests.fault_train import faulty_train_step
from tests.test_train import ROOT, run_trainer, tiny_cfg

FAULT_TRAIN = str(ROOT / "tests" / "fault_train.py")
DEBUG_ARGS = ["--model", "DiT-debug", "--image_size", "8", "--batch_size", "8", "--log_every", "1",
              "--num_workers", "0", "--lr", "1e-3", "--ema_decay", "0.9"]


def _state(trainer):
    """Everything a step may change: weights, optimizer states, EMA, lr schedule, as comparable tensors."""
    optim = trainer.optimizer.state_dict()["state"]
    return {"model": trainer.model.state_dict(), "ema": trainer.ema.state_dict(),
            "optim": {(k, n): v for k, s in optim.items() for n, v in s.items()},
            "sched": trainer.scheduler.last_epoch}


def _assert_same(a, b):
    assert a["sched"] == b["sched"]
    for part in ("model", "ema", "optim"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            assert torch.equal(torch.as_tensor(a[part][k]), torch.as_tensor(b[part][k])), (part, k)


@pytest.mark.parametrize("options", [{}, dict(grad_clip=1.0), dict(optimizer_offload=True, fused_backward=True)])
def test_a_non_finite_step_is_skipped_and_changes_nothing(tmp_path, monkeypatch, options):
    reference, _ = run_trainer(tiny_cfg(tmp_path / "ref", max_steps=2, **options))
    monkeypatch.setattr(Trainer, "train_step", faulty_train_step("nan:3"))
    faulty, losses = run_trainer(tiny_cfg(tmp_path / "nan", max_steps=3, **options))
    _assert_same(_state(faulty), _state(reference))  # step 3 was NaN: the state is step 2's
    records = [json.loads(line) for line in (faulty.run_dir / "log.jsonl").read_text().splitlines()]
    assert [r["bad_steps"] for r in records] == [0, 0, 1]
    assert losses[:2] == _losses(reference.run_dir) and losses[2] != losses[2]  # the bad step logs NaN


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "log.jsonl").read_text().splitlines()]


def test_training_goes_on_after_a_bad_step_and_stops_after_max_bad_steps_in_a_row(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "train_step", faulty_train_step("nan:2,5-99"))
    # the checkpoint of step 6 holds step 4's weights: bad steps change nothing
    with pytest.raises(NonFiniteTrainingError, match=r"stopped at step 7: 3 steps in a row .*--max_bad_steps 3.*"
                                                     r"step-000006"):
        run_trainer(tiny_cfg(tmp_path, max_steps=20, ckpt_every=2, max_bad_steps=3))


def test_max_bad_steps_0_turns_the_check_off(tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "train_step", faulty_train_step("nan:2"))
    trainer, _ = run_trainer(tiny_cfg(tmp_path, max_steps=3, max_bad_steps=0))
    assert not all(torch.isfinite(p).all() for p in trainer.model.parameters())  # the NaN step went through


def _launch(args, nproc=1, env=None, **kw):
    cmd = [sys.executable, *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, **kw)


def _finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def test_a_run_stopped_by_non_finite_steps_ends_with_one_error_line(tmp_path):
    code, text = _finish(_launch([FAULT_TRAIN, *DEBUG_ARGS, "--max_steps", "20", "--ckpt_every", "2",
                                  "--max_bad_steps", "2", "--outputs", str(tmp_path)],
                                 env={"OPENDIT_FAULT": "nan:5-99"}))
    assert code == 1 and "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "--max_bad_steps 2" in errors[0] and "step-000004" in errors[0], text[-3000:]


def _checkpoints(outputs):
    return sorted(p.name for p in Path(outputs).glob("*/checkpoints/step-*"))


def test_sigterm_mid_run_saves_a_checkpoint_and_exits_0_then_load_auto_resumes(tmp_path):
    out = tmp_path / "out"
    proc = _launch(["train.py", *DEBUG_ARGS, "--max_steps", "100000", "--outputs", str(out)])
    log = out / "000-DiT-debug" / "log.jsonl"
    deadline = time.time() + 120
    while not (log.exists() and len(log.read_text().splitlines()) >= 2) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    code, text = _finish(proc)
    assert code == 0, text[-3000:]
    assert "received SIGTERM" in text and "stopped by SIGTERM" in text
    step = json.loads(log.read_text().splitlines()[-1])["step"]
    assert _checkpoints(out) == [f"step-{step:06d}"]
    code, text = _finish(_launch(["train.py", *DEBUG_ARGS, "--max_steps", str(step + 2), "--outputs", str(out),
                                  "--load", "auto"]))
    assert code == 0, text[-3000:]
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()][-3:] == [step, step + 1, step + 2]
    assert (out / "000-DiT-debug" / f"config-from-step-{step:06d}.yaml").is_file()  # the first config is kept


def test_save_on_signal_false_leaves_sigterm_to_end_the_run_at_once(tmp_path):
    out = tmp_path / "out"
    proc = _launch(["train.py", *DEBUG_ARGS, "--max_steps", "100000", "--save_on_signal", "false",
                    "--outputs", str(out)])
    log = out / "000-DiT-debug" / "log.jsonl"
    deadline = time.time() + 120
    while not (log.exists() and len(log.read_text().splitlines()) >= 2) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    code, text = _finish(proc)
    assert code == -signal.SIGTERM and "received SIGTERM" not in text, text[-3000:]
    assert _checkpoints(out) == []


def test_a_second_sigterm_ends_the_run_at_once_without_a_checkpoint(tmp_path):
    out = tmp_path / "out"
    proc = _launch([FAULT_TRAIN, *DEBUG_ARGS, "--max_steps", "100000", "--outputs", str(out)],
                   env={"OPENDIT_FAULT": "slow:3"})  # each step takes 3 s: both signals arrive within one
    log = out / "000-DiT-debug" / "log.jsonl"
    deadline = time.time() + 120
    while not log.exists() and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    code, text = _finish(proc)
    assert code == -signal.SIGTERM and "received SIGTERM" in text, text[-3000:]
    assert _checkpoints(out) == [] and "stopped by SIGTERM" not in text


def test_load_auto_without_a_checkpoint_starts_fresh(tmp_path):
    trainer, _ = run_trainer(tiny_cfg(tmp_path, max_steps=1, load="auto"))
    assert trainer.run_dir.name == "000-DiT-debug" and _checkpoints(tmp_path) == ["step-000001"]


@pytest.mark.slow
def test_sigusr1_on_one_rank_makes_every_rank_save_and_exit_0(tmp_path):
    code, text = _finish(_launch([FAULT_TRAIN, *DEBUG_ARGS, "--max_steps", "50", "--outputs", str(tmp_path)],
                                 nproc=2, env={"OPENDIT_FAULT": "signal:4:1:SIGUSR1"}))
    assert code == 0, text[-3000:]
    assert _checkpoints(tmp_path) == ["step-000004"]  # the step in flight finished, then both ranks saved
    assert "stopped by a signal on another rank after step 4" in text  # rank 0 saw rank 1's signal


@pytest.mark.slow
def test_a_rank_killed_mid_run_under_torchrun_restarts_resume_and_match_an_uninterrupted_run(tmp_path):
    args = [*DEBUG_ARGS, "--max_steps", "8", "--ckpt_every", "3", "--load", "auto"]
    code, text = _finish(_launch(["--max-restarts", "1", FAULT_TRAIN, *args, "--outputs", str(tmp_path / "killed")],
                                 nproc=2, env={"OPENDIT_FAULT": "kill:6:1"}))
    assert code == 0, text[-3000:]
    assert "resuming from" in text and "step-000003" in text  # the second attempt resumed from step 3
    code, text = _finish(_launch(["train.py", *args, "--outputs", str(tmp_path / "whole")], nproc=2))
    assert code == 0, text[-3000:]
    killed = {}
    for record in map(json.loads, (tmp_path / "killed" / "000-DiT-debug" / "log.jsonl").read_text().splitlines()):
        killed[record["step"]] = record["loss"]  # steps 4, 5 were logged twice: the restart's value wins
    whole = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "whole" / "000-DiT-debug" / "log.jsonl")
                                               .read_text().splitlines())}
    assert killed == whole


@pytest.mark.slow
def test_a_restarted_attempt_joins_its_own_peers_not_the_killed_ones():
    """torchrun's store keeps the killed attempt's peer addresses; without a per-attempt scope the restart reads
    them and fails to connect (4 of 4 runs of this job on torch 2.13)."""
    code, text = _finish(_launch(["--max-restarts", "1", str(ROOT / "tests" / "restart_worker.py")], nproc=2),
                         timeout=120)
    assert code == 0, text[-3000:]
    assert "attempt 1 rank 0 joined" in text and "attempt 1 rank 1 joined" in text, text[-3000:]


@pytest.mark.slow
def test_a_hung_peer_turns_into_an_error_within_dist_timeout(tmp_path):
    start = time.time()
    code, text = _finish(_launch([FAULT_TRAIN, *DEBUG_ARGS, "--max_steps", "50", "--dist_timeout", "0.1",
                                  "--outputs", str(tmp_path)], nproc=2, env={"OPENDIT_FAULT": "hang:3:1"}))
    assert code != 0
    assert time.time() - start < 120
    assert "--dist_timeout 0.1" in text and "step 3" in text, text[-3000:]
    assert "error: step 3: another rank did not answer" in text, text[-3000:]  # one line, no traceback


def test_training_logs_the_total_of_skipped_images_over_workers(tmp_path, capfd):
    from tests.test_data import folder as make_folder

    (tmp_path / "data").mkdir()
    root, bad = make_folder.__wrapped__(tmp_path / "data")
    trainer, _ = run_trainer(tiny_cfg(tmp_path / "out", dataset="folder", data_path=str(root), image_size=8,
                                      batch_size=4, max_steps=4, num_workers=1))
    records = [json.loads(line) for line in (trainer.run_dir / "log.jsonl").read_text().splitlines()]
    assert records[-1]["skipped_images"] == len(bad)  # found by the worker process, counted in the trainer
    assert f"{len(bad)} unreadable files were skipped in this run" in capfd.readouterr().err


def _count_skipped_on_two_ranks(rank, world_size, root):
    from opendit.data import count_skipped
    from opendit.data.image_folder import ImageFolderDataset

    dataset = ImageFolderDataset(root, 8)
    for i in range(rank, len(dataset), world_size):  # each rank reads its own half, as the sharded sampler does
        dataset[i]
    return count_skipped(dataset), count_skipped(dataset)  # the second call sends nothing new


@pytest.mark.slow
def test_skipped_images_are_totalled_over_ranks(tmp_path):
    from tests.distributed import run_distributed
    from tests.test_data import folder as make_folder

    root, bad = make_folder.__wrapped__(tmp_path)
    assert run_distributed(_count_skipped_on_two_ranks, 2, str(root)) == [(len(bad), len(bad))] * 2
