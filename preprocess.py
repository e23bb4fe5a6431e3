"""Encode a dataset once with its model family's frozen encoders (image DiT: the VAE), so training reads cached
latents instead of running them.

    python preprocess.py --dataset folder --data_path /imagenet/train --image_size 256 \
        --vae stabilityai/sd-vae-ft-ema --out cache/imagenet256 --flip_both
    torchrun --nproc_per_node 8 preprocess.py ...          # each rank encodes a contiguous slice
    python train.py --dataset latents --data_path cache/imagenet256 --model DiT-XL/2

Stores the posterior mean and std of every image (and of its horizontal flip with --flip_both), and for FLUX
(--family flux --t5 ... --clip ...) each caption's T5 token embeddings and pooled CLIP vector;
see opendit/data/latents.py for the layout. Unreadable images are skipped and counted. A bad flag or file ends
the run before it encodes anything with one line, `error: ...`, and exit status 2 (opendit/cli.py).
"""
import json
import logging
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist

from opendit import config as cfglib
from opendit.cli import parse_config, run_entry, say
from opendit.data.buckets import bucket_assignment, bucket_ids
from opendit.data.latent_shards import clear_range, mark_done, range_done, tar_shard_writer
from opendit.data.latents import (ARRAYS, CACHE_DTYPES, CACHE_VERSION, FLIP_ARRAYS, MANIFEST, PARTIAL_SUFFIX,
                                  write_shard)
from opendit.distributed import broadcast_object, cleanup, exit_process, init_distributed
from opendit.errors import setup_finished
from opendit.families import get_family

logger = logging.getLogger("opendit.preprocess")


class _Tagged(torch.utils.data.Dataset):
    """Adds the index and ok to each item ((x, label[, caption[, controls]]) -> (..., index, ok)): ok is False when
    the dataset replaced an unreadable file by another."""

    def __init__(self, dataset, indices):
        self.dataset, self.indices = dataset, indices

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        index = self.indices[i]
        return *self.dataset[index], index, index not in getattr(self.dataset, "_bad", ())


def _progress(done, total, start, skipped):
    rate = done / max(time.time() - start, 1e-9)
    eta = (total - done) / rate if rate > 0 else float("inf")
    logger.info("encoded %d/%d images (%.1f img/s, ETA %.0f s, %d unreadable skipped)", done, total, rate, eta, skipped)


def _by_bucket(indices: list[int], ids) -> list[tuple[int | None, list[int]]]:
    """[(bucket, its indices in order)]: one group of all indices without buckets; items left out of the buckets
    (unreadable headers) are dropped."""
    if ids is None:
        return [(None, indices)]
    buckets = sorted({int(ids[i]) for i in indices} - {-1})
    return [(b, [i for i in indices if ids[i] == b]) for b in buckets]


def encode_slice(encode, dataset, indices, folder, rank, batch_size, flip_both, dtype, shard_size, num_workers,
                 ids=None, write=None):
    """Encode dataset[indices] with encode(x, captions, controls) -> {"mean", "std"[, text embeddings][, the controls'
    latents]} into shards r<rank>-<k> under folder -> (shard entries, skipped count, per-item latent shape or None
    when nothing was encoded). Captions (sources that have them) are stored beside the labels; an editing pair's
    controls (its item's fourth field, [K, C, H, W]) go to encode, else None. With aspect-ratio buckets (ids: each
    item's bucket) the slice is encoded bucket by bucket and every shard holds one bucket (its entry records the
    bucket and latent shape). write(folder, stem, arrays, keys) writes a shard (keys: its items' source indices);
    default: .npy files."""
    write = write or (lambda folder, stem, arrays, keys: write_shard(folder, stem, arrays))
    groups = _by_bucket(indices, ids)
    skipped = len(indices) - sum(len(part) for _, part in groups)  # unreadable headers: left out of the buckets
    shards, buf, keys, done, start, last, shape = [], {}, [], 0, time.time(), 0.0, None

    def flush(bucket):
        if buf and len(buf["label"]):
            arrays = {k: np.concatenate(v) for k, v in buf.items()}
            embeddings = [k for k in arrays if k not in (*ARRAYS, *FLIP_ARRAYS, "label", "caption")]
            entry = {**write(folder, f"r{rank:03d}-{len(shards):05d}", arrays, list(keys)),
                     "captions": "caption" in arrays, "embeddings": embeddings}
            if bucket is not None:
                entry.update(bucket=bucket, latent_shape=list(arrays["mean"].shape[1:]))
            shards.append(entry)
        buf.clear()
        keys.clear()

    for bucket, part in groups:
        loader = torch.utils.data.DataLoader(_Tagged(dataset, part), batch_size=batch_size, num_workers=num_workers)
        for *item, index, ok in loader:
            skipped += int((~ok).sum())
            keys.extend(index[ok].tolist())
            x, y = item[0][ok], item[1][ok]
            captions = [c for c, good in zip(item[2], ok.tolist()) if good] if len(item) > 2 else None
            controls = item[3][ok] if len(item) > 3 else None
            if len(y):
                parts = encode(x, captions, controls)
                if flip_both:  # flipping the [-1, 1] tensor equals flipping the PIL image; captions stay
                    parts.update({f"{k}_flip": v for k, v in encode(x.flip(-1), None, None).items()})
                shape = list(parts["mean"].shape[1:])
                for key, value in parts.items():
                    buf.setdefault(key, []).append(value.numpy().astype(dtype))
                buf.setdefault("label", []).append(y.numpy().astype(np.int64))
                if captions is not None:
                    buf.setdefault("caption", []).append(np.array(captions, dtype=np.str_))
                if sum(len(v) for v in buf["label"]) >= shard_size:
                    flush(bucket)
            done += len(ok)
            if rank == 0 and time.time() - last > 10:
                _progress(done, len(indices), start, skipped)
                last = time.time()
        flush(bucket)
    if rank == 0:
        _progress(done, len(indices), start, skipped)
    return shards, skipped, shape


