"""DCP step checkpoints: exact resume, save at 4 ranks / load at 2 and 1 across plugins, crash safety, exports."""
import argparse
import multiprocessing
import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from opendit.checkpoint import (export_ema, export_weights, load_checkpoint, load_weights, resolve_checkpoint,
                                save_checkpoint)
from opendit.checkpoint import save as ckpt_save
from opendit.checkpoint.discovery import list_checkpoints
from opendit.ema import ShardedEMA
from tests.distributed import run_distributed
from tests.test_ema import full_params, tiny_dit, wrap


def make_run(layout: str, seed: int):
    """(model, optimizer, ema, lr scheduler): label dropout 0.5 so the global RNG drives the model, a
    step-dependent lr so the scheduler state matters. Order matches save/load_checkpoint's arguments."""
    model = wrap(tiny_dit(seed=seed, class_dropout_prob=0.5), layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, ShardedEMA(model, decay=0.9), scheduler


def run_steps(run, gen: torch.Generator, steps: int) -> list[float]:
    """Data from `gen` (the 'data position'); timesteps, noise and label dropout from the global RNG."""
    model, optimizer, ema, scheduler = run
    losses = []
    for _ in range(steps):
        x = torch.randn(2, 3, 8, 8, generator=gen)
        y = torch.randint(0, 10, (2,), generator=gen)
        t = torch.randint(0, 1000, (2,))
        noise = torch.randn_like(x)
        loss = (model(x + noise, t, y)[:, :3] - noise).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        ema.update(model)
        losses.append(loss.item())
    return losses


def full_state(run) -> dict:
    """Weights, optimizer state and EMA as full tensors (collectives when distributed)."""
    model, optimizer, ema, _ = run
    optim = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=dist.is_initialized()))
    state = {k: {n: v.detach().clone() for n, v in s.items()} for k, s in optim["state"].items()}
    groups = [{k: v for k, v in g.items()} for g in optim["param_groups"]]
    return {"weights": full_params(model), "optim": state, "groups": groups, "ema": ema.full_state_dict()}


def assert_same_state(a: dict, b: dict, what: str):
    for part in ("weights", "ema"):
        assert a[part].keys() == b[part].keys(), f"{what}: {part} keys differ"
        bad = [n for n in a[part] if not torch.equal(a[part][n], b[part][n])]
        assert not bad, f"{what}: {part} differs at {bad[:3]}"
    assert a["optim"].keys() == b["optim"].keys() and len(a["optim"]) > 0, f"{what}: optimizer state keys differ"
    for fqn, s in a["optim"].items():
        for k, v in s.items():
            assert torch.equal(v, b["optim"][fqn][k]), f"{what}: optimizer {fqn}.{k} differs"
    assert a["groups"] == b["groups"], f"{what}: optimizer param groups differ"


# ---- resume after 3 of 6 steps == 6 uninterrupted steps (2 ranks, zero2-style fully_shard) ----

def _resume_worker(rank, world, root):
    def fresh(seed):
        run = make_run("fsdp", seed)
        torch.manual_seed(1234 + rank)  # per-rank global RNG (tiny_dit reseeds while building)
        return run, torch.Generator().manual_seed(rank)

    run, gen = fresh(0)
    uninterrupted = run_steps(run, gen, 6)
    final = full_state(run)

    run, gen = fresh(0)
    first = run_steps(run, gen, 3)
    save_checkpoint(root, 3, *run, extra={"data": gen.get_state(), "config": {"lr": 1e-2}})
    torch.manual_seed(999)  # a new process would start with other RNG states and other weights
    run, gen = make_run("fsdp", seed=7), torch.Generator()
    step, extra = load_checkpoint(resolve_checkpoint("latest", root), *run)
    gen.set_state(extra["data"])
    resumed = run_steps(run, gen, 3)
    same = full_state(run)
    # Control: the same resume without the restored global RNG must give other losses (the test can fail).
    run, gen = make_run("fsdp", seed=7), torch.Generator()
    load_checkpoint(os.path.join(root, "step-000003"), *run)
    gen.set_state(extra["data"])
    torch.manual_seed(999)
    control = run_steps(run, gen, 3)
    return dict(uninterrupted=uninterrupted, first=first, resumed=resumed, control=control, step=step,
                config=extra["config"], final=final, same=same)


@pytest.mark.slow
def test_resume_after_3_of_6_steps_equals_uninterrupted(tmp_path):
    for rank, r in enumerate(run_distributed(_resume_worker, 2, str(tmp_path))):
        assert r["step"] == 3 and r["config"] == {"lr": 1e-2}
        assert r["first"] + r["resumed"] == r["uninterrupted"], f"rank {rank}: resumed losses differ"
        assert r["control"] != r["resumed"], "losses do not depend on the restored RNG; the test is blind"
        assert_same_state(r["final"], r["same"], f"rank {rank} after 6 steps")


