"""DiT sampling throughput, side by side in one process: the public DiT sampler's settings, a strong compiled
baseline, and what sample.py runs with our flags; how far each one's samples move from the first's.

    python benchmarks/sample_throughput.py --model DiT-XL/2 --image_size 256 --batch_size 256 \
        --steps 10 --time_budget 60 --out sampling.md                    # one H200, ~1.5 min (estimate)
    python benchmarks/sample_throughput.py --model DiT-debug --image_size 64 --batch_size 2 --steps 2 \
        --device cpu --skip_compile                                       # CPU smoke run, seconds

Variants (keys for --variants; they run in the order given, most important first for --time_budget):
  a               the public DiT sampler: fp32 weights, TF32 matmuls, eager
  ours            sample.py --mixed_precision bf16 --compile --enable_modulate_kernel --enable_layernorm_kernel
                  --enable_flashattn: bf16 weights, per-block compile, Triton kernels, flash attention
  b               a + bf16 autocast + torch.compile of the whole model (fp32 weights)
  ours-nokernels  ours without the Triton kernels (under compile, inductor fuses those ops itself)
Everything goes through the model-family seam (family.build_model / make_sampler / sample_latents), as
sample.py does, minus the checkpoint: the weights are the family's init plus N(0, 0.02) noise from --seed
(adaLN-Zero alone makes DiT's output exactly 0), identical in every variant, and there is no VAE, so the
sampler's latents are compared directly. Each variant samples --warmup_steps steps once (compilation happens
here; "warmup s"), then --steps timed steps of the same batch: same noise, labels 0..batch-1, classifier-free
guidance at --cfg_scale (the model sees 2 x batch per step). An OOM or other failure is a row, not a crash;
variants that would start after --time_budget are listed as skipped; --out is rewritten after every row.
--skip_compile lists b (whole-model compile is all it adds) as skipped and runs ours without its compile.
"""
import argparse
import contextlib
import dataclasses
import logging
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from benchmarks.bench_common import failure_status, fmt, free, sync  # noqa: E402
from opendit.booster.parallelize import apply_compile  # noqa: E402
from opendit.booster.precision import set_tf32  # noqa: E402
from opendit.config import SampleConfig, TrainConfig  # noqa: E402
from opendit.diffusion import SAMPLERS  # noqa: E402
from opendit.families import LoadedModel, all_models, check_model_contract, family_of  # noqa: E402
from opendit.inference import complete_sample_config, speed_up  # noqa: E402
from opendit.kernels import configure_kernels, kernel_status  # noqa: E402

