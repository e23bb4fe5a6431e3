"""Where a stream's samples come from: WebDataset tar shards, Parquet files, a Hugging Face `datasets` table.

Each source knows its shards' sample counts (`sizes`, read when it is built, before any model) and gives the raw
fields of sample i of the shards laid end to end (`fields(i)`: {member extension or column: bytes / str / int /
dict}); `where(i)` names it for logs ("shards/00012.tar#000123"). Sources are picklable and open their files lazily,
so every DataLoader worker opens its own.

- tar shards (`TarShards`): a path, a brace pattern (`shards/{00000..01023}.tar`), a folder of .tar files, http(s)
  URLs of those, or a wids shard list (.json: {"wids_version": 1, "shardlist": [{"url", "nsamples"}]}), whose
  counts spare reading every shard at start. Members group into samples by key as WebDataset does (`00012.jpg`,
  `00012.txt`, `00012.json`: wids' `splitname`). Python's tarfile indexes each shard; past a corrupt header it
  resynchronises on the next valid one, and a truncated last member is left out (named in a warning).
- Parquet (`ParquetShards`): files, a glob, a folder of *.parquet, or http(s) URLs of files (each file a shard;
  remote ones copied once per machine, as tar shards are); pyarrow reads one row group at a time.
- Hugging Face datasets (`HFSource`): a folder written by `save_to_disk`, or `load_dataset` arguments (a hub name or
  a local folder of data files); memory-mapped Arrow, cut into shards of SHARD_ROWS rows. Image columns are read
  as their encoded bytes (no decoding by `datasets`).
"""
import bisect
import glob
import io
import json
import logging
import os
import tarfile
import time
from collections import OrderedDict

import numpy as np

from opendit.data.fetch import default_cache, is_url, local_copy

logger = logging.getLogger(__name__)

OPEN_SHARDS = 4  # shards a process keeps open / indexed (a shuffle window spans a few)
PROGRESS_S = 10.0  # seconds between the progress lines of counting a stream's shards
SHARD_ROWS = 1024  # rows of a Hugging Face table per shard


class ShardSource:
    """sizes: samples per shard. Subclasses: `_shard_names`, `_read(shard, offset)`."""
    kind = ""
    sizes: list[int]
    names: list[str]

    def __len__(self) -> int:
        return int(sum(self.sizes))

    @property
    def starts(self) -> np.ndarray:
        return np.cumsum([0] + list(self.sizes))

    def locate(self, index: int) -> tuple[int, int]:
        """Stream index -> (shard, offset within it)."""
        starts = self.starts
        if not 0 <= index < starts[-1]:
            raise IndexError(f"sample {index} is outside the stream's {starts[-1]} samples")
        shard = bisect.bisect_right(starts, index) - 1
        return shard, int(index - starts[shard])

    def fields(self, index: int) -> dict:
        return self._read(*self.locate(index))

    def where(self, index: int) -> str:
        shard, offset = self.locate(index)
        return f"{self.names[shard]}#{offset}"

    def _read(self, shard: int, offset: int) -> dict:
        raise NotImplementedError


class _Opened(OrderedDict):
    """The last OPEN_SHARDS shards a process opened: shard -> opened object."""

    def get_or_open(self, shard, open_fn):
        if shard in self:
            self.move_to_end(shard)
            return self[shard]
        opened = self[shard] = open_fn(shard)
        while len(self) > OPEN_SHARDS:
            _, old = self.popitem(last=False)
            close = getattr(old, "close", None)
            if close:
                close()
        return opened


# ---- WebDataset tar shards ------------------------------------------------------------------------------------
def expand_shards(spec: str) -> list[str]:
    """A --data_path of tar shards -> the shard paths or URLs, in order (brace patterns expanded, a folder's .tar
    files sorted). Local shards must all exist: a missing one is an error naming it."""
    from braceexpand import braceexpand

    spec = str(spec)
    if not is_url(spec) and os.path.isdir(spec):
        found = sorted(glob.glob(os.path.join(spec, "**", "*.tar"), recursive=True))
        if not found:
            raise FileNotFoundError(f"no .tar shards in the folder {spec!r}; pass a folder of WebDataset .tar files, "
                                    f"a pattern such as shards/{{00000..00099}}.tar, or a wids .json shard list")
        return found
    shards = [s for part in spec.split("::") for s in braceexpand(part.strip()) if s]
    if not shards:
        raise ValueError(f"--data_path {spec!r} names no shards; pass e.g. shards/{{00000..00099}}.tar")
    local = [s for s in shards if not is_url(s)]
    missing = [s for s in local if not os.path.isfile(s)]
    if missing:
        raise FileNotFoundError(f"{len(missing)} of the {len(shards)} shards of {spec!r} do not exist (first: "
                                f"{missing[0]!r}); check the pattern and the folder")
    return shards


