"""A full fine-tune of flux-dev at 1024x1024 on one GPU capped at 16 GiB: train.py's own Trainer with the lean options,
on a synthetic FLUX cache (latents and T5 / CLIP embeddings of random values, so no encoder, weights or data need
downloading), starting from a base of zeros (a random init of 12B parameters on the host takes minutes; --base
reuses a file already written, e.g. lora_step.py's). Reports seconds per step, peak GPU memory (allocated and
reserved) and peak host memory, beside the sd-scripts recipe's published 32 GB card at about 12 s per image.

    python benchmarks/flux_lean_step.py --out flux_lean.md                        # GPU: flux-dev, 1024 px, 16 GiB
    python benchmarks/flux_lean_step.py --model flux-debug --image_size 64 --device cpu --steps 2   # CPU smoke

The options are RECIPE=finetune's in train_flux.sh: bf16 weights with the bf16_exact master, u16 AdamW states
on the host, fused backward, activation checkpointing, --blocks_to_swap, no EMA. Values are synthetic, so only
time and memory mean anything; the loss is printed to show the step ran.
"""
import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import write_zero_base  # noqa: E402
from opendit import config as cfglib  # noqa: E402
from opendit.data.latents import CACHE_VERSION, MANIFEST  # noqa: E402
from opendit.families.flux.model import FLUX_CONFIGS  # noqa: E402

LEAN = dict(mixed_precision="bf16", master_weights="bf16_exact", optimizer_offload=True, optimizer_state_dtype="u16",
            fused_backward=True, grad_checkpoint=1, ema_decay=0.0)


def time_lean_steps(work: Path, model: str, steps: int, blocks_to_swap: int, cuda: bool,
                    base: Path | None = None):
    """train.py's Trainer with the LEAN options on the synthetic cache under work/cache, from the weights file
    `base` (random weights without one): `steps` steps of batch 1 -> (set-up seconds, seconds of each step, the last
    loss, peak host RSS in GB)."""
    cfg = cfglib.TrainConfig(model=model, dataset="latents", data_path=str(work / "cache"), batch_size=1,
                             max_steps=steps, log_every=1, ckpt_every=10 ** 9, num_workers=0, lr=1e-5,
                             outputs=str(work / "runs"), blocks_to_swap=blocks_to_swap,
                             init_weights=str(base) if base else None, **LEAN)
    return time_trainer_steps(cfg, steps, cuda)


def time_trainer_steps(cfg, steps: int, cuda: bool):
    """train.py's Trainer of `cfg`: `steps` timed steps -> (set-up seconds, seconds of each step, the last loss,
    peak host RSS in GB)."""
    from opendit.training.loop import Trainer

    t0 = time.time()
    trainer = Trainer(cfg)
    setup_s = time.time() - t0
    times, loss = time_steps(trainer, steps, cuda)
    return setup_s, times, loss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def time_steps(trainer, steps: int, cuda: bool) -> tuple[list[float], float]:
    """`steps` train_steps of the trainer's own batches -> (seconds of each, the last loss)."""
    times, loader, loss = [], iter(trainer.loader), float("nan")
    for _ in range(steps):
        batch = next(loader, None)
        if batch is None:  # the epoch ended: the next one, as the training loop goes on
            trainer.loader.set_epoch(trainer.loader.sampler.epoch + 1)
            loader = iter(trainer.loader)
            batch = next(loader)
        t = time.time()
        loss = float(trainer.train_step(batch)[0])
        if cuda:
            torch.cuda.synchronize()
        times.append(time.time() - t)
    return times, loss


def synthetic_text_widths(model: str) -> dict:
    """The T5 and CLIP widths of the synthetic cache (the model's, or the tiny encoders' 64 and 32)."""
    arch = FLUX_CONFIGS[model]
    return dict(context_in_dim=arch.get("context_in_dim", 64), vec_in_dim=arch.get("vec_in_dim", 32))


