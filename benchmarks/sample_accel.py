"""Step caches' speed against quality on the CPU demos (DiT digits, FLUX captioned digits, the Latte moving digits,
Wan2.2 image-to-video on the moving digits): every demo's samples drawn from THE SAME noise (--seed, the same labels,
prompts or first frames) with `--cache none` and each cache that applies, in one process, beside the quality
benchmarks' independent classifiers.

    python benchmarks/sample_accel.py --digits_ckpt outputs/digits_quality/000-DiT-Ti-4/checkpoints/step-001000 \\
        --flux_ckpt outputs/flux_quality/000-flux-debug/checkpoints/step-002000 \\
        --video_ckpt outputs/video_quality/000-Latte-Ti-4/checkpoints/step-001500 \
        --wan_i2v_ckpt outputs/video_quality/000-Wan2.2-I2V-debug/checkpoints/step-005000   # the measured table
    python benchmarks/sample_accel.py                      # no checkpoints: trains each demo's recipe first
    python benchmarks/sample_accel.py --demos digits --train_steps 3 --train_batch_size 8 --samples_per_class 1 \\
        --sampling_steps 4 --rows none teacache:0.1        # smoke run

Rows (--rows): `none` (the reference; always run, first), `teacache:T` and `fbcache:T` (T: --cache_threshold),
`pab:S,T,C` (--pab_spatial_every, --pab_temporal_every, --pab_cross_every; the video demo only). Default per demo:
none, teacache and fbcache at 0.5x, 1x and 2x the family's default threshold, and for the video demo pab at 2,4,6
(sample.py's default) and 4,8,12.

Per row: wall-clock seconds of sampling all of the demo's samples and the speed-up against none (every row in this
one process, after one untimed warm-up batch, on the threads the header names); the share of block (PAB: attention)
evaluations the cache skipped (its own counters, summed over the batches); the PSNR of the uint8 samples against
none's (inf: identical; JSON `Infinity`); and the share of samples the demo's classifier (the quality benchmarks',
trained on real digits only) names as their label's or prompt's digit (video: per frame). Writes sample_accel.md
and sample_accel.json under --out after every demo.

The families' default thresholds (ModelFamily.cache_thresholds) are chosen from this table (benchmarks/README.md).
"""
import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import digits_quality, flux_quality, video_quality  # noqa: E402
from opendit import config as cfglib  # noqa: E402
from opendit.data.captions import DIGIT_WORDS  # noqa: E402

PAB_EVERY = ("pab_spatial_every", "pab_temporal_every", "pab_cross_every")
THRESHOLD_SCALES = (0.5, 1.0, 2.0)  # of the family's default: around it, both ways


@dataclass(frozen=True)
class Demo:
    """recipe(outputs): the TrainConfig fields of the demo's training recipe; sample: the SampleConfig fields its
    quality benchmark samples with; conditions: sample i's is conditions[i % 10] (digit i % 10), or None for
    image-to-video (sample i: held-out clip i's first frame and caption, its digit the image's);
    classifier(run config) -> accuracy(uint8 samples, wanted digits)."""
    recipe: Callable[[Path], dict]
    sample: dict
    conditions: list | None
    classifier: Callable
    pab: bool = False


def digit_accuracy(run):
    clf, _ = digits_quality.train_classifier(run.image_size)
    # the samples scaled as the real digits are
    return lambda images, wanted: float((clf.predict(images.reshape(len(images), -1) / 127.5 - 1.0) == wanted).mean())


def frame_accuracy(recipe_name: str):
    """run -> accuracy(clips, wanted) by the classifier of video_quality.py's recipe (per frame)."""
    recipe = video_quality.RECIPES[recipe_name]

    def for_run(run):
        clf, _ = video_quality.train_classifier(run.image_size, run.num_frames, recipe["centre"], **recipe["data"])
        border = recipe["data"].get("border", False)

        def accuracy(clips, wanted):
            grey = video_quality.interior(clips[..., 0] / 255.0, border)  # [n, T, S', S'] in [0, 1]
            return float((clf.predict(grey.reshape(grey.shape[0] * grey.shape[1], -1) * 2 - 1)
                          == np.repeat(wanted, grey.shape[1])).mean())
        return accuracy
    return for_run


def wan_i2v_recipe(outputs: Path) -> dict:
    recipe = video_quality.RECIPES["wan22_i2v_digits"]
    return dict(recipe["train"], dataset="moving_digits", vae="none", umt5=video_quality.tiny_umt5(str(outputs)),
                frame_interval=recipe["data"]["frame_interval"])


def flux_recipe(outputs: Path) -> dict:
    t5, clip = flux_quality.encoders(outputs / "encoders")
    return dict(model="flux-debug", dataset="captioned_digits", image_size=16, vae="none", t5=t5, clip=clip,
                batch_size=64, lr=1e-3, ema_decay=0.995, max_steps=2000)  # flux_quality.py's defaults


