"""The memory planner's predicted CUDA peak beside the measured one: for each case the planner's GPU total
(opendit.plan.account, the options given, not searched) and torch.cuda.max_memory_allocated() over 2 training
steps of train.py's own Trainer with the same config. It reports; it asserts nothing.

    python benchmarks/plan_check.py --out plan_check.md          # GPU (gpu_check.sh's step)
    python benchmarks/plan_check.py --dry-run                    # the predictions only (also without CUDA)

Cases, on synthetic latent caches (random values, no download):
- DiT-XL/2, 256 px (latents 4 x 32 x 32), batch 8, --mixed_precision bf16 (fp32 weights under autocast), EMA.
- flux-dev LoRA rank 16, 512 px (1024 image + 512 text tokens), batch 1, bf16 base of zeros (lora_step.py's way:
  a safetensors file of the official shapes; --base reuses one already written), grad checkpointing, no EMA.
The measured peak leaves out the CUDA context, as the planner does.
"""
import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import failure_status, free, write_zero_base  # noqa: E402
from benchmarks.flux_lean_step import time_steps, write_synthetic_cache  # noqa: E402
from opendit import config as cfglib  # noqa: E402
from opendit.data.latents import CACHE_VERSION, MANIFEST  # noqa: E402
from opendit.families import family_of  # noqa: E402
from opendit.plan import account  # noqa: E402
from opendit.plan.planner import Options  # noqa: E402
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="predict only (the default without CUDA)")
    p.add_argument("--work", default="/tmp/plan_check", help="caches and runs")
    p.add_argument("--base", default=None, help="a zero flux-dev base already written (lora_step.py's)")
    p.add_argument("--out", default=None, help="also write the table here, after every row")
    a = p.parse_args()
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