# ---- save at 4 ranks (fully_shard, reshard_after_forward=False) -> load with DDP at 2, plain at 1 ----

def _save4_worker(rank, world, root):
    run = make_run("fsdp", seed=0)
    torch.manual_seed(rank)
    run_steps(run, torch.Generator().manual_seed(rank), 2)
    save_checkpoint(root, 2, *run)
    return full_state(run)


def _load2_worker(rank, world, root4, root2, root1):
    run = make_run("ddp", seed=5)
    load_checkpoint(resolve_checkpoint("latest", root4), *run)
    loaded = full_state(run)
    save_checkpoint(root2, 2, *run)  # and back: a ddp checkpoint loaded by fully_shard at 2 ranks
    run = make_run("fsdp", seed=6)
    load_checkpoint(resolve_checkpoint("latest", root2), *run)
    back = full_state(run)
    # A 1-process checkpoint has no RNG state for rank 1: it gets a deterministic fallback.
    draws = []
    for _ in range(2):
        load_checkpoint(resolve_checkpoint("latest", root1), *make_run("ddp", seed=8))
        draws.append(torch.rand(4))
    return dict(loaded=loaded, back=back, draws=draws)


@pytest.mark.slow
def test_save_at_4_fsdp_loads_with_ddp_at_2_and_plain_at_1(tmp_path):
    root4, root2, root1 = (str(tmp_path / d) for d in ("r4", "r2", "r1"))
    run1 = make_run("none", seed=0)
    torch.manual_seed(42)
    save_checkpoint(root1, 1, *run1)
    saved_draw = torch.rand(4)

    saved = run_distributed(_save4_worker, 4, root4)[0]
    assert any(not torch.equal(saved["weights"][n], saved["ema"][n]) for n in saved["weights"])
    results = run_distributed(_load2_worker, 2, root4, root2, root1)
    for rank, r in enumerate(results):
        assert_same_state(saved, r["loaded"], f"ddp rank {rank} loading the 4-rank fsdp checkpoint")
        assert_same_state(saved, r["back"], f"fsdp rank {rank} loading the 2-rank ddp checkpoint")
    assert torch.equal(results[0]["draws"][0], saved_draw)  # rank 0's saved RNG restored
    assert torch.equal(results[1]["draws"][0], results[1]["draws"][1])  # rank 1: deterministic fallback
    assert not torch.equal(results[1]["draws"][0], saved_draw)

    run = make_run("none", seed=9)
    step, _ = load_checkpoint(resolve_checkpoint("latest", root4), *run)
    assert step == 2
    assert_same_state(saved, full_state(run), "1 process loading the 4-rank fsdp checkpoint")


# ---- single process: round trip, keep_last, crash safety, errors, exports ----

def test_round_trip_restores_everything_in_one_process(tmp_path):
    run = make_run("none", seed=0)
    gen = torch.Generator().manual_seed(3)
    run_steps(run, gen, 2)
    random.seed(5)
    np.random.seed(5)
    path = save_checkpoint(str(tmp_path), 2, *run, extra={"data": gen.get_state(), "epoch": 1})
    draws = (torch.rand(3), np.random.rand(3), random.random())
    expected = full_state(run)
    run = make_run("none", seed=4)
    step, extra = load_checkpoint(path, *run)
    assert step == 2 and extra["epoch"] == 1 and torch.equal(extra["data"], gen.get_state())
    assert_same_state(expected, full_state(run), "reloaded")
    assert run[3].last_epoch == 2 and run[1].param_groups[0]["lr"] == pytest.approx(1e-2 / 3)
    assert torch.equal(torch.rand(3), draws[0]) and np.array_equal(np.random.rand(3), draws[1])
    assert random.random() == draws[2]
    model_only = tiny_dit(seed=6)  # model alone, e.g. to fine-tune or sample
    load_checkpoint(path, model_only)
    assert all(torch.equal(p, expected["weights"][n]) for n, p in model_only.named_parameters())


def test_keep_last_prunes_oldest_and_latest_is_newest(tmp_path):
    model = tiny_dit()
    for step in (10, 20, 30, 40):
        save_checkpoint(str(tmp_path), step, model, keep_last=2)
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [30, 40]
    assert sorted(os.listdir(tmp_path)) == ["step-000030", "step-000040"]
    assert resolve_checkpoint("latest", str(tmp_path)).endswith("step-000040")
    save_checkpoint(str(tmp_path), 40, model, keep_last=2)  # re-saving a step replaces it
    assert sorted(os.listdir(tmp_path)) == ["step-000030", "step-000040"]


