"""DiT training throughput, side by side in one process: the published recipe, a strong compiled baseline,
and our flags one by one and together.

    python benchmarks/train_throughput.py --model DiT-XL/2 --image_size 256 --batch_size 256 \
        --recipe_batch_size 32 --time_budget 270 --out results.md          # one H200, ~5 min
    python benchmarks/train_throughput.py --model DiT-debug --image_size 32 --batch_size 4 --device cpu \
        --skip_compile                                                      # CPU smoke run

Variants (keys for --variants):
  a            published DiT recipe: fp32 weights, TF32 matmuls, eager, torch AdamW (default, not fused)
  b            a + bf16 autocast + fused AdamW + torch.compile of the whole model
  all          ours: bf16 weights + fp32 master (fused AdamW), per-block compile, modulate + layernorm
               kernels, flash attention
  all-kernels  the same without the Triton kernels (inductor fuses those ops itself under compile)
  all-graphs   all, compiled with mode="reduce-overhead" (CUDA graphs per block: fewer kernel launches)
  c0           bf16 autocast + fused AdamW, eager: the base the single-flag rows below add one flag to
  modulate / layernorm / flash / bf16 / blocks   c0 + --enable_modulate_kernel / --enable_layernorm_kernel /
               --enable_flashattn / bf16 weights + fp32 master (replaces autocast) / per-block compile
Each variant builds a fresh model, trains `--warmup` steps (compilation happens here; its time is the
"warmup s" column), then `--steps` timed steps on one fixed batch of synthetic latents (no VAE, no data
loading). Training FLOPs count 3 x 2 x forward MACs (opendit.families.dit.family); MFU is against a bf16 matmul measured
in the same run. An OOM or any other failure becomes a row, not a crash; with --time_budget, variants
that would start after the budget are listed as skipped. The table is rewritten to --out after every row.
"""
import argparse
import logging
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from benchmarks.bench_common import failure_status, fmt, free, sync  # noqa: E402
from benchmarks.step_profile import format_profile, profile_step  # noqa: E402
from opendit import perf  # noqa: E402
from opendit.diffusion.objective import DiffusionObjective  # noqa: E402
from opendit.families import build_model  # noqa: E402
from opendit.families.dit.family import DIT_MODELS, dit_train_flops_per_image  # noqa: E402
from opendit.kernels import (
    kernel_status,  # noqa: E402
    set_kernels,
)
from opendit.kernels.attention import resolve_attention_backend  # noqa: E402
from opendit.training.fast_step import TrainStep  # noqa: E402

# key -> (label, TrainStep / model settings); run in this order (most important first, for --time_budget)
_C0 = dict(precision="autocast_bf16")
VARIANTS = {
    "a": ("a: published (fp32+TF32, eager)", dict(precision="fp32", fused_adamw=False)),
    "all": ("ours: all", dict(precision="bf16_master", compile="blocks", modulate=True, layernorm=True, flash=True)),
    "b": ("b: bf16 autocast + fused AdamW + compile", dict(precision="autocast_bf16", compile="model")),
    "all-kernels": ("ours: all - kernels", dict(precision="bf16_master", compile="blocks", flash=True)),
    "all-graphs": ("ours: all + CUDA graphs", dict(precision="bf16_master", compile="blocks", modulate=True,
                                                   layernorm=True, flash=True, compile_mode="reduce-overhead")),
    "c0": ("c0: bf16 autocast + fused AdamW, eager", _C0),
    "modulate": ("c0 + modulate kernel", dict(_C0, modulate=True)),
    "layernorm": ("c0 + layernorm kernel", dict(_C0, layernorm=True)),
    "flash": ("c0 + flash attention", dict(_C0, flash=True)),
    "bf16": ("c0 + bf16 weights / fp32 master", dict(precision="bf16_master")),
    "blocks": ("c0 + per-block compile", dict(_C0, compile="blocks")),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="DiT-XL/2", choices=list(DIT_MODELS))
    p.add_argument("--image_size", type=int, default=256, help="pixels; latents are image_size / 8")
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--recipe_batch_size", type=int, default=None,
                   help="batch of variant a (fp32 needs far more memory; DiT trained with 32 per GPU); "
                        "default --batch_size")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--skip_compile", action="store_true", help="list compiled variants as skipped (slow on CPU)")
    p.add_argument("--compile_backend", default="inductor")
    p.add_argument("--compile_mode", default=None, help='e.g. "max-autotune-no-cudagraphs" or "reduce-overhead"')
    p.add_argument("--num_classes", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--matmul_n", type=int, default=None,
                   help="side of the peak matmul (default 8192 on CUDA, 256 on CPU)")
    p.add_argument("--peak_tflops", type=float, default=None, help="use this peak instead of measuring one")
    p.add_argument("--time_budget", type=float, default=0.0, help="seconds; 0 = no limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the markdown table here")
    p.add_argument("--profile", default=None, choices=list(VARIANTS),
                   help="after timing this variant, profile 2 more steps: device time by kind of kernel")
    p.add_argument("--profile_out", default=None, help="write the profile here (else stdout)")
    return p.parse_args(argv)


def _notes(spec, backend, device):
    notes = [f"attn={backend}"]
    if spec.get("modulate") or spec.get("layernorm"):
        notes.append(kernel_status(True, device).split(";")[0].removeprefix("kernels: "))
    return "; ".join(notes)


