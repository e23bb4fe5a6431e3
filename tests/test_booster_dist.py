"""Multi-process equivalence of the booster plugins (gloo, CPU): every plugin x {fp32, bf16} at 2 and 4 ranks
trains like one process; gradient accumulation equals the large batch; activation checkpointing changes
nothing; an fp16 overflow step is skipped and counted.

Tolerances (all relative unless said):
- fp32: losses and grad norms 1e-6, final parameters 5e-6 absolute. Only the order of fp32 sums differs (a
  gradient averaged over 2-4 shards vs summed in one batch); observed <= 1.1e-7 / 6.5e-7.
- bf16: losses 1e-4, grad norms 1e-3, against the same plugin and precision at one rank. Per-sample bf16 math
  is the same, but batch-shape-dependent matmul blocking flips bf16 roundings (2^-8 relative), which the
  loss (a mean over 3072 elements) mostly averages out and the grad norm less so; observed <= 1.7e-5 and
  1.9e-4. Parameters are not compared elementwise in bf16: Adam divides by sqrt(v), so the update of a
  parameter with a near-zero gradient amplifies rounding noise to the size of the learning rate.
AdamW is nearly invariant to the scale of the gradient, so the grad norms (not the losses) are what catch a
gradient that is summed instead of averaged.
"""
import importlib.util
import math
from pathlib import Path

import pytest

from tests.distributed import run_distributed
from tests.test_booster_helpers import train, train_plain

pytestmark = pytest.mark.slow

PLUGINS_2 = ("ddp", "zero2", "zero3", "gemini")
FP32 = dict(loss=1e-6, norm=1e-6, param=5e-6)
BF16 = dict(loss=1e-4, norm=1e-3)


