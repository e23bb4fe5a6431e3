"""Cached VAE latents (written by preprocess.py): training reads them instead of running the VAE.

Layout of a cache folder:

    manifest.json                    written last; its presence marks a complete cache
    r000-00000.mean.npy              float [n, C, h, w]: posterior mean (unscaled, as the VAE returns it); in a
                                     cache written with --buckets each shard holds one bucket (its manifest entry
                                     names it), and "latent_shape" is the model's square input
    r000-00000.std.npy               float [n, C, h, w]: posterior std
    r000-00000.mean_flip.npy  ...    the same for the horizontally flipped image (--flip_both only)
    r000-00000.label.npy             int64 [n]
    r000-00000.caption.npy           str [n] (sources with captions)
    r000-00000.<name>.npy            whatever else the family's encoders give per item, in the manifest's
                                     "embeddings" order (FLUX: t5 [n, L, D], clip [n, D]; a cache of editing
                                     pairs: its controls' posterior means, control_mean [n, K, C, h, w], with
                                     "controls_per_target" K and the control folder in the manifest)
    extra.<name>.npy                 arrays stored once ("extras"; FLUX: the empty caption's embeddings)

Storing mean and std (not one sample, as fast-DiT does) lets every epoch draw a fresh posterior
sample, as encoding on the fly does. preprocess.py writes into `<out>.partial` and renames it when
complete, so an interrupted run is never mistaken for a cache.
"""
import json
import os

import numpy as np
import torch
from torch.utils.data import Dataset

from opendit.data.buckets import Bucket, BucketAssignment
from opendit.seeding import mix_seed

CACHE_VERSION = 1
CACHE_DTYPES = ("float32", "float16")  # storage of the posterior mean and std
MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"
ARRAYS = ("mean", "std")
FLIP_ARRAYS = ("mean_flip", "std_flip")
REBUILD_HINT = "build it with: python preprocess.py --dataset ... --vae ... --out <folder>"
RERUN_HINT = "re-run preprocess.py to rebuild it (python preprocess.py --dataset ... --vae ... --out <folder>)"


def read_manifest(path: str) -> dict:
    """The cache's manifest, with clear errors for a missing, interrupted, or outdated cache."""
    if path is None:
        raise ValueError(f"dataset 'latents' needs --data_path <cache folder written by preprocess.py>; {REBUILD_HINT}")
    path = str(path).rstrip("/")
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        if os.path.isdir(path + PARTIAL_SUFFIX) or path.endswith(PARTIAL_SUFFIX):
            raise FileNotFoundError(
                f"latent cache {path!r} is incomplete: preprocess.py was interrupted (found "
                f"{path.removesuffix(PARTIAL_SUFFIX) + PARTIAL_SUFFIX!r}); rerun preprocess.py with the same --out")
        what = "has no manifest.json (not a finished cache)" if os.path.isdir(path) else "does not exist"
        raise FileNotFoundError(f"latent cache {path!r} {what}; {REBUILD_HINT}")
    with open(manifest_path) as f:
        manifest = json.load(f)
    if manifest.get("version") != CACHE_VERSION:
        raise ValueError(f"latent cache {path!r} has format version {manifest.get('version')!r}, this opendit "
                         f"reads version {CACHE_VERSION}; rebuild it with this version's preprocess.py")
    return manifest


def shard_file_problem(path: str, count: int):
    """None when the .npy at `path` holds `count` items and all its bytes, else what is wrong with it."""
    try:
        with open(path, "rb") as f:
            major, _ = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, _, dtype = read_header(f)  # np.save writes 3 only for non-latin-1 field names
            offset = f.tell()
    except (OSError, ValueError, EOFError) as err:
        return f"has no valid .npy header ({type(err).__name__}: {err})"
    if not shape or shape[0] != count:
        return f"holds shape {tuple(shape)}, the manifest says {count} items"
    if dtype.hasobject:
        return None  # pickled objects: no fixed size to check
    expected = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    actual = os.path.getsize(path)
    if actual < expected:
        return f"is truncated ({actual} of {expected} bytes)"
    return None


def shard_arrays(flip_both: bool, captions: bool = False, embeddings=()) -> tuple[str, ...]:
    return (ARRAYS + FLIP_ARRAYS if flip_both else ARRAYS) + ("label",) + (("caption",) if captions else ()) + \
        tuple(embeddings)


def write_shard(folder: str, stem: str, arrays: dict) -> dict:
    """Save one shard's arrays as <stem>.<key>.npy -> its manifest entry {"stem", "count"}."""
    for key, value in arrays.items():
        np.save(os.path.join(folder, f"{stem}.{key}.npy"), value)
    return {"stem": stem, "count": int(len(arrays["label"]))}


