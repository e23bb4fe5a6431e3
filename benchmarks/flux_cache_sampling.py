"""Step caches on a flux-dev-shaped transformer: wall-clock of sampling one 1024x1024 image (4096 latent tokens,
512 T5 tokens, guidance-distilled: one forward per step) with --cache none, teacache and fbcache at the family's
default thresholds, in one process on the same noise.

    python benchmarks/flux_cache_sampling.py --out flux_cache.md                     # GPU: flux-dev, bf16
    python benchmarks/flux_cache_sampling.py --model flux-debug --image_size 64 --device cpu --steps 6   # CPU smoke

The weights are random (the model's own init, with the zero-initialised modulations and output layer given small
random values so that every block changes its input), so the share of steps a cache skips says nothing about a
trained model's: what this row measures is the cost of a full step, of a cached one, and the cache's overhead.
The quality side is benchmarks/sample_accel.py's, on trained demo models.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opendit.diffusion.flow import euler_sample, flux_schedule  # noqa: E402
from opendit.families import FAMILIES  # noqa: E402
from opendit.families.flux.family import flux_inputs  # noqa: E402
from opendit.families.flux.model import pack_latents  # noqa: E402
from opendit.models.step_cache import make_step_cache  # noqa: E402


def random_model(name: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """The family's `name` model with its own init on `device`, every all-zero weight given N(0, 0.02) values."""
    torch.manual_seed(0)
    with torch.device(device):
        model = FAMILIES["flux"].models[name].build()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1 and not p.any():
                p.normal_(std=0.02)
    return model.to(dtype).eval()


def time_sampling(model, cache: str, threshold: float | None, steps: int, inputs: dict, device: str):
    """Seconds of one Euler sampling run with `cache` attached, and the share of block evaluations it skipped."""
    attached = make_step_cache(cache, steps, threshold)
    if attached is not None:
        attached.attach(model)
    z, h, w = inputs["z"], inputs["h"], inputs["w"]
    dtype = next(model.parameters()).dtype

    def velocity(x, t):
        kw = flux_inputs(x.to(dtype), h, w, inputs["txt"], inputs["y"], t.to(dtype), 3.5)
        return model(**kw).float()

    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    euler_sample(velocity, z, flux_schedule(steps, (h // 2) * (w // 2)))
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    skipped = attached.skipped_share if attached is not None else 0.0
    if attached is not None:
        attached.detach()
    return seconds, skipped


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux-dev")
    p.add_argument("--image_size", type=int, default=1024)
    p.add_argument("--t5_tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="also write the table here (markdown)")
    a = p.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = random_model(a.model, a.device, dtype)
    build_s = time.perf_counter() - t0
    family = FAMILIES["flux"]
    lat = a.image_size // 8
    gen = torch.Generator().manual_seed(0)
    z = pack_latents(torch.randn(1, model.in_channels // 4, lat, lat, generator=gen)).to(a.device)
    inputs = dict(z=z, h=lat, w=lat,
                  txt=torch.randn(1, a.t5_tokens, model.txt_in.in_features, generator=gen).to(a.device, dtype),
                  y=torch.randn(1, model.vector_in.in_layer.in_features, generator=gen).to(a.device, dtype))
    with torch.no_grad():
        time_sampling(model, "none", None, 2, inputs, a.device)  # warm-up: kernels, allocator
        rows = [("none", None)] + [(kind, family.cache_thresholds[kind]) for kind in ("teacache", "fbcache")]
        results = [(kind, thr, *time_sampling(model, kind, thr, a.steps, inputs, a.device)) for kind, thr in rows]
    base = results[0][2]
    lines = [f"# {a.model} sampling, {a.image_size}x{a.image_size}, {a.steps} Euler steps, batch 1, {dtype}, "
             f"{a.device} (random weights; built in {build_s:.0f} s)", "",
             "| cache | threshold | s per image | s per step | speed-up | blocks skipped |",
             "|---|---:|---:|---:|---:|---:|"]
    for kind, thr, seconds, skipped in results:
        lines.append(f"| {kind} | {'-' if thr is None else thr} | {seconds:.2f} | {seconds / a.steps:.3f} | "
                     f"{base / seconds:.2f}x | {skipped:.1%} |")
    if a.device == "cuda":
        lines.append(f"\npeak GPU allocated {torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB")
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