def run_variant(spec, args, device, latent, batch, profile_title=None):
    """Build, warm up and time one variant -> dict of measurements (raises on OOM / failure). With
    profile_title, two more steps run under the profiler and the row gets a "profile" (markdown)."""
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = build_model(args.model, input_size=latent, in_channels=4, num_classes=args.num_classes)
    backend = resolve_attention_backend(spec.get("flash", False), device)
    set_kernels(model, modulate=spec.get("modulate", False), layernorm=spec.get("layernorm", False),
                      attn_backend=backend)
    model.train()
    step = TrainStep(model, DiffusionObjective(), precision=spec["precision"], lr=args.lr,
                     fused_adamw=spec.get("fused_adamw", True), compile=spec.get("compile"),
                     compile_backend=args.compile_backend, compile_mode=spec.get("compile_mode", args.compile_mode))
    g = torch.Generator(device).manual_seed(args.seed)
    x = torch.randn(batch, 4, latent, latent, device=device, generator=g)  # synthetic, VAE-scaled-like latents
    cond = {"y": torch.randint(0, args.num_classes, (batch,), device=device, generator=g)}
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step(x, cond)
    sync(device)
    t1 = time.perf_counter()
    for _ in range(args.steps):
        loss = step(x, cond)
    sync(device)
    dt = time.perf_counter() - t1
    loss = loss.item()
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else float("nan")
    profile = format_profile(profile_step(step, x, cond), profile_title) if profile_title else None
    return dict(profile=profile, status="ok" if math.isfinite(loss) else f"non-finite loss {loss}", batch=batch,
                img_per_s=batch * args.steps / dt, ms_per_step=1e3 * dt / args.steps, peak_mem_gib=peak,
                warmup_s=t1 - t0, loss=loss, notes=_notes(spec, backend, device))


def format_table(rows, header_lines):
    base = {r["key"]: r["img_per_s"] for r in rows if r["status"] == "ok"}
    out = header_lines + ["", "| variant | batch | img/s | ms/step | TFLOP/s | MFU | peak mem GiB | x vs a | "
                              "x vs b | warmup s | status / notes |",
                          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ok = r["status"] == "ok"
        vs = [fmt(r["img_per_s"] / base[k], ".2f") if ok and k in base else "-" for k in ("a", "b")]
        out.append(f"| {r['variant']} | {r.get('batch', '-')} | {fmt(r.get('img_per_s'), '.4g')} | "
                   f"{fmt(r.get('ms_per_step'), '.4g')} | {fmt(r.get('tflops'), '.4g')} | {fmt(r.get('mfu'), '.1%')} | "
                   f"{fmt(r.get('peak_mem_gib'))} | {vs[0]} | {vs[1]} | {fmt(r.get('warmup_s'))} | "
                   f"{r['status'] if not ok else ''}{'; ' if not ok and r.get('notes') else ''}{r.get('notes', '')} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available; pass --device cpu for a smoke run")
    if device.type == "cuda":  # TF32 matmuls and convolutions, as the published recipe enables (CPU: no TF32)
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
    if args.image_size % 8:
        raise SystemExit(f"--image_size {args.image_size} must be a multiple of 8 (the VAE's downsampling)")
    latent = args.image_size // 8
    flops = dit_train_flops_per_image(args.model, args.image_size)
    if args.peak_tflops:
        peak, peak_src = args.peak_tflops * 1e12, "given"
    else:
        n = args.matmul_n or (8192 if device.type == "cuda" else 256)
        peak, peak_src = perf.measure_bf16_matmul_peak(device, n=n), f"bf16 {n}^3 matmul measured"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    header = [f"# Training throughput: {args.model} at {args.image_size}px ({latent}x{latent} latents), one {name}",
              "", f"torch {torch.__version__}; {args.warmup} warm-up + {args.steps} timed steps; "
              f"{flops / 1e9:.4g} GFLOP per training image; peak {peak / 1e12:.1f} TFLOP/s ({peak_src})"]
    rows, start = [], time.perf_counter()
    for key in [k for k in VARIANTS if k in args.variants]:
        label, spec = VARIANTS[key]
        row = dict(key=key, variant=label)
        batch = args.recipe_batch_size if key == "a" and args.recipe_batch_size else args.batch_size
        if args.skip_compile and spec.get("compile"):
            row["status"] = "skipped (--skip_compile)"
        elif args.time_budget and time.perf_counter() - start > args.time_budget:
            row["status"] = f"skipped (--time_budget {args.time_budget:.0f} s spent)"
        else:
            torch._dynamo.reset()  # fresh compile caches: no recompile limit carried over between variants
            free(device)
            try:
                title = f"Where the step's time goes: {label}, {args.model}, batch {batch}, {name}"
                row.update(run_variant(spec, args, device, latent, batch, title if key == args.profile else None))
                if row["profile"]:
                    print(row["profile"], flush=True)
                    if args.profile_out:
                        Path(args.profile_out).write_text(row["profile"])
                row["tflops"] = row["img_per_s"] * flops / 1e12
                row["mfu"] = perf.mfu(row["img_per_s"] * flops, peak)
            except torch.OutOfMemoryError:
                row.update(status="OOM", batch=batch)
            except Exception as e:  # a failing variant must not cost the other rows
                traceback.print_exc()
                row.update(status=failure_status(e),
                           batch=batch)
            free(device)
        rows.append(row)
        print(f"{label}: {row['status']} {fmt(row.get('img_per_s'))} img/s", file=sys.stderr, flush=True)
        if args.out:
            Path(args.out).write_text(format_table(rows, header))
    table = format_table(rows, header)
    print(table, flush=True)
    return rows


if __name__ == "__main__":
    main()