PROMPTS = [f"a handwritten {word}" for word in DIGIT_WORDS]
DEMOS = {
    "digits": Demo(lambda _: dict(digits_quality.RECIPE, dataset="digits", num_classes=10, vae="none"),
                   dict(cfg_scale=2.0, num_sampling_steps=100, sampler="ddpm"), list(range(10)), digit_accuracy),
    "flux": Demo(flux_recipe, dict(cfg_scale=4.0, num_sampling_steps=50, prompts=PROMPTS), PROMPTS, digit_accuracy),
    # IDDPM and DDPM sampling: what the table in benchmarks/README.md and Latte's default thresholds came from
    "video": Demo(lambda _: dict(video_quality.RECIPES["moving_digits"]["train"], dataset="moving_digits", vae="none",
                                 objective="diffusion"),
                  dict(cfg_scale=12.0, num_sampling_steps=100), list(range(10)), frame_accuracy("moving_digits"),
                  pab=True),
    "wan_i2v": Demo(wan_i2v_recipe, {}, None, frame_accuracy("wan22_i2v_digits")),  # Wan's sampling defaults
}


def first_frame_conditions(run, n: int, folder: Path) -> tuple[list[str], np.ndarray]:
    """The image-to-video demo's prompts and wanted digits, its first frames written to folder (video_quality.py's
    held-out clips)."""
    data = video_quality.RECIPES["wan22_i2v_digits"]["data"]
    real = video_quality.MovingDigitsDataset(run.image_size, run.num_frames, split="held_out", seed=3, **data)
    prompts, digits, _ = video_quality.first_frame_prompts(real, n, folder)
    return prompts, np.array(digits)


