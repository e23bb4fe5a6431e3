"""The memory planner's predicted CUDA peak beside the measured one: for each case the planner's GPU total
(opendit.plan.account, the options given, not searched) and torch.cuda.max_memory_allocated() over 2 training
steps of train.py's own Trainer with the same config. It reports; it asserts nothing.

    python benchmarks/plan_check.py --out plan_check.md          # GPU (gpu_check.sh's step)
    python benchmarks/plan_check.py --dry-run                    # the predictions only (also without CUDA)
    python benchmarks/plan_check.py --families --out f.md        # one row per family (GPU: gpu_check.sh's step)
    python benchmarks/plan_check.py --families --device cpu      # the same on the CPU: peak RSS, in a child each

Cases, on synthetic latent caches (random values, no download):
- DiT-XL/2, 256 px (latents 4 x 32 x 32), batch 8, --mixed_precision bf16 (fp32 weights under autocast), EMA.
- flux-dev LoRA rank 16, 512 px (1024 image + 512 text tokens), batch 1, bf16 base of zeros (lora_step.py's way:
  a safetensors file of the official shapes; --base reuses one already written), grad checkpointing, no EMA.
The measured peak leaves out the CUDA context, as the planner does.

--families: every registered family's debug model (the debug case of opendit.plan.budgets' table) in pixel space on
its first built-in dataset, with the tiny text encoders of its conformance row, --image_size (video: --num_frames
frames), at the smallest batch (a power of 2) whose planned bytes reach --min_mib, so that the step's tensors
dwarf the allocator's noise. CUDA: max_memory_allocated over 2 steps in this process, bf16 compute; CPU: the peak
RSS growth of 2 steps in a child process each (tests/plan_peak.py), fp32, against the planner's device + host total.
The planner's text encoders are left out (it counts a release's by name; the tiny ones take a few MiB).
"""
import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import failure_status, free, write_zero_base  # noqa: E402
from benchmarks.flux_lean_step import time_steps, write_synthetic_cache  # noqa: E402
from opendit import config as cfglib  # noqa: E402
from opendit.data.latents import CACHE_VERSION, MANIFEST  # noqa: E402
from opendit.families import FAMILIES, family_of  # noqa: E402
from opendit.plan import account, budgets  # noqa: E402
from opendit.plan.planner import Options, totals  # noqa: E402
from opendit.plan.report import build_run  # noqa: E402

GiB = 2 ** 30
STEPS = 2
COMMON = dict(dataset="latents", max_steps=STEPS, log_every=1, ckpt_every=10 ** 9, num_workers=0,
              mixed_precision="bf16")