# key -> (label, settings): weights = speed_up's mixed_precision; autocast = bf16 autocast around the sampler;
# compile = "blocks" (speed_up's per-block compile) or "model" (nn.Module.compile of the whole DiT)
VARIANTS = {
    "a": ("a: DiT sampler (fp32+TF32, eager)", dict(weights="fp32")),
    "ours": ("ours: bf16 weights, block compile, kernels, flash",
             dict(weights="bf16", compile="blocks", modulate=True, layernorm=True, flash=True)),
    "b": ("b: bf16 autocast + whole-model compile", dict(weights="fp32", autocast=True, compile="model")),
    "ours-nokernels": ("ours - kernels", dict(weights="bf16", compile="blocks", flash=True)),
}
EXTRAPOLATE_STEPS = 250  # the DiT paper's sampler: img/s is quoted for 250 steps


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="DiT-XL/2", choices=list(all_models()))
    p.add_argument("--image_size", type=int, default=256, help="pixels; the sampled latents are image_size / 8")
    p.add_argument("--batch_size", type=int, default=256, help="images per call (the model sees 2x with cfg)")
    p.add_argument("--cfg_scale", type=float, default=4.0, help="1: no guidance (the model sees the batch once)")
    p.add_argument("--sampler", default="ddpm", choices=SAMPLERS)
    p.add_argument("--steps", type=int, default=10, help="timed sampling steps (250 would take ~1 min a variant)")
    p.add_argument("--warmup_steps", type=int, default=2, help="untimed sampling steps first (compilation)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   help="run in this order; a key given twice runs twice (a vs a: is the run reproducible?)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--skip_compile", action="store_true", help="skip b, run ours uncompiled (slow on CPU)")
    p.add_argument("--compile_backend", default="inductor", help="aot_eager / eager: trace without inductor")
    p.add_argument("--compile_mode", default=None, help='e.g. "max-autotune-no-cudagraphs" or "reduce-overhead"')
    p.add_argument("--num_classes", type=int, default=1000)
    p.add_argument("--time_budget", type=float, default=0.0, help="seconds; 0 = no limit")
    p.add_argument("--seed", type=int, default=0, help="the weights' and the sampler's seed")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    args = p.parse_args(argv)
    if args.image_size <= 0 or args.image_size % 8:
        p.error(f"--image_size {args.image_size} must be a positive multiple of 8 (the VAE's downsampling), "
                f"e.g. {max(8, args.image_size // 8 * 8)}")
    if args.steps < 1 or args.warmup_steps < 0 or args.batch_size < 1:
        p.error("--steps and --batch_size must be >= 1 and --warmup_steps >= 0")
    return args


def setup(args, device):
    """(family, run cfg, encoders, latent shape) as sample.py's load_model derives them, minus the checkpoint.
    vae "none": the model's own space is the sampled one, so image_size here is the latent side."""
    family = family_of(args.model)
    latent = args.image_size // 8
    settings = {"model": args.model, "image_size": latent, "num_classes": args.num_classes, "vae": "none",
                "dataset": "folder"}
    run = family.sampling_config(TrainConfig(**settings), given=set(settings))
    encoders = family.load_encoders(run, device, training=False)
    try:
        shape = family.latent_shape(run, encoders, data_channels=4)  # SD-VAE latents: (4, 32, 32) at 256 px
    except ValueError as e:
        raise SystemExit(f"--image_size {args.image_size} px gives {latent}x{latent} latents that {args.model} "
                         f"cannot take ({e}); pick a size whose latents fit the model's patch") from None
    return family, run, encoders, shape


def build(family, run, shape, spec, args, device):
    """The variant's model: identical random weights in every variant, then sample.py's speed-ups."""
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = family.build_model(run, shape)
    check_model_contract(model, args.model)
    g = torch.Generator(device).manual_seed(args.seed + 1)
    with torch.no_grad():  # adaLN-Zero zeroes the gates and the final layer: their output would be exactly 0
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g, device=device), alpha=0.02)
    configure_kernels(model, spec.get("modulate", False), spec.get("layernorm", False), spec.get("flash", False),
                      device)
    compile = None if args.skip_compile else spec.get("compile")
    # speed_up(compile=True) is apply_compile(model) with inductor's defaults; called here to pass --compile_*
    model = speed_up(model.eval(), spec["weights"], compile=False)
    if compile == "blocks":
        apply_compile(model, args.compile_backend, args.compile_mode)
    elif compile == "model":
        model.compile(backend=args.compile_backend, mode=args.compile_mode)
    return model


def _notes(model, spec, args, device):
    backend = next((m.attn_backend for m in model.modules() if hasattr(m, "attn_backend")), "?")
    fell_back = spec.get("flash") and backend != "flash"  # resolve_attention_backend logged the reason
    notes = [f"attn={backend}" + (" (--enable_flashattn fell back: flash-attn unavailable)" if fell_back else "")]
    if spec.get("modulate") or spec.get("layernorm"):
        notes.append(kernel_status(True, device).split(";")[0].removeprefix("kernels: "))
    if args.skip_compile and spec.get("compile") == "blocks":
        notes.append("not compiled (--skip_compile)")
    return "; ".join(notes)


def run_variant(spec, args, device, ctx, batch):
    """Build, warm up and time one variant -> dict of measurements and its latents z (raises on failure)."""
    family, run, encoders, shape = ctx
    model = build(family, run, shape, spec, args, device)
    loaded = LoadedModel(family, model, encoders, run, shape, "random")
    timed = complete_sample_config(family, SampleConfig(cfg_scale=args.cfg_scale, num_sampling_steps=args.steps,
                                                        sampler=args.sampler, seed=args.seed,
                                                        mixed_precision=spec["weights"]), run)
    labels = list(range(run.num_classes))  # sample i gets class i
    # the latents stand for SD-VAE ones, which DiT's sampler never clamps (only pixel-space runs clamp x_0)
    latent_run = dataclasses.replace(run, vae="stabilityai/sd-vae-ft-ema")

    def sample(cfg):  # -> float32 [batch, *shape] on device; noise depends only on (seed, indices)
        amp = torch.autocast(device.type, torch.bfloat16) if spec.get("autocast") else contextlib.nullcontext()
        with amp:
            sampler = family.make_sampler(cfg, latent_run)
            return family.sample_latents(loaded, sampler, range(batch), labels, cfg, device)

    t0 = time.perf_counter()
    if args.warmup_steps:
        sample(dataclasses.replace(timed, num_sampling_steps=args.warmup_steps))
    sync(device)
    t1 = time.perf_counter()
    z = sample(timed)
    sync(device)
    dt = time.perf_counter() - t1
    z = z.float().cpu()
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else float("nan")
    ms = 1e3 * dt / args.steps
    return dict(status="ok" if torch.isfinite(z).all() else "non-finite latents", batch=batch, z=z, ms_per_step=ms,
                img_per_s=batch / (ms * EXTRAPOLATE_STEPS / 1e3), peak_mem_gib=peak, warmup_s=t1 - t0,
                notes=_notes(model, spec, args, device))


