"""Encode a dataset with a frozen VAE once, so training reads cached latents instead of running the VAE.

    python preprocess.py --dataset folder --data_path /imagenet/train --image_size 256 \
        --vae stabilityai/sd-vae-ft-ema --out cache/imagenet256 --flip_both
    torchrun --nproc_per_node 8 preprocess.py ...          # each rank encodes a disjoint slice
    python train.py --dataset latents --data_path cache/imagenet256 --image_size 256 --model DiT-XL/2

Stores the posterior mean and std of every image (and of its horizontal flip with --flip_both);
see opendit/data/latents.py for the layout. Unreadable images are skipped and counted.
"""
import argparse
import json
import logging
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist

from opendit.data import build_dataset
from opendit.data.latents import CACHE_VERSION, MANIFEST, PARTIAL_SUFFIX, write_shard
from opendit.distributed import broadcast_object, cleanup, exit_process, init_distributed
from opendit.encoders.vae import SD_VAE_SCALE, load_vae, vae_geometry

logger = logging.getLogger("opendit.preprocess")
DTYPES = {"float32": np.float32, "float16": np.float16}


class _Tagged(torch.utils.data.Dataset):
    """Adds (index, ok) to each item: ok is False when the dataset replaced an unreadable file by another."""

    def __init__(self, dataset, indices):
        self.dataset, self.indices = dataset, indices

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        index = self.indices[i]
        x, y = self.dataset[index]
        return x, y, index not in getattr(self.dataset, "_bad", ())


@torch.no_grad()
def _posterior(vae, x):
    """x [B, 3, H, W] in [-1, 1] -> (mean, std) float32 [B, C, h, w], unscaled."""
    param = next(vae.parameters())
    dist_ = vae.encode(x.to(device=param.device, dtype=param.dtype)).latent_dist
    return dist_.mean.float().cpu(), dist_.std.float().cpu()


def _progress(done, total, start, skipped):
    rate = done / max(time.time() - start, 1e-9)
    eta = (total - done) / rate if rate > 0 else float("inf")
    logger.info("encoded %d/%d images (%.1f img/s, ETA %.0f s, %d unreadable skipped)", done, total, rate, eta, skipped)


def encode_slice(vae, dataset, indices, folder, rank, batch_size, flip_both, dtype, shard_size, num_workers):
    """Encode dataset[indices] into shards r<rank>-<k> under folder -> (shard entries, skipped count)."""
    loader = torch.utils.data.DataLoader(_Tagged(dataset, indices), batch_size=batch_size, num_workers=num_workers)
    shards, buf, skipped, done, start, last = [], {}, 0, 0, time.time(), 0.0

    def flush():
        if buf and len(buf["label"]):
            arrays = {k: np.concatenate(v) for k, v in buf.items()}
            shards.append(write_shard(folder, f"r{rank:03d}-{len(shards):05d}", arrays))
        buf.clear()

    for x, y, ok in loader:
        skipped += int((~ok).sum())
        x, y = x[ok], y[ok]
        if len(y):
            parts = dict(zip(("mean", "std"), _posterior(vae, x)))
            if flip_both:  # flipping the [-1, 1] tensor equals flipping the PIL image
                parts["mean_flip"], parts["std_flip"] = _posterior(vae, x.flip(-1))
            for key, value in parts.items():
                buf.setdefault(key, []).append(value.numpy().astype(dtype))
            buf.setdefault("label", []).append(y.numpy().astype(np.int64))
            if sum(len(v) for v in buf["label"]) >= shard_size:
                flush()
        done += len(ok)
        if rank == 0 and time.time() - last > 10:
            _progress(done, len(indices), start, skipped)
            last = time.time()
    flush()
    if rank == 0:
        _progress(done, len(indices), start, skipped)
    return shards, skipped


def _source(name, data_path, image_size):
    if name == "digits":  # grey digits become RGB for the VAE, as in training
        return build_dataset("digits", image_size=image_size, channels=3)
    return build_dataset(name, data_path, image_size, random_flip=False)


def preprocess(dataset_name, data_path, image_size, vae_name, out, vae_scale=SD_VAE_SCALE, batch_size=64,
               flip_both=False, dtype="float32", shard_size=8192, num_workers=4, overwrite=False) -> dict:
    """Encode the dataset into the cache folder `out` (all ranks call this) -> the manifest."""
    info = init_distributed()
    out = str(out).rstrip("/")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if os.path.exists(out) and not overwrite:
        raise FileExistsError(f"{out!r} already exists; pass --overwrite to rebuild it, or choose another --out")
    vae = load_vae(vae_name, info.device)
    if vae is None:
        raise ValueError("--vae is required (a diffusers AutoencoderKL folder or hub id); caching needs a VAE")
    factor, channels = vae_geometry(vae)
    if image_size % factor:
        raise ValueError(f"--image_size {image_size} must be a multiple of the VAE's downsampling {factor}")
    dataset = _source(dataset_name, data_path, image_size)
    partial = out + PARTIAL_SUFFIX
    if info.rank == 0:  # a previous interrupted run's leftovers are discarded
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    # contiguous, deterministic slices: the cache's item order is the dataset's, whatever the world size
    n, w, r = len(dataset), info.world_size, info.rank
    indices = list(range(r * n // w, (r + 1) * n // w))
    shards, skipped = encode_slice(vae, dataset, indices, partial, r, batch_size, flip_both, DTYPES[dtype],
                                   shard_size, num_workers)
    gathered = [None] * w
    dist.all_gather_object(gathered, (shards, skipped))
    manifest = None
    if r == 0:
        all_shards = [s for rank_shards, _ in gathered for s in rank_shards]
        manifest = dict(
            version=CACHE_VERSION, stores="VAE posterior mean and std, unscaled (latent = (mean + std * noise) * vae_scale)",
            vae=str(vae_name), vae_scale=float(vae_scale), image_size=int(image_size),
            latent_shape=[channels, image_size // factor, image_size // factor],
            num_classes=int(getattr(dataset, "num_classes", 0)),
            classes=list(getattr(dataset, "classes", [str(c) for c in range(dataset.num_classes)])),
            count=sum(s["count"] for s in all_shards), skipped=sum(k for _, k in gathered), flip_both=bool(flip_both),
            dtype=dtype, source=dict(dataset=dataset_name, data_path=data_path), shards=all_shards)
        with open(os.path.join(partial, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(partial, out)
        logger.info("wrote %d latents (%d unreadable images skipped) to %s", manifest["count"], manifest["skipped"], out)
    return broadcast_object(manifest)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="folder", choices=("folder", "digits"))
    parser.add_argument("--data_path", default=None)
    parser.add_argument("--image_size", type=int, default=256)
    parser.add_argument("--vae", default="stabilityai/sd-vae-ft-ema")
    parser.add_argument("--vae_scale", type=float, default=SD_VAE_SCALE)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch_size", type=int, default=64, help="per process")
    parser.add_argument("--flip_both", action="store_true", help="also cache each image's horizontal flip")
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    parser.add_argument("--shard_size", type=int, default=8192, help="images per shard file")
    parser.add_argument("--num_workers", type=int, default=4)
    parser.add_argument("--overwrite", action="store_true")
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    return preprocess(a.dataset, a.data_path, a.image_size, a.vae, a.out, a.vae_scale, a.batch_size, a.flip_both,
                      a.dtype, a.shard_size, a.num_workers, a.overwrite)


if __name__ == "__main__":
    main()
    cleanup()
    exit_process()