class LatentDataset(Dataset):
    """item = ((mean, std) float32 [C, h, w] each, int label): the VAE posterior of one cached image; a video
    cache holds [C, T, h, w] per clip and, when its source had captions, items get a third field, the caption;
    a cache with embeddings appends them, float32, in the manifest's order (FLUX: ((mean, std), label, caption,
    t5 [L, D], clip [D])).

    With a --flip_both cache and random_flip, item i of epoch e is the flipped image's posterior when
    mix_seed(seed, e, i) is odd (stateless, like ImageFolderDataset). Shards are memory-mapped, so a
    cache larger than host memory still trains.
    """

    def __init__(self, path: str, image_size=None, random_flip: bool = True, seed: int = 0):
        self.manifest = read_manifest(path)
        self.path = str(path).rstrip("/")
        m = self.manifest
        if image_size is not None and int(image_size) != m["image_size"]:
            raise ValueError(f"--image_size {image_size} does not match the latent cache {self.path!r}, which was "
                             f"encoded at {m['image_size']}px; pass --image_size {m['image_size']}")
        self.image_size = m["image_size"]
        self.latent_shape = tuple(m["latent_shape"])  # (C, h, w)
        self.channels = self.latent_shape[0]
        self.num_classes = m["num_classes"]
        self.controls_per_target = int(m.get("controls_per_target", 0))  # a cache of editing pairs: K
        self.classes = m["classes"]
        self.flip_both = bool(m["flip_both"])
        self.captions = bool(m.get("captions", False))
        self.embeddings = tuple(m.get("embeddings", ()))
        self.random_flip, self.seed, self.epoch = random_flip, int(seed), 0
        self._stems = [s["stem"] for s in m["shards"]]
        self._starts = np.cumsum([0] + [s["count"] for s in m["shards"]])  # shard k holds [starts[k], starts[k+1])
        if self._starts[-1] != m["count"]:
            raise ValueError(f"latent cache {self.path!r}: shards hold {self._starts[-1]} items, the manifest says "
                             f"{m['count']}; the cache is damaged, rebuild it with preprocess.py")
        self._check_files()
        self.buckets = self._buckets()
        self._maps = None  # opened lazily in each process (memmaps must not be pickled into workers)

    def _check_files(self) -> None:
        """Every shard file exists, has a readable .npy header, the manifest's item count, and all its bytes
        (headers only are read: a truncated shard fails here, not hours into training)."""
        for stem, count in zip(self._stems, np.diff(self._starts)):
            for key in self._arrays():
                name = f"{stem}.{key}.npy"
                if not os.path.isfile(os.path.join(self.path, name)):
                    raise FileNotFoundError(f"latent cache {self.path!r} lacks {name}; the cache is damaged, "
                                            f"{RERUN_HINT}")
                problem = shard_file_problem(os.path.join(self.path, name), int(count))
                if problem:
                    raise ValueError(f"latent cache {self.path!r}: shard file {name} {problem}; the cache is "
                                     f"damaged, {RERUN_HINT}")

    def _buckets(self) -> BucketAssignment | None:
        """A cache written with --buckets: each item's bucket, from its shard (a shard holds one bucket)."""
        sizes = self.manifest.get("bucket_sizes")
        if not sizes:
            return None
        ids = np.repeat([s["bucket"] for s in self.manifest["shards"]], np.diff(self._starts)).astype(np.int64)
        return BucketAssignment([Bucket(*size) for size in sizes], ids)

    def _arrays(self) -> tuple[str, ...]:
        return shard_arrays(self.flip_both, self.captions, self.embeddings)

    def extra(self, key: str) -> torch.Tensor:
        """An array stored once for the whole cache (e.g. "empty_t5"), float32."""
        path = os.path.join(self.path, f"extra.{key}.npy")
        if key not in self.manifest.get("extras", ()) or not os.path.isfile(path):
            raise FileNotFoundError(f"latent cache {self.path!r} lacks extra.{key}.npy; rebuild it with preprocess.py")
        return torch.from_numpy(np.load(path).astype(np.float32))

    def __getstate__(self):
        return {**self.__dict__, "_maps": None}

    def _shard(self, k: int) -> dict:
        if self._maps is None:
            self._maps = {}
        if k not in self._maps:
            self._maps[k] = {key: self._open(f"{self._stems[k]}.{key}.npy") for key in self._arrays()}
        return self._maps[k]

    def _open(self, name: str) -> np.ndarray:
        try:
            return np.load(os.path.join(self.path, name), mmap_mode="r")
        except (OSError, ValueError, EOFError) as err:  # changed or removed since the dataset was built
            raise ValueError(f"latent cache {self.path!r}: cannot read shard file {name} ({type(err).__name__}: "
                             f"{err}); the cache is damaged, {RERUN_HINT}") from err

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def caption(self, index: int) -> str | None:
        """Item index's caption without reading its latents (None: the cache stores no captions)."""
        if not self.captions:
            return None
        k = int(np.searchsorted(self._starts, index, side="right") - 1)
        return str(self._shard(k)["caption"][index - int(self._starts[k])])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a latent cache of {len(self)} items")
        k = int(np.searchsorted(self._starts, index, side="right") - 1)
        arrays, i = self._shard(k), index - int(self._starts[k])
        flip = self.flip_both and self.random_flip and mix_seed(self.seed, self.epoch, index) & 1 == 1
        mean_key, std_key = FLIP_ARRAYS if flip else ARRAYS
        mean = torch.from_numpy(np.array(arrays[mean_key][i], dtype=np.float32))
        std = torch.from_numpy(np.array(arrays[std_key][i], dtype=np.float32))
        if self.embeddings:
            return ((mean, std), int(arrays["label"][i]), str(arrays["caption"][i]),
                    *(torch.from_numpy(np.array(arrays[k][i], dtype=np.float32)) for k in self.embeddings))
        if self.captions:
            return (mean, std), int(arrays["label"][i]), str(arrays["caption"][i])
        return (mean, std), int(arrays["label"][i])
