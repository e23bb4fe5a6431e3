"""A full fine-tune of Wan2.1-T2V-1.3B (or Wan2.2-TI2V-5B, or one A14B expert) on one GPU with the lean options:
train.py's own Trainer on a synthetic Wan cache (Wan-VAE latents and UMT5 embeddings of random values, so no
encoder, weights or data need downloading), random initial weights (--base: a file of zeros). Reports seconds per
step, peak GPU memory (allocated and reserved) and peak host memory, beside what benchmarks/wan_memory.py plans for
the same model, clip and options.

    python benchmarks/wan_lean_step.py --out wan_lean.md                      # GPU: 1.3B, 33 x 480 x 480
    python benchmarks/wan_lean_step.py --num_frames 81 --height 480 --width 832     # the full-size clip
    python benchmarks/wan_lean_step.py --model Wan2.2-TI2V-5B --num_frames 49 --height 704 --width 704
    python benchmarks/wan_lean_step.py --model Wan-debug --num_frames 5 --height 64 --width 64 --device cpu \\
        --steps 2 --blocks_to_swap 1                                          # CPU smoke

The options are flux_lean_step.py's LEAN (RECIPE=finetune of train_flux.sh): bf16 weights with the bf16_exact
master, u16 AdamW states on the host, fused backward, activation checkpointing every block, no EMA; plus
--blocks_to_swap (default 0). Attention is SDPA (flash on a recent GPU). Values are random, so only time and
memory mean anything; the loss is printed to show the step ran. --budget_gib caps the GPU memory the process may
allocate (torch.cuda.set_per_process_memory_fraction); 0 (the default) leaves the whole GPU.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import write_zero_base  # noqa: E402
from benchmarks.flux_lean_step import LEAN, time_lean_steps  # noqa: E402
from benchmarks.wan_memory import ARCHS, GB, WanPlan, vae_space  # noqa: E402
from opendit.data.latents import CACHE_VERSION, MANIFEST  # noqa: E402
from opendit.families.wan.family import WAN_CONSTANTS  # noqa: E402

MODELS = [n for n, arch in ARCHS.items() if arch.get("model_type") != "i2v"]  # an I2V cache also needs its condition


def write_synthetic_cache(folder: Path, model: str, num_frames: int, height: int, width: int, count: int) -> list:
    """A preprocess.py --family wan layout cache of `count` clips with random values, plus a stub UMT5 config (the
    model's text width is read from it) -> the latent shape [C, T', h, w]."""
    arch, space = ARCHS[model], vae_space(model)
    text_len, text_dim = arch["text_len"], arch["text_dim"]
    umt5 = folder / "umt5"
    umt5.mkdir(parents=True, exist_ok=True)
    (umt5 / "config.json").write_text(json.dumps({"model_type": "umt5", "d_model": text_dim}))
    cache = folder / "cache"
    cache.mkdir(exist_ok=True)
    shape = [WAN_CONSTANTS[model]["vae_channels"], 1 + (num_frames - 1) // 4, height // space, width // space]
    rng = np.random.default_rng(0)
    arrays = dict(mean=rng.standard_normal((count, *shape), dtype=np.float32),
                  std=np.full((count, *shape), 0.05, dtype=np.float32),
                  label=np.zeros(count, dtype=np.int64), caption=np.array(["a clip"] * count),
                  umt5=rng.standard_normal((count, text_len, text_dim), dtype=np.float32).astype(np.float16))
    for key, value in arrays.items():
        np.save(cache / f"r000-00000.{key}.npy", value)
    np.save(cache / "extra.empty_umt5.npy", np.zeros((text_len, text_dim), dtype=np.float16))
    manifest = dict(version=CACHE_VERSION, family="wan", vae="synthetic", vae_scale=1.0, image_size=height,
                    latent_shape=shape, num_classes=0, classes=[], count=count, skipped=0, flip_both=False,
                    dtype="float16", captions=True, embeddings=["umt5"], extras=["empty_umt5"],
                    num_frames=num_frames, frame_interval=1, umt5=str(umt5), source={},
                    shards=[{"stem": "r000-00000", "count": count, "captions": True, "embeddings": ["umt5"]}])
    (cache / MANIFEST).write_text(json.dumps(manifest))
    return shape


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Wan2.1-T2V-1.3B", choices=MODELS)
    p.add_argument("--num_frames", type=int, default=33, help="1 + 4k frames")
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=480)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (batch 1); the first includes warm-up")
    p.add_argument("--blocks_to_swap", type=int, default=0)
    p.add_argument("--budget_gib", type=float, default=0.0, help="cap on the GPU memory; 0: none")
    p.add_argument("--device", default="cuda")
    p.add_argument("--work", default="/tmp/wan_lean")
    p.add_argument("--base", default=None, help="start from this weights file, written as zeros when missing (no "
                                                "random init of billions of parameters on the host); default: random")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    plan = WanPlan(a.model)
    grid, tokens = plan.tokens(a.num_frames, a.height, a.width)  # checks the geometry before any work
    planned = sum(plan.lean(a.blocks_to_swap, tokens)["gpu"].values())
    work = Path(a.work)
    write_synthetic_cache(work, a.model, a.num_frames, a.height, a.width, count=max(a.steps, 1))
    cuda = a.device == "cuda"
    if cuda and a.budget_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.budget_gib * 2 ** 30 / total))
    base = Path(a.base) if a.base else None
    if base is not None and not base.is_file():
        write_zero_base(base, a.model)
    setup_s, times, loss, host_gb = time_lean_steps(work, a.model, a.steps, a.blocks_to_swap, cuda, base)
    gpu = (torch.cuda.max_memory_allocated() / GB, torch.cuda.max_memory_reserved() / GB) if cuda else (0, 0)
    steady = times[1:] or times
    options = " ".join(f"--{k} {v}" for k, v in LEAN.items()) + f" --blocks_to_swap {a.blocks_to_swap}"
    lines = [f"# {a.model} full fine-tune step, {a.num_frames} x {a.height} x {a.width} (patch grid {grid}: "
             f"{tokens} video tokens), batch 1, {a.device}" + (f" capped at {a.budget_gib:g} GiB" if a.budget_gib
                                                                else ""), "",
             f"options: {options}; synthetic cache, {'a base of zeros' if base else 'random weights'}; "
             f"torch {torch.__version__}; GB = 1e9 bytes", "",
             "| set-up s | first step s | steady s/step | peak GPU allocated GB | peak GPU reserved GB | "
             "planned GPU GB (wan_memory.py) | peak host RSS GB | last loss |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| {setup_s:.0f} | {times[0]:.2f} | {sum(steady) / len(steady):.2f} | {gpu[0]:.2f} | {gpu[1]:.2f} | "
             f"{planned / GB:.2f} | {host_gb:.1f} | {loss:.4f} |"]
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