def write_dit_cache(folder: Path, count: int) -> None:
    """A preprocess.py-layout cache of `count` 4 x 32 x 32 latents (SD's VAE at 256 px) with random values."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = dict(mean=rng.standard_normal((count, 4, 32, 32), dtype=np.float32),
                  std=np.full((count, 4, 32, 32), 0.05, dtype=np.float32), label=np.arange(count, dtype=np.int64))
    for key, value in arrays.items():
        np.save(folder / f"r000-00000.{key}.npy", value)
    manifest = dict(version=CACHE_VERSION, family="dit", vae="synthetic", vae_scale=0.18215, image_size=256,
                    latent_shape=[4, 32, 32], num_classes=1000, classes=[], count=count, skipped=0,
                    flip_both=False, dtype="float32", source={}, shards=[{"stem": "r000-00000", "count": count}])
    (folder / MANIFEST).write_text(json.dumps(manifest))


def cases(work: Path, base: Path) -> list[tuple[str, str, cfglib.TrainConfig]]:
    """(model, options, config) of each case, training from the caches prepare() writes under `work`."""
    dit = cfglib.TrainConfig(model="DiT-XL/2", data_path=str(work / "dit"), image_size=256, num_classes=1000,
                             batch_size=8, outputs=str(work / "runs"), **COMMON)
    flux = cfglib.TrainConfig(model="flux-dev", data_path=str(work / "flux" / "cache"), image_size=512, batch_size=1,
                              lora_rank=16, init_weights=str(base), grad_checkpoint=1, ema_decay=0.0, lr=1e-4,
                              outputs=str(work / "runs"), **COMMON)
    return [("DiT-XL/2", "256 px, batch 8, bf16 autocast, EMA", dit),
            ("flux-dev", "LoRA 16, 512 px, batch 1, bf16 base, --grad_checkpoint 1, no EMA", flux)]


def prepare(work: Path, base: Path) -> None:
    """The caches cases() trains from, and the zero flux-dev base unless one is there."""
    write_dit_cache(work / "dit", count=8 * STEPS)
    write_synthetic_cache(work / "flux", "flux-dev", 512, 512, count=STEPS)
    if not base.is_file():
        write_zero_base(base, "flux-dev")


def predicted(cfg) -> float:
    """The planner's GPU bytes for cfg's own options: the cache's geometry is the family's usual VAE's, and a
    cache means no encoders on the GPU."""
    cfg = family_of(cfg.model).fill_defaults(dataclasses.replace(cfg, vae="usual"))
    options = Options(**{k: getattr(cfg, k) for k in Options.__dataclass_fields__})
    return sum(account(build_run(cfg, 1, torch.device("cuda")), options)["gpu"].values())


def measured(cfg) -> float:
    """Peak bytes allocated on the GPU over STEPS steps of the Trainer, from before it is built."""
    from opendit.training.loop import Trainer

    free(torch.device("cuda"))
    trainer = Trainer(cfg)
    time_steps(trainer, STEPS, cuda=True)
    peak = torch.cuda.max_memory_allocated()
    del trainer
    free(torch.device("cuda"))
    return peak


def planner_of(options: dict, device: torch.device):
    """batch -> the planner's bytes for the run of `options` (its own memory options) at that batch on `device` (a
    CPU: device and host parts together); the model is measured once."""
    cfg = family_of(options["model"]).resolve_config(cfglib.TrainConfig(**options))
    run, chosen = build_run(cfg, 1, device), Options(**{k: getattr(cfg, k) for k in Options.__dataclass_fields__})
    run = dataclasses.replace(run, encoders={})  # the planner counts a release's text encoders by name, not the tiny
    return lambda batch: totals(account(dataclasses.replace(run, cfg=dataclasses.replace(cfg, batch_size=batch)),
                                        chosen), device.type == "cpu")[0]


def family_cases(work: Path, a, device: torch.device) -> list[tuple[str, str, dict, float]]:
    """(family, size in words, TrainConfig options, planned bytes) per registered family (module docstring)."""
    from tests.families.test_conformance import write_text_encoders

    cases, out = budgets.load()["cases"], []
    for name in a.family or budgets.registered():
        family, debug = FAMILIES[name], cases[name]["debug"]
        frames = dict(num_frames=a.num_frames) if "num_frames" in debug else {}
        options = dict(model=debug["model"], dataset=next(n for n, s in family.datasets.items() if s.built_in),
                       image_size=a.image_size, **frames, vae="none", num_classes=10, num_workers=0,
                       max_steps=STEPS, log_every=1, ckpt_every=10 ** 9, outputs=str(work / "runs"),
                       mixed_precision="bf16" if device.type == "cuda" else "fp32",
                       **{k: str(v) for k, v in write_text_encoders(name, work / "text" / name).items()})
        planned, batch = planner_of(options, device), 1
        while batch < a.max_batch and planned(batch) < a.min_mib * 2 ** 20:
            batch *= 2
        size = f"{a.image_size} px{f' x {a.num_frames}' if frames else ''}, batch {batch}"
        out.append((name, size, dict(options, batch_size=batch), planned(batch)))
    return out


def measured_cpu(options: dict) -> float:
    """Peak RSS growth of STEPS steps in a child (tests/plan_peak.py, one thread). glibc serves every allocation from
    64 KiB up by mmap there (MALLOC_MMAP_THRESHOLD_), so a freed tensor leaves the process and the peak RSS follows
    the live tensors, as max_memory_allocated does on CUDA (else its heap keeps freed blocks below 32 MiB)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "MALLOC_MMAP_THRESHOLD_": "65536"}
    child = Path(__file__).resolve().parents[1] / "tests" / "plan_peak.py"
    out = subprocess.run([sys.executable, str(child), json.dumps(options)], capture_output=True, text=True, env=env,
                         timeout=600)
    if out.returncode:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])["measured"]