def encode_ranges(encode, dataset, folder, rank, world, cfg, ids=None):
    """--cache_format webdataset: shard range j (source items [j * S, (j + 1) * S)) of every j = rank mod world,
    each written as tar pieces and marked done; a range already done (an interrupted run's, --skip_existing) is kept
    as it is -> (shard entries, skipped count, per-item latent shape or None), as encode_slice."""
    n, size = len(dataset), cfg.shard_size
    shards, skipped, shape, kept = [], 0, None, 0
    for j in range(rank, -(-n // size), world):
        done = range_done(folder, j)
        if done is None:
            clear_range(folder, j)  # an interrupted range: written whole again
            indices = list(range(j * size, min(n, (j + 1) * size)))
            pieces, lost, piece_shape = encode_slice(encode, dataset, indices, folder, rank, cfg.batch_size,
                                                     cfg.flip_both, np.dtype(cfg.dtype), size, cfg.num_workers, ids=ids,
                                                     write=tar_shard_writer(j))
            mark_done(folder, j, pieces, lost, piece_shape)
            done = range_done(folder, j)
        else:
            kept += 1
        shards += done["pieces"]
        skipped += done["skipped"]
        shape = shape or done["shape"]
    if kept:
        logger.info("rank %d kept %d finished shard range(s) of the interrupted run (--skip_existing)", rank, kept)
    return shards, skipped, shape


def _resume_partial(partial: str, cfg, cache_keys) -> None:
    """--skip_existing: the interrupted run in `partial` must have been made with the same settings (and the family's
    cache_keys, e.g. the text encoder)."""
    settings = {k: getattr(cfg, k, None) for k in ("family", "dataset", "data_path", "control_directory",
                                                   "image_size", "buckets", "bucket_area", "vae", "model",
                                                   "flip_both", "dtype", "shard_size", *cache_keys)}
    path = os.path.join(partial, "settings.json")
    if os.path.isfile(path):
        with open(path) as f:
            before = json.load(f)
        differ = {k: (before.get(k), v) for k, v in json.loads(json.dumps(settings)).items() if before.get(k) != v}
        if differ:
            raise ValueError(f"--skip_existing: the interrupted cache {partial!r} was written with "
                             f"{', '.join(f'{k}={a!r}' for k, (a, _) in differ.items())}, this run has "
                             f"{', '.join(f'{k}={b!r}' for k, (_, b) in differ.items())}; pass the same flags, or "
                             f"leave out --skip_existing to start it afresh")
    with open(path, "w") as f:
        json.dump(settings, f)


def preprocess(cfg: cfglib.PreprocessConfig) -> dict:
    """Encode the dataset into the cache folder cfg.out (all ranks call this) -> the manifest."""
    info = init_distributed()
    family, given = get_family(cfg.family), cfglib.for_family(cfg)
    cfg = family.resolve_cache_config(given)
    out = str(cfg.out).rstrip("/")
    if cfg.dtype not in CACHE_DTYPES:
        raise ValueError(f"--dtype {cfg.dtype!r} is not one of {', '.join(CACHE_DTYPES)}")
    if os.path.exists(out) and not cfg.overwrite:
        raise FileExistsError(f"{out!r} already exists; pass --overwrite to rebuild it, or choose another --out")
    spec = family.datasets.get(cfg.dataset)
    if spec is None or spec.cache:
        sources = ", ".join(name for name, s in family.datasets.items() if not s.cache)
        what = "is already a cache" if spec is not None else f"is not a dataset of the {family.name} family"
        raise ValueError(f"--dataset {cfg.dataset} {what}; encode one of: {sources}")
    encoders = family.cache_encoders(cfg, info.device)
    dataset = family.cache_source(cfg, encoders)
    partial = out + PARTIAL_SUFFIX
    keep = cfg.skip_existing and cfg.cache_format == "webdataset"
    if cfg.skip_existing and not keep:
        raise ValueError("--skip_existing keeps finished shards of a --cache_format webdataset cache; add "
                         "--cache_format webdataset (a .npy cache is written whole)")
    if info.rank == 0:  # a previous interrupted run's leftovers are discarded, unless kept to resume
        if not keep:
            shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial, exist_ok=True)
        if keep:
            _resume_partial(partial, cfg, family.cache_keys)
    dist.barrier()
    setup_finished()  # from here on an error is a fault of the run, not of its flags: it keeps its traceback
    # contiguous, deterministic slices: the cache's item order is the dataset's, whatever the world size
    n, w, r = len(dataset), info.world_size, info.rank
    def encode(x, captions, controls):  # controls: an editing pair's, for a family that caches pairs
        return family.cache_encode(encoders, x, captions, **({} if controls is None else {"controls": controls}))
    if cfg.cache_format == "webdataset":
        shards, skipped, shape = encode_ranges(encode, dataset, partial, r, w, cfg, ids=bucket_ids(dataset))
    else:
        shards, skipped, shape = encode_slice(encode, dataset, list(range(r * n // w, (r + 1) * n // w)), partial,
                                              r, cfg.batch_size, cfg.flip_both, np.dtype(cfg.dtype), cfg.shard_size,
                                              cfg.num_workers, ids=bucket_ids(dataset))
    gathered = [None] * w
    dist.all_gather_object(gathered, (shards, skipped, shape))
    manifest = None
    if r == 0:
        extras = family.cache_extras(encoders)
        for key, value in extras.items():
            np.save(os.path.join(partial, f"extra.{key}.npy"), value.numpy().astype(cfg.dtype))
        manifest = _write_manifest(cfg, family, dataset, partial, gathered, sorted(extras))
        cfglib.save_yaml(cfglib.run_record(given, cfg), os.path.join(partial, "config.yaml"))  # --config reruns it
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(partial, out)
        logger.info("wrote %d latents (%d unreadable images skipped) to %s", manifest["count"], manifest["skipped"],
                    out)
    return broadcast_object(manifest)


def square_latent_shape(image_size: int, shards: list[dict], buckets) -> list[int]:
    """A bucketed cache's model input shape: the latent of an --image_size square (what the model is built at),
    scaled from the first shard's bucket and latent size (a video keeps that shard's latent frames)."""
    entry = shards[0]
    factor = buckets[entry["bucket"]].width // entry["latent_shape"][-1]
    return [*entry["latent_shape"][:-2], image_size // factor, image_size // factor]


def _write_manifest(cfg, family, dataset, folder, gathered, extras) -> dict:
    shapes = [s for _, _, s in gathered if s is not None]
    if not shapes:
        raise ValueError(f"no item of --dataset {cfg.dataset} could be read; nothing to cache")
    all_shards = [s for rank_shards, _, _ in gathered for s in rank_shards]
    if cfg.cache_format == "webdataset":  # the source's order, whichever rank wrote a range
        all_shards.sort(key=lambda entry: entry["stem"])
    assignment = bucket_assignment(dataset)
    buckets = None if assignment is None else assignment.buckets
    manifest = dict(
        version=CACHE_VERSION, family=family.name, format=cfg.cache_format,
        stores="VAE posterior mean and std, unscaled (latent = (mean + std * noise) * vae_scale)",
        vae=str(cfg.vae), vae_scale=float(cfg.vae_scale), image_size=int(cfg.image_size),
        latent_shape=shapes[0] if buckets is None else square_latent_shape(cfg.image_size, all_shards, buckets),
        buckets=cfg.buckets, bucket_area=cfg.bucket_area, bucket_frames=list(cfg.bucket_frames),
        bucket_sizes=None if buckets is None else [[b.width, b.height, b.frames] for b in buckets],
        num_classes=int(getattr(dataset, "num_classes", 0)),
        controls_per_target=int(getattr(dataset, "controls_per_target", 0)),
        classes=list(getattr(dataset, "classes", [str(c) for c in range(dataset.num_classes)])),
        count=sum(s["count"] for s in all_shards), skipped=sum(k for _, k, _ in gathered),
        flip_both=bool(cfg.flip_both), dtype=cfg.dtype, captions=bool(all_shards) and all_shards[0]["captions"],
        embeddings=all_shards[0]["embeddings"] if all_shards else [], extras=extras,
        **{key: getattr(cfg, key) for key in family.cache_keys},
        source=dict(dataset=cfg.dataset, data_path=cfg.data_path,
                    control_directory=getattr(cfg, "control_directory", None)),  # editing pairs: their controls
        shards=all_shards)
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def run(cfg: cfglib.PreprocessConfig) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    return preprocess(cfg)


def main(argv=None) -> dict:
    """The command line's run, in this process (a bad flag raises; see __main__ for the one-line form)."""
    cfg = parse_config(cfglib.PreprocessConfig, __doc__, argv)
    for warning in cfglib.check_config(cfg):
        say("warning", warning)
    return run(cfg)


if __name__ == "__main__":
    run_entry(run, parse_config(cfglib.PreprocessConfig, __doc__), check=cfglib.check_config)
    cleanup()
    exit_process()