def format_table(rows, header_lines):
    base = {r["key"]: r["ms_per_step"] for r in reversed(rows) if r["status"] == "ok"}  # first run of a key
    out = header_lines + ["", f"| variant | batch | steps | ms/step | img/s @{EXTRAPOLATE_STEPS} steps | x vs a | "
                              "x vs b | peak mem GiB | warmup s | max abs diff vs a | mean abs diff vs a | "
                              "status / notes |",
                          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ok = r["status"] == "ok"
        vs = [fmt(base[k] / r["ms_per_step"], ".2f") if ok and k in base else "-" for k in ("a", "b")]
        out.append(f"| {r['variant']} | {r.get('batch', '-')} | {r.get('steps', '-')} | "
                   f"{fmt(r.get('ms_per_step'), '.4g')} | {fmt(r.get('img_per_s'), '.4g')} | {vs[0]} | {vs[1]} | "
                   f"{fmt(r.get('peak_mem_gib'))} | {fmt(r.get('warmup_s'))} | {fmt(r.get('max_diff'), '.3g')} | "
                   f"{fmt(r.get('mean_diff'), '.3g')} | {r['status'] if not ok else ''}"
                   f"{'; ' if not ok and r.get('notes') else ''}{r.get('notes', '')} |")
    ref = next((r for r in rows if r["key"] == "a" and "ref_scale" in r), None)
    if ref:  # what the differences compare to
        out += ["", f"Latents of a: mean |z| = {ref['ref_scale'][0]:.3g}, max |z| = {ref['ref_scale'][1]:.3g}."]
    return "\n".join(out) + "\n"


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available; pass --device cpu for a smoke run")
    set_tf32(device)  # as sample.py: TF32 for every fp32 matmul (variant a's; b's and ours' are bf16)
    ctx = setup(args, device)
    shape = ctx[3]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    cfg = f"cfg {args.cfg_scale:g} (the model sees 2 x batch per step)" if args.cfg_scale > 1 else "no cfg"
    header = [f"# Sampling throughput: {args.model} at {args.image_size}px ({'x'.join(map(str, shape))} latents), "
              f"one {name}", "", f"torch {torch.__version__}; {args.sampler} sampler through the model family, "
              f"{cfg}; {args.warmup_steps} warm-up + {args.steps} timed steps; random weights (seed {args.seed}); "
              f"img/s extrapolated to {EXTRAPOLATE_STEPS} steps"]
    rows, start, ref = [], time.perf_counter(), None
    for key in args.variants:
        label, spec = VARIANTS[key]
        row = dict(key=key, variant=label, batch=args.batch_size, steps=args.steps)
        if args.skip_compile and spec.get("compile") == "model":
            row["status"] = "skipped (--skip_compile)"
        elif args.time_budget and time.perf_counter() - start > args.time_budget:
            row["status"] = f"skipped (--time_budget {args.time_budget:.0f} s spent)"
        else:
            torch._dynamo.reset()  # fresh compile caches: no recompile limit carried over between variants
            free(device)
            try:
                row.update(run_variant(spec, args, device, ctx, args.batch_size))
                z = row.pop("z")
                if ref is None and key == "a" and row["status"] == "ok":
                    ref = z
                    row["ref_scale"] = (z.abs().mean().item(), z.abs().max().item())
                if ref is not None:
                    diff = (z - ref).abs()
                    row.update(max_diff=diff.max().item(), mean_diff=diff.mean().item())
            except torch.OutOfMemoryError:
                row["status"] = "OOM"
            except Exception as e:  # a failing variant must not cost the other rows
                traceback.print_exc()
                row["status"] = failure_status(e)
            free(device)
        rows.append(row)
        print(f"{label}: {row['status']} {fmt(row.get('ms_per_step'))} ms/step", file=sys.stderr, flush=True)
        if args.out:
            Path(args.out).write_text(format_table(rows, header))
    print(format_table(rows, header), flush=True)
    return rows


if __name__ == "__main__":
    main()