def _memory_benchmark():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "memory.py"
    spec = importlib.util.spec_from_file_location("opendit_memory_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runs(rank, world, cases):
    out = {}
    for name, kwargs in cases.items():
        if name.startswith("memory-"):  # benchmarks/memory.py on the tiny model
            out[name] = _memory_benchmark().measure(kwargs["plugin"], "DiT-debug", dict(
                input_size=8, in_channels=3, num_classes=10), "bf16", materialize=kwargs["materialize"])
        else:
            out[name] = train(**kwargs)
    return out


def _spawn(world, cases):
    return run_distributed(_runs, world, cases)[0]


@pytest.fixture(scope="module")
def world1():
    cases = {f"{p}-{pr}": dict(plugin=p, precision=pr) for p in (*PLUGINS_2, "hsdp") for pr in ("fp32", "bf16")}
    return _spawn(1, cases)


@pytest.fixture(scope="module")
def world2():
    cases = {f"{p}-{pr}": dict(plugin=p, precision=pr) for p in PLUGINS_2 for pr in ("fp32", "bf16")}
    cases |= {f"{p}-fp32-accum": dict(plugin=p, precision="fp32", accum=2) for p in ("ddp", "zero3")}
    cases["zero2-bf16-accum"] = dict(plugin="zero2", precision="bf16", accum=2)
    cases["zero3-fp32-ac1"] = dict(plugin="zero3", precision="fp32", grad_checkpoint=1)
    cases["ddp-fp32-ac2"] = dict(plugin="ddp", precision="fp32", grad_checkpoint=2)
    cases |= {f"{p}-fp16-overflow": dict(plugin=p, precision="fp16", overflow_step=2) for p in ("ddp", "zero3")}
    cases |= {"memory-ddp": dict(plugin="ddp", materialize=False),
              "memory-zero3": dict(plugin="zero3", materialize=False),
              "memory-zero3-real": dict(plugin="zero3", materialize=True)}
    return _spawn(2, cases)


@pytest.fixture(scope="module")
def world4():
    cases = {f"hsdp-{pr}": dict(plugin="hsdp", precision=pr, dp_replicate=2) for pr in ("fp32", "bf16")}
    cases["zero2-fp32"] = dict(plugin="zero2", precision="fp32")
    return _spawn(4, cases)


def _close(run, ref, tol, what=""):
    for key in ("losses", "norms"):
        rtol = tol["loss" if key == "losses" else "norm"]
        for step, (a, b) in enumerate(zip(run[key], ref[key], strict=True)):
            assert math.isclose(a, b, rel_tol=rtol), f"{what} {key}[{step}]: {a} vs reference {b} (rtol {rtol})"
    if "param" in tol:
        for name, p in ref["params"].items():
            err = (run["params"][name] - p).abs().max().item()
            assert err <= tol["param"], f"{what} parameter {name} differs by {err}"


def test_single_rank_booster_equals_plain_training(world1):
    plain = train_plain()
    for plugin in (*PLUGINS_2, "hsdp"):
        _close(world1[f"{plugin}-fp32"], plain, FP32, f"{plugin} at 1 rank")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("plugin", PLUGINS_2)
def test_two_ranks_equal_one(world1, world2, plugin, precision):
    run = world2[f"{plugin}-{precision}"]
    assert run["dp"] == (2, 0)
    _close(run, world1[f"{plugin}-{precision}"], FP32 if precision == "fp32" else BF16, f"{plugin} {precision}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hsdp_four_ranks_equal_one(world1, world4, precision):
    _close(world4[f"hsdp-{precision}"], world1[f"hsdp-{precision}"], FP32 if precision == "fp32" else BF16, "hsdp")


def test_zero2_four_ranks(world1, world4):
    assert world4["zero2-fp32"]["dp"] == (4, 0)
    _close(world4["zero2-fp32"], world1["zero2-fp32"], FP32, "zero2 at 4 ranks")


def test_param_groups_survive_boosting(world2, world4):
    for run in (r for r in (*world2.values(), *world4.values()) if "groups" in r):
        before, after = run["groups"]
        assert before == after and len(after) == 2 and after[1]["lr"] == 5e-4


@pytest.mark.parametrize("name, tol", [("ddp-fp32", FP32), ("zero3-fp32", FP32), ("zero2-bf16", BF16)])
def test_gradient_accumulation_equals_large_batch(world2, name, tol):
    _close(world2[f"{name}-accum"], world2[name], tol, f"{name} with 2 micro-batches")


@pytest.mark.parametrize("name, base", [("zero3-fp32-ac1", "zero3-fp32"), ("ddp-fp32-ac2", "ddp-fp32")])
def test_activation_checkpointing_keeps_the_loss(world2, name, base):
    _close(world2[name], world2[base], FP32, name)


@pytest.mark.parametrize("plugin", ["ddp", "zero3"])
def test_fp16_overflow_step_is_skipped_and_counted(world2, plugin):
    run, fp32 = world2[f"{plugin}-fp16-overflow"], world2[f"{plugin}-fp32"]
    assert run["stepped"] == [True, True, False, True, True]
    assert run["skipped"] == 1
    assert run["checksums"][2] == run["checksums"][1], "the skipped step changed the parameters"
    assert run["checksums"][3] != run["checksums"][2]
    assert run["scales"][3] == run["scales"][2] / 2, "the loss scale was not halved after the overflow"
    assert all(math.isfinite(x) for i, x in enumerate(run["losses"]) if i != 2)
    # the gradients were unscaled before clipping: the fp16 norm is the fp32 one, up to fp16 rounding
    assert math.isclose(run["norms"][0], fp32["norms"][0], rel_tol=1e-2)
    assert math.isclose(run["losses"][0], fp32["losses"][0], rel_tol=1e-3)


def test_memory_benchmark_counts_the_sharded_tensors(world2):
    from opendit.families import build_model
    model = build_model("DiT-debug", input_size=8, in_channels=3, num_classes=10)  # as the benchmark builds it
    params = list(model.parameters())
    full = sum(p.numel() * 4 for p in params)
    trainable = sum(p.numel() * 4 for p in params if p.requires_grad)
    steps = 4 * sum(p.requires_grad for p in params)  # AdamW's fp32 step counter per parameter
    ddp, zero3 = world2["memory-ddp"], world2["memory-zero3"]
    assert (ddp["params"], ddp["grads"], ddp["optim"], ddp["gathered"]) == (full, trainable, 2 * trainable + steps, 0)
    # FSDP2 cuts each parameter's dim 0 in 2: the heaviest rank holds half, plus at most one row per parameter
    slack = sum(p[0].numel() * 4 for p in params)
    assert full / 2 <= zero3["params"] <= full / 2 + slack
    assert trainable / 2 <= zero3["grads"] <= trainable / 2 + slack
    assert trainable + steps <= zero3["optim"] <= trainable + steps + 2 * slack
    assert full / 2 <= zero3["ema"] <= full / 2 + slack
    assert world2["memory-zero3-real"] == zero3, "meta and materialized tensors give different bytes"