def families(a) -> None:
    """The --families table, a row as each finishes: family | model | size | predicted | measured | error; on the CPU
    also the half batch's step and the difference of the two (per sample: the activations and workspace alone,
    without what a process adds beside its tensors, e.g. the libraries a first step loads)."""
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    work, cpu = Path(a.work), device.type == "cpu"
    head = "| family | model | size ({}) | predicted MiB | measured MiB | error |" + \
        (" per sample: predicted MiB | measured MiB | error |" if cpu else "")
    lines = [head.format(device.type), "|---|---|---|---:|---:|---:|" + ("---:|---:|---:|" if cpu else "")]
    print("\n".join(lines), flush=True)
    for name, size, options, guess in family_cases(work, a, device):
        try:
            if a.dry_run:
                cells = "dry run | -" + (" | - | - | -" if cpu else "")
            elif cpu:
                half = max(options["batch_size"] // 2, 1)
                peak, low = measured_cpu(options), measured_cpu(dict(options, batch_size=half))
                samples = options["batch_size"] - half
                each = (guess - planner_of(dict(options, batch_size=half), device)(half)) / max(samples, 1)
                got = (peak - low) / max(samples, 1)
                cells = (f"{peak / 2 ** 20:.0f} | {guess / peak - 1:+.1%} | {each / 2 ** 20:.1f} | "
                         f"{got / 2 ** 20:.1f} | {each / got - 1:+.1%}" if samples else
                         f"{peak / 2 ** 20:.0f} | {guess / peak - 1:+.1%} | - | - | -")
            else:
                peak = measured(cfglib.TrainConfig(**options))
                cells = f"{peak / 2 ** 20:.0f} | {guess / peak - 1:+.1%}"
        except Exception as e:  # noqa: BLE001 - a failed family is a row; the next one still runs
            cells = f"{failure_status(e)} | -" + (" | - | - | -" if cpu else "")
        lines.append(f"| {name} | {options['model']} | {size} | {guess / 2 ** 20:.0f} | {cells} |")
        print(lines[-1], flush=True)
        if a.out:
            Path(a.out).write_text("\n".join(lines) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="predict only (the default without CUDA)")
    p.add_argument("--work", default="/tmp/plan_check", help="caches and runs")
    p.add_argument("--base", default=None, help="a zero flux-dev base already written (lora_step.py's)")
    p.add_argument("--out", default=None, help="also write the table here, after every row")
    p.add_argument("--families", action="store_true", help="one row per registered family (module docstring)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="--families: where (default: cuda if any)")
    p.add_argument("--image_size", type=int, default=64, help="--families: pixels (pixel space)")
    p.add_argument("--num_frames", type=int, default=5, help="--families: a video family's frames")
    p.add_argument("--min_mib", type=float, default=256, help="--families: the planned bytes the batch reaches")
    p.add_argument("--max_batch", type=int, default=256, help="--families: the largest batch tried")
    p.add_argument("--family", action="append", help="--families: only this family (repeat for more)")
    a = p.parse_args()
    if a.families:
        return families(a)
    cuda = torch.cuda.is_available() and not a.dry_run
    lines = ["| model | options | predicted GiB | measured GiB | error |", "|---|---|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    work = Path(a.work)
    base = Path(a.base) if a.base and Path(a.base).is_file() else work / "base.safetensors"
    if cuda:
        prepare(work, base)
    for model, options, cfg in cases(work, base):
        guess = predicted(cfg)
        try:
            peak = measured(cfg) if cuda else None
            cells = (f"{peak / GiB:.2f} | {guess / peak - 1:+.1%}" if peak else
                     ("dry run | -" if a.dry_run else "no CUDA | -"))
        except Exception as e:  # noqa: BLE001 - a failed case is a row; the next one still runs
            cells = f"{failure_status(e)} | -"
        lines.append(f"| {model} | {options} | {guess / GiB:.2f} | {cells} |")
        print(lines[-1], flush=True)
        if a.out:
            Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
