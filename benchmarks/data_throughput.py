"""Data loading throughput: samples per second per DataLoader worker from WebDataset tar shards, Parquet files and a
plain folder holding the same photos (JPEG decode + resize + center crop to 256 and 512 px), from a latent cache
(FLUX.1's 16 x 32 x 32 posterior of a 256 px image, mean and std in fp16) as .npy shards and as streamed tar shards,
and how many workers a FLUX.1 [schnell] 256 px training step needs per GPU.

    python benchmarks/data_throughput.py                              # the README table (about 5 min on 2 cores)
    python benchmarks/data_throughput.py --samples 64 --sizes 256 --workers 1   # smoke run

The photos are synthetic (smooth random colour fields with noise, 768x576, JPEG quality 90, about 100 KB each, the
size class of CC12M's images), written once per run in the three layouts. Each row iterates a fresh DataLoader over
every sample (batch 16, the loader's own workers; the first batch, paying worker start-up, is left out) and reports
samples/s and samples/s per worker. The step's need: FLOPs per sample of flux-schnell at 256 px from the planner's
model (opendit's FLOP count, 512 text + 256 image tokens), at an assumed --tflops per GPU.
"""
import argparse
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opendit.data.captions import CaptionedImageDataset  # noqa: E402
from opendit.data.shards import write_parquet, write_tars  # noqa: E402
from opendit.data.streaming import StreamDataset  # noqa: E402


def photo(seed: int, width: int = 768, height: int = 576) -> bytes:
    """A JPEG of a smooth random colour field with fine noise (compresses like a photo, not like flat colour)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 255, (height // 32 + 1, width // 32 + 1, 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.int16)
    pixels = np.clip(field + rng.integers(-12, 13, field.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def write_layouts(root: Path, samples: int) -> dict[str, tuple[str, str]]:
    """The same photos and captions as a folder, tar shards and Parquet -> {layout: (--dataset, --data_path)}."""
    records = [{"key": f"{i:06d}", "media": photo(i), "ext": "jpg", "caption": f"a photo number {i}", "label": 0,
                "width": 768, "height": 576} for i in range(samples)]
    folder = root / "folder"
    folder.mkdir(parents=True)
    for r in records:
        (folder / f"{r['key']}.jpg").write_bytes(r["media"])
        (folder / f"{r['key']}.txt").write_text(r["caption"])
    shards = write_tars(records, str(root / "tar"), shard_size=256)
    write_parquet(records, str(root / "parquet"), shard_size=256, row_group=64)
    pattern = str(root / "tar" / f"{{00000..{len(shards) - 1:05d}}}.tar")
    return {"folder": ("captions", str(folder)), "tar shards": ("webdataset", pattern),
            "Parquet": ("parquet", str(root / "parquet"))}


def write_latent_caches(root: Path, samples: int, shard: int = 256) -> dict[str, str]:
    """The same random posteriors as a .npy cache and a tar cache (what preprocess.py writes) -> {layout: folder}."""
    import json

    from opendit.data.latent_shards import tar_shard_writer
    from opendit.data.latents import CACHE_VERSION, write_shard

    rng = np.random.default_rng(0)
    folders = {}
    for layout, fmt in (("latent cache (.npy)", "npy"), ("latent cache (tar, streamed)", "webdataset")):
        folder = root / fmt
        folder.mkdir()
        entries = []
        for j, start in enumerate(range(0, samples, shard)):
            count = min(shard, samples - start)
            arrays = {"mean": rng.standard_normal((count, 16, 32, 32)).astype(np.float16),
                      "std": rng.random((count, 16, 32, 32)).astype(np.float16),
                      "label": np.zeros(count, dtype=np.int64)}
            if fmt == "npy":
                entries.append(write_shard(str(folder), f"r000-{j:05d}", arrays))
            else:
                keys = list(range(start, start + count))
                entries.append(tar_shard_writer(j)(str(folder), "r000-00000", arrays, keys))
        manifest = dict(version=CACHE_VERSION, format=fmt, family="flux", image_size=256, latent_shape=[16, 32, 32],
                        num_classes=0, classes=[], flip_both=False, captions=False, embeddings=[], count=samples,
                        shards=entries)
        (folder / "manifest.json").write_text(json.dumps(manifest))
        folders[layout] = str(folder)
    return folders


def dataset(kind: str, path: str, size: int):
    if kind == "captions":
        return CaptionedImageDataset(path, size)
    return StreamDataset(kind, path, size)


def throughput(data, workers: int, batch: int = 16) -> float:
    """Samples per second over every sample after the first batch."""
    loader = torch.utils.data.DataLoader(data, batch_size=batch, num_workers=workers, shuffle=False)
    it = iter(loader)
    next(it)
    count, start = 0, time.perf_counter()
    for batch_items in it:
        count += len(batch_items[1])
    return count / (time.perf_counter() - start)


def schnell_flops_per_sample(image_size: int) -> float:
    from opendit import config as cfglib
    from opendit.families import family_of

    family = family_of("flux-schnell")
    cfg = family.fill_defaults(cfglib.TrainConfig(model="flux-schnell", image_size=image_size, vae="none"))
    with torch.device("meta"):
        model = family.memory_model(cfg, (16, image_size // 8, image_size // 8))
    return family.train_flops_per_sample(model), cfg.t5_max_length


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 512])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tflops", type=float, default=400.0, help="assumed training TFLOP/s per GPU for the step")
    a = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        layouts = write_layouts(Path(tmp), a.samples)
        megabytes = sum(f.stat().st_size for f in (Path(tmp) / "folder").glob("*.jpg")) / a.samples / 1e6
        print(f"{a.samples} synthetic 768x576 JPEG photos ({megabytes * 1000:.0f} KB each), batch 16, "
              f"{os.cpu_count()} CPU cores, torch {torch.__version__}\n")
        print("| layout | size | workers | samples/s | per worker | vs the first row of its kind |")
        print("|---|---:|---:|---:|---:|---:|")
        per_worker = {}
        for size in a.sizes:
            for workers in a.workers:
                base = None
                for layout, (kind, path) in layouts.items():
                    rate = throughput(dataset(kind, path, size), workers)
                    base = base or rate
                    per_worker.setdefault(size, []).append(rate / workers)
                    print(f"| {layout} | {size} | {workers} | {rate:.0f} | {rate / workers:.0f} | {rate / base:.2f} |")
        from opendit.data.latent_shards import open_cache

        caches = write_latent_caches(Path(tmp), a.samples)
        for workers in a.workers:
            base = None
            for layout, folder in caches.items():
                rate = throughput(open_cache(folder), workers)
                base = base or rate
                print(f"| {layout} | 256 | {workers} | {rate:.0f} | {rate / workers:.0f} | {rate / base:.2f} |")
    flops, text_tokens = schnell_flops_per_sample(256)
    need = a.tflops * 1e12 / flops
    slowest = min(per_worker.get(256, [float("nan")]))
    print(f"\nflux-schnell at 256 px ({text_tokens} text + {(256 // 16) ** 2} image tokens): {flops / 1e12:.2f} TFLOP "
          f"per training sample; at {a.tflops:.0f} TFLOP/s a GPU trains {need:.0f} samples/s, which needs "
          f"{need / slowest:.1f} loader workers at this machine's slowest per-worker rate at 256 px "
          f"({slowest:.0f} samples/s)")


if __name__ == "__main__":
    main()
