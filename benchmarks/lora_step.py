"""A LoRA training step against a full fine-tune step, through train.py's own Trainer.

    python benchmarks/lora_step.py --out lora_step.md          # CPU: the FLUX demo (flux-debug, 16 px digits)
    python benchmarks/lora_step.py --device cuda --model flux-dev --image_size 1024 --rank 16 --steps 3

CPU (the default): flux-debug on the built-in 16 px captioned digits with the demo's tiny T5 / CLIP, batch 64,
fp32: a full fine-tune and a rank-8 LoRA (the family's default targets) on the full run's weights, run one after
the other in this process; reports seconds per step (median after the first), trainable parameters, optimizer
state bytes and the checkpoint's size on disk, with LoRA / full ratios.
GPU (--device cuda): the LoRA step alone on a synthetic FLUX cache (flux_lean_step.py's) with a base file of
zeros (no download; values do not change the time), bf16 base (--base_dtype fp8: its blocks' Linear weights in
fp8), activation checkpointing, no EMA; reports the
seconds to write and fingerprint the base, the set-up, seconds per step and the peak GPU memory. Its full
fine-tune counterpart is flux_lean_step.py (a separate process in gpu_check.sh).
"""
import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import write_zero_base  # noqa: E402
from benchmarks.flux_lean_step import time_steps, time_trainer_steps, write_synthetic_cache  # noqa: E402
from opendit import config as cfglib  # noqa: E402


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def run(cfg, steps: int, cuda: bool) -> dict:
    """Build the Trainer of cfg, time `steps` steps, save a checkpoint; the figures of the run."""
    from opendit.training.loop import Trainer

    t0 = time.time()
    trainer = Trainer(cfg)
    setup = time.time() - t0
    times, loss = time_steps(trainer, steps, cuda)
    trainer.step = steps
    trainer.save()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    states = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values() for t in s.values()
                 if torch.is_tensor(t))
    return dict(setup=setup, step=statistics.median(times[1:] or times), loss=loss, trainable=trainable,
                states=states, ckpt=folder_bytes(trainer.last_checkpoint), path=trainer.last_checkpoint)


def cpu_demo(a) -> str:
    from opendit.checkpoint import export_weights, load_weights
    from opendit.encoders.tiny_clip import save_tiny_clip
    from opendit.families.flux.tiny_t5 import save_tiny_t5

    work = Path(a.work)
    if not (work / "t5" / "config.json").is_file():
        save_tiny_t5(work / "t5")
        save_tiny_clip(work / "clip", words="digits")
    base = cfglib.TrainConfig(model="flux-debug", dataset="captioned_digits", image_size=16, vae="none",
                              t5=str(work / "t5"), clip=str(work / "clip"), batch_size=a.batch_size, lr=1e-3,
                              ema_decay=0.995, max_steps=a.steps, ckpt_every=10 ** 9, log_every=10 ** 9,
                              num_workers=0, outputs=str(work / "full"))
    full = run(base, a.steps, cuda=False)
    weights = work / "base.safetensors"
    export_weights(str(weights), load_weights(str(Path(full["path"]) / "ema.safetensors")))
    lora = run(dataclasses.replace(base, outputs=str(work / "lora"), lora_rank=a.rank, init_weights=str(weights)),
               a.steps, cuda=False)
    rows = [("full fine-tune", full), (f"LoRA rank {a.rank}", lora)]
    lines = [f"# LoRA vs full fine-tune step: flux-debug, 16 px captioned digits, batch {a.batch_size}, fp32, "
             f"CPU ({torch.get_num_threads()} threads), torch {torch.__version__}", "",
             "| run | s/step | trainable parameters | optimizer states | checkpoint on disk |",
             "|---|---:|---:|---:|---:|"]
    for name, r in rows:
        lines.append(f"| {name} | {r['step']:.3f} | {r['trainable'] / 1e6:.3f}M | {r['states'] / 1e6:.2f} MB | "
                     f"{r['ckpt'] / 1e6:.2f} MB |")
    lines.append(f"| LoRA / full | {lora['step'] / full['step']:.2f} | {lora['trainable'] / full['trainable']:.3f} | "
                 f"{lora['states'] / full['states']:.3f} | {lora['ckpt'] / full['ckpt']:.3f} |")
    return "\n".join(lines)


def gpu_step(a) -> str:
    work = Path(a.work)
    write_synthetic_cache(work, a.model, a.image_size, a.t5_tokens, count=max(a.steps, 1))
    write_s = write_zero_base(work / "base.safetensors", a.model)
    cfg = cfglib.TrainConfig(model=a.model, dataset="latents", data_path=str(work / "cache"), batch_size=1,
                             max_steps=a.steps, log_every=1, ckpt_every=10 ** 9, num_workers=0, lr=1e-4,
                             outputs=str(work / "runs"), init_weights=str(work / "base.safetensors"),
                             lora_rank=a.rank, mixed_precision="bf16", grad_checkpoint=1, ema_decay=0.0,
                             base_dtype=a.base_dtype)
    setup_s, times, loss, host_gb = time_trainer_steps(cfg, a.steps, cuda=True)
    steady = times[1:] or times
    return "\n".join([
        f"# {a.model} LoRA rank {a.rank} step, {a.image_size}x{a.image_size}, batch 1, "
        f"{'bf16' if a.base_dtype == 'auto' else a.base_dtype} base, grad checkpointing",
        "", "| base file write s | set-up s (fingerprint, load) | first step s | steady s/step | peak GPU allocated "
            "GiB | peak host RSS GB | last loss |", "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {write_s:.0f} | {setup_s:.0f} | {times[0]:.2f} | {sum(steady) / len(steady):.2f} | "
        f"{torch.cuda.max_memory_allocated() / 2 ** 30:.1f} | {host_gb:.1f} | {loss:.4f} |"])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="flux-dev", help="--device cuda: the FLUX model")
    p.add_argument("--image_size", type=int, default=1024, help="--device cuda")
    p.add_argument("--t5_tokens", type=int, default=512, help="--device cuda")
    p.add_argument("--rank", type=int, default=None, help="LoRA rank (default: 8 on CPU, 16 on CUDA)")
    p.add_argument("--batch_size", type=int, default=64, help="CPU demo")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: 30 on CPU, 3 on CUDA)")
    p.add_argument("--base_dtype", default="auto", choices=["auto", "fp8"], help="--device cuda: train.py's flag")
    p.add_argument("--work", default="/tmp/lora_step")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    cuda = a.device == "cuda"
    a.rank = a.rank or (16 if cuda else 8)
    a.steps = a.steps or (3 if cuda else 30)
    text = gpu_step(a) if cuda else cpu_demo(a)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