def test_save_that_raises_midway_keeps_previous_latest(tmp_path, monkeypatch):
    model = tiny_dit(seed=0)
    save_checkpoint(str(tmp_path), 1, model)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    real_save = ckpt_save.dcp.save

    def failing_save(state, checkpoint_id, **kw):
        real_save(state, checkpoint_id=checkpoint_id, **kw)  # files written, then the "disk fills up"
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_save.dcp, "save", failing_save)
    with torch.no_grad():
        model.pos_embed.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(str(tmp_path), 2, model)
    assert os.path.isdir(tmp_path / ".tmp-step-000002")
    latest = resolve_checkpoint("latest", str(tmp_path))
    assert latest.endswith("step-000001")
    fresh = tiny_dit(seed=3)
    load_checkpoint(latest, fresh)
    assert all(torch.equal(p, saved[n]) for n, p in fresh.named_parameters())
    monkeypatch.setattr(ckpt_save.dcp, "save", real_save)
    save_checkpoint(str(tmp_path), 3, model)  # the next save clears the leftover
    assert sorted(os.listdir(tmp_path)) == ["step-000001", "step-000003"]


def _save_then_die(root):
    """Child process: a good save at step 1, then a save killed (os._exit) after its files are written,
    just before the rename."""
    model = tiny_dit(seed=0)
    save_checkpoint(root, 1, model)
    with torch.no_grad():
        model.pos_embed.add_(1.0)
    real_replace = os.replace

    def die_on_rename(src, dst):
        if os.path.basename(src).startswith(".tmp-step"):
            os._exit(17)
        real_replace(src, dst)

    ckpt_save.os.replace = die_on_rename
    save_checkpoint(root, 2, model)


@pytest.mark.slow
def test_save_killed_before_rename_leaves_previous_latest(tmp_path):
    proc = multiprocessing.get_context("spawn").Process(target=_save_then_die, args=(str(tmp_path),))
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode == 17
    assert os.path.exists(tmp_path / ".tmp-step-000002" / ".metadata")  # written, never renamed
    latest = resolve_checkpoint("latest", str(tmp_path))
    assert latest.endswith("step-000001")
    fresh = tiny_dit(seed=3)
    load_checkpoint(latest, fresh)
    expected = tiny_dit(seed=0)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), expected.parameters()))


def test_resolve_errors_name_the_path_and_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_checkpoint("latest", str(tmp_path))
    broken = tmp_path / "step-000005"
    broken.mkdir()
    (broken / ".metadata").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"incomplete: missing \['trainer.pt', 'meta.json', 'ranks'\]"):
        resolve_checkpoint(str(broken))
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_checkpoint("latest", str(tmp_path))  # an incomplete step dir is never "latest"
    with pytest.raises(TypeError, match="wrong order"):
        save_checkpoint(str(tmp_path), 1, tiny_dit(), None, torch.optim.SGD(tiny_dit().parameters(), lr=1))


def test_export_and_load_weights_in_every_format(tmp_path):
    run = make_run("none", seed=0)
    run_steps(run, torch.Generator().manual_seed(0), 1)
    model, _, ema, _ = run
    ema_sd, model_sd = ema.full_state_dict(), model.state_dict()
    out = export_ema(ema, str(tmp_path / "ema.safetensors"), {"model": "DiT-debug", "input_size": 8})
    loaded = load_weights(out)
    assert loaded.keys() == ema_sd.keys() and all(torch.equal(loaded[k], ema_sd[k]) for k in ema_sd)
    assert '"model": "DiT-debug"' in (tmp_path / "ema.json").read_text()
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    tiny_dit(seed=2).load_state_dict(loaded, strict=True)  # official keys, strict

    torch.save(model_sd, tmp_path / "plain.pt")  # the released DiT-XL-2-256x256.pt is a plain state_dict
    assert all(torch.equal(load_weights(str(tmp_path / "plain.pt"))[k], v) for k, v in model_sd.items())
    train_ckpt = {"model": {"module." + k: v for k, v in model_sd.items()}, "ema": ema_sd, "opt": {},
                  "args": argparse.Namespace(model="DiT-XL/2")}  # DiT's train.py checkpoint layout
    torch.save(train_ckpt, tmp_path / "0001000.pt")
    assert all(torch.equal(load_weights(str(tmp_path / "0001000.pt"))[k], v) for k, v in ema_sd.items())
    by_key = load_weights(str(tmp_path / "0001000.pt"), key="model")
    assert all(torch.equal(by_key[k], v) for k, v in model_sd.items())

    step_dir = save_checkpoint(str(tmp_path / "run"), 1, *run)
    from_dir = load_weights(step_dir)
    assert all(torch.equal(from_dir[k], v) for k, v in ema_sd.items())
    assert all(torch.equal(load_weights(step_dir, key="model")[k], v) for k, v in model_sd.items())
    with pytest.raises(ValueError, match="must end with .safetensors"):
        export_weights(str(tmp_path / "x.bin"), model_sd)