def read_shard_list(path: str) -> tuple[list[str], list[int]]:
    """A wids dataset description (.json) -> (shard URLs or paths, sample counts); relative URLs resolve against the
    file's folder."""
    from wids.wids_specs import resolve_dsdesc

    with open(path, encoding="utf-8") as f:
        try:
            description = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path!r} is not a JSON shard list ({err}); expected wids' format {{\"wids_version\": 1,"
                             f" \"shardlist\": [{{\"url\": ..., \"nsamples\": ...}}]}}") from err
    base = os.path.dirname(os.path.abspath(path)) + "/"
    try:
        shards = resolve_dsdesc(description, base=base)["shardlist"]
    except (AssertionError, KeyError, TypeError) as err:
        raise ValueError(f"{path!r} is not a wids shard list (wids_version 1, a shardlist of url and nsamples): "
                         f"{err}") from err
    return [s["url"] for s in shards], [int(s["nsamples"]) for s in shards]


def tar_index(path: str) -> list[dict[str, tuple[int, int]]]:
    """The samples of one tar shard, in order: [{extension: (data offset, size)}], plus "__key__" -> (key, 0).

    Members are grouped by key (consecutive members with the same key, wids' convention); a corrupt header is
    skipped to the next valid one (tarfile's ignore_zeros), a member that runs past the end of the file (a truncated
    shard) ends the index. Both are warned about, naming the shard."""
    from wids.wids import splitname

    size = os.path.getsize(path)
    samples, last_key, truncated, last_end = [], None, None, 0
    with open(path, "rb") as f:
        try:
            archive = tarfile.open(fileobj=f, mode="r:", ignore_zeros=True)
            members = iter(archive)
            while True:
                try:
                    member = next(members)
                except StopIteration:
                    break
                except (tarfile.TarError, EOFError, OSError) as err:
                    truncated = f"{type(err).__name__}: {err}"
                    break
                if not member.isfile() or "." not in os.path.basename(member.name):
                    continue
                if member.offset_data + member.size > size:
                    truncated = f"member {member.name} ends at byte {member.offset_data + member.size} of {size}"
                    break
                last_end = member.offset_data + -(-member.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
                key, ext = splitname(member.name)
                if key != last_key:
                    samples.append({"__key__": (key, 0)})
                    last_key = key
                samples[-1][ext.lstrip(".")] = (member.offset_data, member.size)
        except tarfile.ReadError as err:  # not a tar at all (an HTML error page, zero bytes)
            logger.warning("skipping shard %s: not a readable tar file (%s)", path, err)
            return []
        if not truncated and samples:  # a whole archive ends with two zero blocks; a cut one stops short
            f.seek(last_end)
            if f.read(2 * tarfile.BLOCKSIZE) != bytes(2 * tarfile.BLOCKSIZE):
                truncated = f"no end-of-archive blocks after byte {last_end} of {size}"
    if truncated:
        logger.warning("shard %s is truncated or corrupt after sample %d (%s); its complete samples are used",
                       path, len(samples), truncated)
    return samples


class TarShards(ShardSource):
    kind = "webdataset"

    def __init__(self, spec: str, cache_dir: str | None = None):
        self.spec, self.cache_dir = str(spec), cache_dir or default_cache()
        if self.spec.endswith(".json") and not is_url(self.spec):
            self.names, counts = read_shard_list(self.spec)
        else:
            self.names, counts = expand_shards(self.spec), None
        if counts is None:  # every shard read once (remote ones downloaded) to count its samples
            counts = self._count()
        self.sizes = counts
        if not len(self):
            raise ValueError(f"the {len(self.names)} shard(s) of {self.spec!r} hold no samples (no member named "
                             f"KEY.EXT, or none readable); check that they are WebDataset tar files")
        self._indexes, self._files = {}, _Opened()

    @classmethod
    def listed(cls, names: list[str], sizes: list[int], cache_dir: str | None = None) -> "TarShards":
        """Shards whose sample counts are known (a latent cache's manifest): nothing is read until used."""
        shards = cls.__new__(cls)
        shards.spec, shards.cache_dir = "::".join(names), cache_dir or default_cache()
        shards.names, shards.sizes = list(names), list(sizes)
        shards._indexes, shards._files = {}, _Opened()
        return shards

    def __getstate__(self):
        return {**self.__dict__, "_indexes": {}, "_files": _Opened()}

    def _count(self) -> list[int]:
        """Each shard's samples, from its tar headers; a line every PROGRESS_S with the rate and the time left."""
        counts, start, last = [], time.time(), time.time()
        for shard in range(len(self.names)):
            counts.append(len(tar_index(self.local_path(shard))))
            if time.time() - last > PROGRESS_S:
                last, rate = time.time(), (shard + 1) / (time.time() - start)
                logger.info("counted the samples of %d/%d shards (%.1f shards/s, %.0f s left; a shard list, python -m "
                            "opendit.data.shards --list, spares this)", shard + 1, len(self.names), rate,
                            (len(self.names) - shard - 1) / rate)
        return counts

    def local_path(self, shard: int) -> str:
        name = self.names[shard]
        return local_copy(name, self.cache_dir) if is_url(name) else name

    def _index(self, shard: int):
        if shard not in self._indexes:
            if len(self._indexes) >= 4 * OPEN_SHARDS:  # a window spans a few shards; indexes are small
                self._indexes.clear()
            self._indexes[shard] = tar_index(self.local_path(shard))
        return self._indexes[shard]

    def _read(self, shard: int, offset: int) -> dict:
        index = self._index(shard)
        if offset >= len(index):
            raise IndexError(f"sample {offset} of shard {self.names[shard]} is missing (it holds {len(index)}; the "
                             f"shard list said more: truncated or replaced)")
        handle = self._files.get_or_open(shard, lambda s: open(self.local_path(s), "rb"))
        fields = {}
        for ext, (start, size) in index[offset].items():
            if ext == "__key__":
                fields[ext] = start
                continue
            handle.seek(start)
            fields[ext] = handle.read(size)
        return fields

    def where(self, index: int) -> str:
        shard, offset = self.locate(index)
        key = self._index(shard)[offset]["__key__"][0] if offset < len(self._index(shard)) else offset
        return f"{self.names[shard]}#{key}"


# ---- Parquet --------------------------------------------------------------------------------------------------
def expand_parquet(spec: str) -> list[str]:
    """A --data_path of Parquet files -> their paths or http(s) URLs (brace patterns expanded), in order."""
    from braceexpand import braceexpand

    spec = str(spec)
    if is_url(spec):
        return [s for part in spec.split("::") for s in braceexpand(part.strip()) if s]
    if os.path.isdir(spec):
        found = sorted(glob.glob(os.path.join(spec, "**", "*.parquet"), recursive=True))
    else:
        found = sorted(glob.glob(spec)) if any(c in spec for c in "*?[") else [spec] * os.path.isfile(spec)
    if not found:
        raise FileNotFoundError(f"no Parquet files at {spec!r}; pass a .parquet file, a glob such as "
                                f"'data/train-*.parquet', or a folder of them")
    return found


class ParquetShards(ShardSource):
    kind = "parquet"

    def __init__(self, spec: str, columns: tuple[str, ...] = (), cache_dir: str | None = None):
        import pyarrow.parquet as pq

        self.names, self.cache_dir = expand_parquet(spec), cache_dir or default_cache()
        self.columns = tuple(columns)
        self.sizes, self.groups, schema = [], [], None
        for shard, path in enumerate(self.names):
            try:
                meta = pq.ParquetFile(self.local_path(shard)).metadata
            except Exception as err:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError...: named, not a crash
                raise ValueError(f"{path!r} is not a readable Parquet file ({type(err).__name__}: {err}); remove or "
                                 f"replace it") from err
            rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            self.sizes.append(int(sum(rows)))
            self.groups.append(np.cumsum([0] + rows))
            schema = schema or meta.schema.to_arrow_schema()
        self.schema_names = list(schema.names) if schema is not None else []
        if not len(self):
            raise ValueError(f"the Parquet files of {spec!r} hold no rows")
        self._tables = _Opened()

    def __getstate__(self):
        return {**self.__dict__, "_tables": _Opened()}

    def local_path(self, shard: int) -> str:
        name = self.names[shard]
        return local_copy(name, self.cache_dir) if is_url(name) else name

    def _read(self, shard: int, offset: int) -> dict:
        import pyarrow.parquet as pq

        starts = self.groups[shard]
        group = bisect.bisect_right(starts, offset) - 1
        columns = [c for c in self.columns if c in self.schema_names] or None
        table = self._tables.get_or_open((shard, group), lambda key: pq.ParquetFile(self.local_path(key[0]))
                                         .read_row_group(key[1], columns=columns))
        row = table.slice(offset - int(starts[group]), 1).to_pylist()[0]
        return row


# ---- Hugging Face datasets ------------------------------------------------------------------------------------
def parse_hf_args(text: str | None) -> dict:
    """--hf_args "name=cc12m split=validation" -> {"name": "cc12m", "split": "validation"}."""
    args = {}
    for part in (text or "").split():
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"--hf_args {text!r}: {part!r} is not KEY=VALUE; pass e.g. "
                             f"--hf_args \"name=x split=train\"")
        args[key] = value
    return args


