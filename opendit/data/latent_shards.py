"""Latent caches as WebDataset tar shards (`preprocess.py --cache_format webdataset`), streamed like raw data.

The cache folder holds what a .npy cache holds (manifest.json, extra.<name>.npy) with the items in tar shards:
`s<range>-<piece>.tar`, one member per array of an item, named `<item>.<array>.npy` (item: its index in the source
dataset, nine digits; array: mean, std, mean_flip, std_flip, label, caption, and the family's embeddings), so
WebDataset's own readers decode them too. Shard range j holds the source items [j * S, (j + 1) * S) (S =
--shard_size) that could be read, one piece per aspect-ratio bucket. Ranks take ranges round-robin; each piece is
written under a temporary name and renamed, then `s<range>.done.json` records the range's pieces: a restarted
preprocess.py (--skip_existing) keeps the ranges that have it and never writes them again, at any world size.

Training reads such a cache as LatentStream: the LatentDataset items, in a stream's order (shards shuffled, a
shuffle window, partitions; opendit/data/stream_order.py), resumed exactly like every stream.
"""
import glob
import io
import json
import os

import numpy as np

from opendit.data.latents import MANIFEST, RERUN_HINT, LatentDataset, read_manifest
from opendit.data.spec import DatasetSpec

DONE = ".done.json"


def range_done(folder: str, j: int) -> dict | None:
    """The record of shard range j when it is complete: {"pieces": [manifest entries], "skipped", "shape"}."""
    path = os.path.join(folder, f"s{j:06d}{DONE}")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def clear_range(folder: str, j: int) -> None:
    """Remove the pieces of an unfinished range j (an interrupted run's), so it is written whole again."""
    for path in glob.glob(os.path.join(folder, f"s{j:06d}-*")):
        os.remove(path)


def mark_done(folder: str, j: int, pieces: list[dict], skipped: int, shape) -> None:
    path = os.path.join(folder, f"s{j:06d}{DONE}")
    with open(path + ".tmp", "w") as f:
        json.dump({"pieces": pieces, "skipped": skipped, "shape": shape}, f)
    os.replace(path + ".tmp", path)


def _npy(value) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, value, allow_pickle=False)
    return buffer.getvalue()


def tar_shard_writer(j: int):
    """write(folder, stem, arrays, keys) for preprocess.py's encode_slice: the arrays of one piece of range j as a
    tar shard, each item keyed by its source index (keys)."""
    import webdataset as wds

    def write(folder: str, stem: str, arrays: dict, keys: list[int]) -> dict:
        name = f"s{j:06d}-{stem.rsplit('-', 1)[-1]}"
        partial = os.path.join(folder, f"{name}.tar.partial")
        with wds.TarWriter(partial) as writer:
            for n, key in enumerate(keys):
                writer.write({"__key__": f"{key:09d}", **{f"{array}.npy": _npy(value[n])
                                                          for array, value in arrays.items()}})
        os.replace(partial, os.path.join(folder, f"{name}.tar"))
        return {"stem": name, "count": int(len(arrays["label"]))}

    return write


class _Column:
    """arrays[key][i] of one tar shard, as LatentDataset indexes its memory-mapped .npy shards."""

    def __init__(self, shard, key: str):
        self.shard, self.key = shard, key

    def __getitem__(self, i: int):
        return self.shard.item(i)[f"{self.key}.npy"]


class _TarShard:
    def __init__(self, source, k: int):
        self.source, self.k, self.last = source, k, (None, None)

    def item(self, i: int) -> dict:
        if self.last[0] != i:  # an item's arrays are read together, then decoded per key
            fields = self.source._read(self.k, i)
            self.last = (i, {key: np.load(io.BytesIO(value)) for key, value in fields.items() if key.endswith(".npy")})
        return self.last[1]

    def __getitem__(self, key: str) -> _Column:
        return _Column(self, key)


class LatentStream(LatentDataset):
    """A tar-shard latent cache: LatentDataset's items, streamed (see the module doc)."""

    def __init__(self, path: str, image_size=None, random_flip: bool = True, seed: int = 0,
                 shuffle_buffer: int = 10_000, stream_partitions: int = 1, shard_cache: str | None = None):
        from opendit.data.shard_sources import TarShards
        from opendit.data.streaming import StreamOrder

        self.shuffle_buffer, self.stream_partitions = shuffle_buffer, stream_partitions
        super().__init__(path, image_size, random_flip, seed)
        names = [os.path.join(self.path, f"{stem}.tar") for stem in self._stems]
        self.source = TarShards.listed(names, [int(n) for n in np.diff(self._starts)], shard_cache)
        self.order = StreamOrder(self.source.sizes, stream_partitions, shuffle_buffer)
        self.order.groups = None if self.buckets is None else self.buckets.ids

    def _check_files(self) -> None:
        for stem in self._stems:
            if not os.path.isfile(os.path.join(self.path, f"{stem}.tar")):
                raise FileNotFoundError(f"latent cache {self.path!r} lacks {stem}.tar; the cache is damaged, "
                                        f"{RERUN_HINT}")

    def _shard(self, k: int) -> _TarShard:
        if self._maps is None:
            self._maps = {}
        if k not in self._maps:
            self._maps[k] = _TarShard(self.source, k)
        return self._maps[k]


def open_cache(path: str, image_size=None, random_flip: bool = True, seed: int = 0, shuffle_buffer: int = 10_000,
               stream_partitions: int = 1, shard_cache: str | None = None) -> LatentDataset:
    """The cache at `path`, as its manifest says it was written: .npy shards or tar shards (streamed)."""
    if read_manifest(path).get("format", "npy") == "webdataset":
        return LatentStream(path, image_size, random_flip, seed, shuffle_buffer, stream_partitions, shard_cache)
    return LatentDataset(path, image_size, random_flip, seed)


def pixel_channels(path: str, cfg=None) -> int:
    """The channels a pixel-space model sees of the cache at `path`: a pixel-space cache's (its latents are the
    pixels, --vae none), else 3 (also where no cache is written yet, as a memory plan asks: opening it names that)."""
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        return 3
    manifest = read_manifest(path)
    return manifest["latent_shape"][0] if str(manifest["vae"]).lower() == "none" else 3


LATENTS = DatasetSpec("latents", "a latent cache written by preprocess.py (its manifest gives the image size, VAE "
                                 "and classes; .npy shards, or tar shards streamed)", open_cache,
                      path="a cache folder written by preprocess.py", cache=True,
                      settings=("shuffle_buffer", "stream_partitions", "shard_cache"), probe=pixel_channels)