def write_synthetic_cache(folder: Path, model: str, image_size: int, t5_tokens: int, count: int) -> None:
    """A preprocess.py-layout FLUX cache of `count` items with random values, plus stub encoder configs (the
    model's text widths are read from them)."""
    widths = synthetic_text_widths(model)
    t5_dim, clip_dim = widths["context_in_dim"], widths["vec_in_dim"]
    (folder / "t5").mkdir(parents=True, exist_ok=True)
    (folder / "clip").mkdir(exist_ok=True)
    (folder / "t5" / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": t5_dim}))
    (folder / "clip" / "config.json").write_text(json.dumps({"model_type": "clip_text_model",
                                                              "hidden_size": clip_dim}))
    cache = folder / "cache"
    cache.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    side = image_size // 8
    arrays = dict(mean=rng.standard_normal((count, 16, side, side), dtype=np.float32),
                  std=np.full((count, 16, side, side), 0.05, dtype=np.float32),
                  label=np.zeros(count, dtype=np.int64), caption=np.array(["a photo"] * count),
                  t5=rng.standard_normal((count, t5_tokens, t5_dim), dtype=np.float32).astype(np.float16),
                  clip=rng.standard_normal((count, clip_dim), dtype=np.float32).astype(np.float16))
    for key, value in arrays.items():
        np.save(cache / f"r000-00000.{key}.npy", value)
    np.save(cache / "extra.empty_t5.npy", np.zeros((t5_tokens, t5_dim), dtype=np.float16))
    np.save(cache / "extra.empty_clip.npy", np.zeros(clip_dim, dtype=np.float16))
    manifest = dict(version=CACHE_VERSION, family="flux", vae="synthetic", vae_scale=0.3611, image_size=image_size,
                    latent_shape=[16, side, side], num_classes=0, classes=[], count=count, skipped=0,
                    flip_both=False, dtype="float16", captions=True, embeddings=["t5", "clip"],
                    extras=["empty_clip", "empty_t5"], t5=str(folder / "t5"), clip=str(folder / "clip"),
                    t5_max_length=t5_tokens, source={}, shards=[{"stem": "r000-00000", "count": count,
                                                                 "captions": True, "embeddings": ["t5", "clip"]}])
    (cache / MANIFEST).write_text(json.dumps(manifest))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux-dev")
    p.add_argument("--image_size", type=int, default=1024)
    p.add_argument("--t5_tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (batch 1); the first includes warm-up")
    p.add_argument("--blocks_to_swap", type=int, default=45)
    p.add_argument("--budget_gib", type=float, default=16.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--work", default="/tmp/flux_lean")
    p.add_argument("--base", default=None, help="a zero base already written (default: written under --work)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    work = Path(a.work)
    write_synthetic_cache(work, a.model, a.image_size, a.t5_tokens, count=max(a.steps, 1))
    base = Path(a.base) if a.base else work / "base.safetensors"
    if not base.is_file():
        write_zero_base(base, a.model, **synthetic_text_widths(a.model))
    cuda = a.device == "cuda"
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.budget_gib * 2 ** 30 / total))
    setup_s, times, loss, host_gb = time_lean_steps(work, a.model, a.steps, a.blocks_to_swap, cuda, base)
    gpu = (torch.cuda.max_memory_allocated() / 2 ** 30, torch.cuda.max_memory_reserved() / 2 ** 30) if cuda else (0, 0)
    steady = times[1:] or times
    lines = [f"# {a.model} full fine-tune step, {a.image_size}x{a.image_size}, batch 1, {a.device}"
             + (f" capped at {a.budget_gib:g} GiB" if cuda else ""), "",
             f"options: {' '.join(f'--{k} {v}' for k, v in LEAN.items())} --blocks_to_swap {a.blocks_to_swap}; "
             f"synthetic cache, a base of zeros; torch {torch.__version__}", "",
             "| set-up s | first step s | steady s/step | peak GPU allocated GiB | peak GPU reserved GiB | "
             "peak host RSS GB | last loss | sd-scripts recipe (published) |",
             "|---:|---:|---:|---:|---:|---:|---:|---|",
             f"| {setup_s:.0f} | {times[0]:.1f} | {sum(steady) / len(steady):.1f} | {gpu[0]:.1f} | {gpu[1]:.1f} | "
             f"{host_gb:.1f} | {loss:.4f} | 32 GB card, ~12 s per 1024² image |"]
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
