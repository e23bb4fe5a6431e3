"""The memory planner (opendit.plan): a smaller budget never gets a faster plan, options the user set stay, an
impossible budget names the smallest that fits, `python -m opendit.plan` sizes the big models, and the predicted
peak host memory of real CPU training steps agrees with the measured one within 15% (with the optimizer offloaded
and with half the blocks swapped too: on a CPU both sides of the copies are host memory)."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opendit import config as cfglib
from opendit.families import family_of
from opendit.plan import choose
from opendit.plan.report import build_run, plan_config
from opendit.plan.__main__ import main as plan_main
from opendit.training.run_checks import validate_run

ROOT = Path(__file__).resolve().parents[1]
GiB = 2 ** 30


def dit_run(**kw):
    cfg = cfglib.TrainConfig(**{**dict(model="DiT-XL/2", dataset="latents", vae="sd", image_size=256, num_classes=1000,
                                       batch_size=8, mixed_precision="bf16"), **kw})
    family = family_of(cfg.model)
    cfg = family.fill_defaults(cfg)
    spec = family.models[cfg.model]
    return build_run(cfg, 1, torch.device("cuda")), lambda o: validate_run(
        dataclasses.replace(cfg, **dataclasses.asdict(o)), spec, 1, torch.device("cpu"))


def test_smaller_budget_never_gets_a_faster_plan_and_user_options_stay():
    run, validate = dit_run()
    seconds, gpu = [], []
    for budget in (40, 16, 12, 8, 6, 5):
        choice = choose(run, (budget * GiB, 512 * GiB), validate)
        seconds.append(choice.seconds)
        gpu.append(sum(choice.parts["gpu"].values()))
        assert gpu[-1] <= budget * GiB
    assert seconds == sorted(seconds)  # monotone: less memory, never faster
    fixed, validate = dit_run(grad_checkpoint=2, optimizer_state_dtype="u16")
    choice = choose(fixed, (6 * GiB, 512 * GiB), validate)
    assert choice.options.grad_checkpoint == 2 and choice.options.optimizer_state_dtype == "u16"


def test_an_impossible_budget_names_the_smallest_that_fits():
    cfg = family_of("DiT-XL/2").fill_defaults(cfglib.TrainConfig(model="DiT-XL/2", dataset="latents", vae="sd",
                                                                 image_size=256, batch_size=8, mixed_precision="bf16"))
    with pytest.raises(ValueError, match=r"no plan fits 0.5 GiB device .* the smallest needs \d+\.\d GiB"):
        plan_config(cfg, "0.5,512", device=torch.device("cuda"))
    with pytest.raises(ValueError, match="expected GPU_GiB"):
        plan_config(cfg, "lots", device=torch.device("cuda"))


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["--model", "flux-dev", "--image_size", "1024", "--memory_budget", "24,256", "--latent_cache"],
    ["--model", "Wan2.1-T2V-14B", "--image_size", "480", "--num_frames", "81", "--memory_budget", "80,512",
     "--latent_cache"],
    ["--model", "DiT-XL/2", "--image_size", "256", "--batch_size", "256", "--memory_budget", "24"]])
def test_python_m_opendit_plan_prints_a_plan(args, capsys):
    text = plan_main(args)
    assert "| **total** |" in text and "| budget |" in text and "with a smaller budget" in text


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"grad_checkpoint": 1, "grad_accum": 2}, {"optimizer_state_dtype": "bf16"},
                                     {"ema_decay": 0, "fused_backward": True}, {"optimizer_offload": True},
                                     {"blocks_to_swap": 6}])
def test_predicted_peak_host_memory_of_cpu_steps_within_15_percent(options):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "plan_peak.py"), json.dumps({"model": "DiT-B/2",
                                                                                             **options})],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert abs(r["predicted"] - r["measured"]) <= 0.15 * r["measured"], r


def test_plan_check_benchmark_predicts_without_cuda(tmp_path, monkeypatch, capsys):
    """benchmarks/plan_check.py (gpu_check.sh's planner step) --dry-run: the predicted column for both cases."""
    from benchmarks import plan_check

    out = tmp_path / "plan_check.md"
    monkeypatch.setattr(sys, "argv", ["plan_check.py", "--dry-run", "--work", str(tmp_path), "--out", str(out)])
    plan_check.main()
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines()[2:]]
    assert [r[0].strip() for r in rows] == ["DiT-XL/2", "flux-dev"]
    assert all(float(r[2]) > 1 and r[3].strip() == "dry run" for r in rows)