class HFSource(ShardSource):
    kind = "hf"

    def __init__(self, spec: str, hf_args: str | None = None):
        import datasets

        args = parse_hf_args(hf_args)
        split = args.pop("split", "train")
        self.spec = str(spec)
        saved = os.path.isdir(self.spec) and any(os.path.isfile(os.path.join(self.spec, f)) for f in
                                                 ("state.json", "dataset_dict.json"))
        try:
            table = datasets.load_from_disk(self.spec) if saved else datasets.load_dataset(self.spec, split=split,
                                                                                            **args)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"no Hugging Face dataset at {self.spec!r} ({err}); pass a folder written by "
                                    f"save_to_disk, a folder of data files, or a hub name") from err
        if isinstance(table, datasets.DatasetDict):
            if split not in table:
                raise ValueError(f"{self.spec!r} has the splits {sorted(table)}, not {split!r}; pass --hf_args "
                                 f"split=NAME")
            table = table[split]
        # encoded bytes, decoded (and filtered) by opendit as the other sources' are
        for name, feature in table.features.items():
            if isinstance(feature, datasets.Image):
                table = table.cast_column(name, datasets.Image(decode=False))
        self.table = table
        n = len(table)
        if not n:
            raise ValueError(f"the Hugging Face dataset {self.spec!r} (split {split}) has no rows")
        self.sizes = [min(SHARD_ROWS, n - s) for s in range(0, n, SHARD_ROWS)]
        self.names = [f"{self.spec}[{s}:{s + size}]" for s, size in zip(range(0, n, SHARD_ROWS), self.sizes)]
        self.schema_names = list(table.column_names)

    def _read(self, shard: int, offset: int) -> dict:
        return self.table[shard * SHARD_ROWS + offset]


SOURCES = {"webdataset": TarShards, "parquet": ParquetShards, "hf": HFSource}


def open_source(kind: str, spec: str, shard_cache: str | None = None, hf_args: str | None = None,
                columns: tuple[str, ...] = ()) -> ShardSource:
    """The source of --dataset `kind` at `spec` (columns: the Parquet columns to read; default all)."""
    if kind == "webdataset":
        return TarShards(spec, shard_cache)
    if kind == "hf":
        return HFSource(spec, hf_args)
    return ParquetShards(spec, columns, shard_cache)


def as_bytes(value) -> bytes | None:
    """An encoded image or clip as bytes: raw bytes, or datasets' {"bytes": ..., "path": ...} (bytes, else the file)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return bytes(value["bytes"])
        if value.get("path") and os.path.isfile(value["path"]):
            with open(value["path"], "rb") as f:
                return f.read()
    return None


def as_stream(value) -> io.BytesIO | None:
    data = as_bytes(value)
    return None if data is None else io.BytesIO(data)