def train(demo: Demo, outputs: Path, steps: int | None, batch_size: int | None, seed: int) -> str:
    """Train the demo's recipe (--train_steps / --train_batch_size replace its own) -> its last checkpoint."""
    from opendit.training.loop import Trainer

    recipe = demo.recipe(outputs)
    recipe.update({k: v for k, v in (("max_steps", steps), ("batch_size", batch_size)) if v})
    steps = recipe["max_steps"]
    trainer = Trainer(cfglib.TrainConfig(**recipe, ckpt_every=steps, log_every=max(1, steps // 20), num_workers=0,
                                         outputs=str(outputs), global_seed=seed))
    trainer.train()
    return str(sorted((trainer.run_dir / "checkpoints").glob("step-*"))[-1])


def parse_row(spec: str) -> dict:
    """A --rows item -> the SampleConfig fields it sets."""
    kind, _, arg = spec.partition(":")
    if kind == "none" and not arg:
        return {"cache": "none"}
    if kind in ("teacache", "fbcache") and arg:
        return {"cache": kind, "cache_threshold": float(arg)}
    if kind == "pab":
        every = [int(n) for n in arg.split(",")] if arg else []
        if len(every) in (0, 3):
            return {"cache": "pab", **dict(zip(PAB_EVERY, every))}
    raise argparse.ArgumentTypeError(f"{spec!r}: use none, teacache:T, fbcache:T or pab[:S,T,C]")


def row_spec(spec: str) -> str:
    """--rows' type: the item as given (it labels the row) once it parses."""
    parse_row(spec)
    return spec


def default_rows(family, demo: Demo) -> list[str]:
    rows = ["none"] + [f"{kind}:{family.cache_thresholds[kind] * s:g}" for kind in ("teacache", "fbcache")
                       for s in THRESHOLD_SCALES if kind in family.cache_thresholds]
    return rows + (["pab:2,4,6", "pab:4,8,12"] if demo.pab else [])


def sample_row(loaded, sample_cfg, conditions: list, n: int, batch_size: int) -> dict:
    """Sample n with the step cache sample_cfg names, as sample.py does (the cache reset before every batch) ->
    samples, seconds, and the evaluations the cache ran and skipped (summed over the batches; 0 without one)."""
    from opendit.inference import attach_step_cache

    family, device = loaded.family, torch.device("cpu")
    sampler = family.make_sampler(sample_cfg, loaded.cfg)
    cache = attach_step_cache(loaded.model, sample_cfg)
    ran = skipped = 0
    chunks = []
    try:
        t0 = time.perf_counter()
        for s in range(0, n, batch_size):
            if cache is not None:
                cache.reset()
            chunks.append(family.sample_batch(loaded, sampler, range(s, min(s + batch_size, n)), conditions,
                                              sample_cfg, device))
            if cache is not None:
                ran, skipped = ran + cache.ran, skipped + cache.skipped
        seconds = time.perf_counter() - t0
    finally:
        if cache is not None:
            cache.detach()  # the next row attaches its own to the same model
    return dict(samples=np.concatenate(chunks), seconds=seconds, ran=ran, skipped=skipped,
                counts=cache.counts if cache is not None else "")


def psnr(samples: np.ndarray, reference: np.ndarray) -> float:
    mse = float(np.mean((samples.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def measure(name: str, ckpt: str, a) -> dict:
    """Every row of one demo -> its settings and rows (the table's cells, unrounded)."""
    from opendit.inference import complete_sample_config, load_model

    demo = DEMOS[name]
    steps = {"num_sampling_steps": a.sampling_steps} if a.sampling_steps else {}
    base = cfglib.SampleConfig(ckpt=ckpt, seed=a.seed, **{**demo.sample, **steps})
    loaded = load_model(base, torch.device("cpu"))
    base = complete_sample_config(loaded.family, base, loaded.cfg)
    accuracy = demo.classifier(loaded.cfg)
    n = 10 * a.samples_per_class
    conditions, wanted = demo.conditions, np.arange(n) % 10
    if conditions is None:
        folder = Path(a.out) / name / "first_frames"
        conditions, wanted = first_frame_conditions(loaded.cfg, n, folder)
        base = replace(base, image=str(folder))
    specs = a.rows or default_rows(loaded.family, demo)
    # the reference first; PAB only where there is attention to broadcast (the video models)
    specs = ["none"] + [s for s in specs if s != "none" and (demo.pab or parse_row(s)["cache"] != "pab")]
    sample_row(loaded, base, conditions, min(a.batch_size, n), a.batch_size)  # warm-up: untimed
    rows, reference = [], None
    for spec in specs:
        sample_cfg = complete_sample_config(loaded.family, replace(base, **parse_row(spec)), loaded.cfg)
        r = sample_row(loaded, sample_cfg, conditions, n, a.batch_size)
        reference = r["samples"] if reference is None else reference
        total = r["ran"] + r["skipped"]
        rows.append(dict(row=spec, seconds=r["seconds"], speedup=rows[0]["seconds"] / r["seconds"] if rows else 1.0,
                         skipped_share=r["skipped"] / total if total else 0.0, evaluations=total,
                         counts=r["counts"], psnr_db=psnr(r["samples"], reference),
                         classifier_accuracy=accuracy(r["samples"], wanted)))
    return dict(demo=name, ckpt=ckpt, model=loaded.cfg.model, samples=n, batch_size=a.batch_size,
                sampler=base.sampler, sampling_steps=base.num_sampling_steps, cfg_scale=base.cfg_scale,
                seed=a.seed, rows=rows)


def hardware() -> str:
    """The CPU, its cores and the threads the timings ran on: speed-ups depend on them."""
    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").is_file():
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} on {torch.get_num_threads()} threads "
            f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})")


def skipped_cell(row: dict) -> str:
    share = f"{row['skipped_share']:.1%}"
    return f"{share} of {row['evaluations']} {row['counts']}" if row["evaluations"] else share


def table(result: dict) -> str:
    head = (f"### {result['demo']}: {result['model']}, {result['samples']} samples in batches of "
            f"{result['batch_size']}, {result['sampling_steps']} {result['sampler']} steps, cfg {result['cfg_scale']}, "
            f"seed {result['seed']}\n\n| row | seconds | speed-up | skipped | PSNR vs none (dB) | classifier |\n"
            f"|---|---:|---:|---:|---:|---:|\n")
    lines = [f"| {r['row']} | {r['seconds']:.2f} | {r['speedup']:.2f}x | {skipped_cell(r)} | {r['psnr_db']:.1f} | "
             f"{r['classifier_accuracy']:.1%} |" for r in result["rows"]]
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demos", nargs="+", default=list(DEMOS), choices=tuple(DEMOS))
    for name in DEMOS:
        p.add_argument(f"--{name}_ckpt", help=f"a trained checkpoint of the {name} demo (default: train one)")
    p.add_argument("--train_steps", type=int, help="training steps when a checkpoint is not given (default: the "
                                                   "recipe's)")
    p.add_argument("--train_batch_size", type=int, help="default: the recipe's")
    p.add_argument("--rows", nargs="+", type=row_spec,
                   help="none, teacache:T, fbcache:T, pab[:S,T,C] (default: see above)")
    p.add_argument("--samples_per_class", type=int, default=10)
    p.add_argument("--sampling_steps", type=int, help="default: the quality benchmark's")
    p.add_argument("--batch_size", type=int, default=cfglib.SampleConfig.batch_size,
                   help="samples per batch (default: sample.py's, %(default)s; a cache skips only when every sample "
                        "of the batch may)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="outputs/sample_accel")
    a = p.parse_args(argv)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    header = f"Step caches on the CPU demos: {hardware()}; every row in one process after a warm-up batch.\n"
    print(header)
    results = []
    for name in a.demos:
        ckpt = getattr(a, f"{name}_ckpt") or train(DEMOS[name], out / name, a.train_steps, a.train_batch_size,
                                                   a.seed)
        results.append(measure(name, ckpt, a))
        print(table(results[-1]))
        # rewritten after every demo: a killed run keeps the finished tables
        (out / "sample_accel.md").write_text(header + "\n" + "\n".join(map(table, results)))
        (out / "sample_accel.json").write_text(json.dumps(dict(hardware=hardware(), demos=results), indent=1))
    return results


if __name__ == "__main__":
    main()
