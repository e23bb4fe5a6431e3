"""What a checkpoint holds, and whether it still holds it: the manifest of a step directory, its verification,
and recognising what a `--ckpt` / `--load` argument is before anything is unpickled or parsed.

manifest.json (written last, before the step directory's rename) lists every file of the step directory with
its size and CRC-32: {"format": 1, "checksum": "crc32", "files": {"__0_0.distcp": {"size": .., "crc32": ..}}}.
Each rank checksums the files it wrote itself (its .distcp files and its ranks/ file; small files straight
from memory) and rank 0 gathers the lists, so a save reads back only 1/world of the data per rank. Files
written beside the step afterwards (ema.safetensors, ema.json) are added by `record_files`.

Cost, measured on the 2-core development machine: zlib's CRC-32 runs at 3.6 GiB/s per core in memory
(blake2b 0.56, md5 0.58, sha1 1.2, sha256 1.3 GiB/s), and crc32_file at 1.5-1.8 GiB/s on a freshly written,
page-cached 1 GiB file (read included). A 12B-parameter FLUX checkpoint (~190 GB: weights, fp32 AdamW state,
EMA) saved by 8 ranks costs each rank ~24 GB, ~13 s; verifying it in one process (rank 0 resolving `latest`)
runs one thread per file and is bounded by the disk's read speed; a load on N ranks checks 1/N each.

A load verifies sizes always and checksums unless checksums=False; a file whose size or checksum differs is
a CheckpointCorruptError naming the file and what to do. A step directory without manifest.json (saved
before manifests existed) loads unverified. Files verified in this process are remembered (by path, size,
mtime and checksum), so `--load latest` verifying a checkpoint and then loading it reads it for checksums once.
"""
import errno
import json
import logging
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
REQUIRED = (".metadata", "trainer.pt", "meta.json", "ranks")
EXPORTS = ("ema.safetensors", "ema.json", "config.yaml")  # written beside a saved step, not read by a resume
CHUNK = 8 << 20
ACCEPTED = ("an EMA export (.safetensors), a training checkpoint folder (outputs/NNN-model/checkpoints/step-XXXXXX), "
            "an official DiT/Latte .pt, or a diffusers DiT folder (config.json, or transformer/)")
_VERIFIED: set[tuple] = set()  # (absolute path, size, mtime_ns, crc32) of files verified in this process


class CheckpointCorruptError(ValueError):
    """A checkpoint file is truncated, corrupt or unreadable; the message names it and what to do."""


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def crc32_file(path: str) -> str:
    """CRC-32 of a file, read in 8 MiB chunks (zlib releases the GIL: files checksum in parallel threads)."""
    crc, buf = 0, bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def entry_of_bytes(data: bytes) -> dict:
    return {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def _map(fn, items: list):
    """fn over items in up to 8 threads (I/O and zlib run outside the GIL)."""
    if len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(min(8, len(items), os.cpu_count() or 1)) as pool:
        return list(pool.map(fn, items))


def describe_files(folder: str, names) -> dict[str, dict]:
    """{relative name: {"size", "crc32"}} for files under folder (checksummed in parallel threads)."""
    names = sorted(set(names))

    def one(name):
        path = os.path.join(folder, name)
        entry = {"size": os.path.getsize(path), "crc32": crc32_file(path)}
        _remember(path, entry)
        return entry
    return dict(zip(names, _map(one, names)))


def write_bytes(path: str, data: bytes) -> dict:
    """Write and fsync a small file; its manifest entry. Errors are plain OSErrors (torch.save's are not)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return entry_of_bytes(data)


def write_manifest(folder: str, files: dict[str, dict], **info) -> None:
    """Write manifest.json (via manifest.json.tmp and a rename: a reader never sees half of one)."""
    data = json.dumps({"format": 1, "checksum": "crc32", **info, "files": dict(sorted(files.items()))},
                      indent=1).encode()
    path = os.path.join(folder, MANIFEST)
    write_bytes(path + ".tmp", data)
    os.replace(path + ".tmp", path)


def read_manifest(folder: str) -> dict | None:
    """The manifest's {name: entry}, or None when the step directory predates manifests."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        files = json.loads(Path(path).read_bytes().decode("utf-8"))["files"]
        if not all(isinstance(e, dict) and isinstance(e.get("size"), int) for e in files.values()):
            raise ValueError("an entry lacks its size")
        return files
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointCorruptError(
            f"{path} is corrupt ({type(e).__name__}: {e}); the checkpoint cannot be verified. Pass an earlier "
            f"step folder (--load latest skips this one), or delete {MANIFEST} to load it unverified") from None


def record_files(folder: str, names) -> None:
    """Add files written into a saved step directory afterwards (ema.safetensors, ema.json, config.yaml) to its
    manifest; call on rank 0 only. A step directory without a manifest is left as it is."""
    files = read_manifest(folder)
    if files is None:
        return
    info = json.loads(Path(folder, MANIFEST).read_text())
    files.update(describe_files(folder, names))
    write_manifest(folder, files, **{k: v for k, v in info.items() if k not in ("format", "checksum", "files")})


def _stamp(path: str) -> tuple:
    st = os.stat(path)
    return os.path.abspath(path), st.st_size, st.st_mtime_ns


def _remember(path: str, entry: dict) -> None:
    _VERIFIED.add((*_stamp(path), entry["crc32"]))


def is_verified(folder: str, name: str, entry: dict) -> bool:
    path = os.path.join(folder, name)
    try:
        return (*_stamp(path), entry.get("crc32")) in _VERIFIED
    except OSError:
        return False


def file_problem(folder: str, name: str, entry: dict, checksums: bool = True) -> str | None:
    """Why a listed file does not match its manifest entry ("" -> fine), in words."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return f"{path} is missing (the manifest lists it)"
    size = os.path.getsize(path)
    if size != entry["size"]:
        return (f"{path} has {size} bytes, the manifest says {entry['size']} "
                f"({'truncated: a save or copy cut short, or a full disk' if size < entry['size'] else 'changed'})")
    if checksums and "crc32" in entry and not is_verified(folder, name, entry):
        crc = crc32_file(path)
        if crc != entry["crc32"]:
            return f"{path} has CRC-32 {crc}, the manifest says {entry['crc32']} (corrupt: bit rot or a bad copy)"
        _remember(path, entry)
    return None


def _unverified(folder: str) -> None:
    log.info("checkpoint %s has no %s (saved by an older opendit): its sizes and checksums are not verified",
             folder, MANIFEST)


def problems(folder: str, names=None, checksums: bool = True) -> list[str]:
    """What is wrong with the listed files of a step directory (all, or `names` among them); [] when it
    verifies or has no manifest."""
    files = read_manifest(folder)
    if files is None:
        _unverified(folder)
        return []
    chosen = sorted((n for n in files if names is None or n in names), key=lambda n: -files[n]["size"])
    found = _map(lambda n: file_problem(folder, n, files[n], checksums), chosen)
    return [p for p in found if p]


def corrupt_error(folder: str, found: list[str]) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint {folder} failed verification: {'; '.join(found)}. Pass an earlier step folder (--load "
        f"latest and --load auto skip checkpoints that fail verification); if the files were copied, copy them "
        f"again")


# ---- step directories: complete, verifying, the newest that verifies -------------------------------------

def missing(path: str) -> list[str]:
    return [name for name in REQUIRED if not os.path.exists(os.path.join(path, name))]


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete step directories under root as [(step, path)], oldest first; `.tmp-*` dirs are skipped."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match and os.path.isdir(path) and not missing(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def checkpoint_problem(path: str, checksums: bool = True) -> str | None:
    """Why a step directory would not load (missing files, a file that fails its manifest, an unreadable
    meta.json), or None when it verifies."""
    absent = missing(path)
    if absent:
        return f"missing {absent}"
    try:
        found = problems(path, checksums=checksums)
        read_meta(path)
    except (CheckpointCorruptError, OSError) as e:
        return str(e)
    return "; ".join(found) or None


def newest_verifying(root: str, checksums: bool) -> tuple[str | None, list[str]]:
    """(newest step directory under root that verifies, ["path: why" for each newer one skipped])."""
    skipped = []
    for _, path in reversed(list_checkpoints(root)):
        why = checkpoint_problem(path, checksums)
        if why is None:
            return path, skipped
        log.warning("skipping checkpoint %s: %s; falling back to the previous one", path, why)
        skipped.append(f"{path}: {why}")
    return None, skipped


def run_folders(outputs: str) -> list[Path]:
    """train.py's run folders outputs/NNN-model, newest (highest number) first."""
    runs = [p for p in Path(outputs).glob("[0-9]*-*") if p.is_dir() and p.name.split("-")[0].isdigit()]
    return sorted(runs, key=lambda p: int(p.name.split("-")[0]), reverse=True)


def search_runs(outputs: str, checksums: bool) -> tuple[str | None, list[str]]:
    skipped = []
    for run in run_folders(outputs):
        path, why = newest_verifying(str(run / "checkpoints"), checksums)
        skipped += why
        if path is not None:
            return path, skipped
    return None, skipped


def read_meta(path: str) -> dict:
    meta_file = os.path.join(path, "meta.json")
    try:
        meta = json.loads(Path(meta_file).read_bytes().decode("utf-8"))
        if not isinstance(meta, dict) or not {"step", "world_size", "has_ema"} <= set(meta):
            raise ValueError("not the object save_checkpoint writes (step, world_size, has_ema, ...)")
        return meta
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(
            f"{meta_file} is corrupt ({type(e).__name__}: {e}); pass an earlier step folder (--load latest "
            f"skips this one), or restore the file from a copy") from None


def verify_checkpoint(path: str, checksums: bool = True, names=None) -> None:
    """Check a step directory against its manifest: on every rank of a job at once (a collective: each rank
    checks its share of the files), else in this process. Raises CheckpointCorruptError naming each file
    that differs; a step directory without a manifest passes (with an info note)."""
    files = read_manifest(path)
    if files is None:
        _unverified(path)
        return
    names = sorted((n for n in files if names is None or n in names), key=lambda n: (-files[n]["size"], n))
    if _dist():  # skip checksums everywhere if one rank (rank 0 resolving `latest`) just verified them all
        known = all_gather(all(is_verified(path, n, files[n]) for n in names))
        checksums = checksums and not any(known)
        rank, world = _rank(), dist.get_world_size()
        found = problems(path, names[rank::world], checksums)
        found = [p for ps in all_gather(found) for p in ps]
    else:
        found = problems(path, names, checksums)
    if found:
        raise corrupt_error(path, found)


def all_gather(obj) -> list:
    if not _dist():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class _CheckedStream:
    """A file DCP writes through: its OSError (a full disk: ENOSPC, EFBIG) is remembered, since torch.save's
    zip writer turns it into "RuntimeError: [enforce fail at inline_container.cc] unexpected pos"."""

    def __init__(self, stream, errors: list):
        self._stream, self._errors = stream, errors

    def write(self, data):
        try:
            return self._stream.write(data)
        except OSError as e:
            self._errors.append(e)
            raise

    def __getattr__(self, name):
        return getattr(self._stream, name)


class RecordingWriter(dcp.FileSystemWriter):
    """DCP's file writer, remembering the files this rank wrote (to checksum them) and its write errors."""

    def __init__(self, path: str):
        self.written, self.write_errors = set(), []
        super().__init__(path)
        open_stream = self.fs.create_stream

        @contextmanager
        def create_stream(path, mode):
            with open_stream(path, mode) as stream:
                yield _CheckedStream(stream, self.write_errors) if "w" in mode else stream
        self.fs.create_stream = create_stream

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)  # a torch.futures.Future of [WriteResult]

        def record(done):
            try:
                self.written.update(r.storage_data.relative_path for r in done.value())
            except Exception:  # a failed write: dcp.save raises it; nothing to checksum
                pass
        future.add_done_callback(record)
        return future

    def reset(self, checkpoint_id=None):
        super().reset(checkpoint_id)
        self.written = set()


def _failure(e: BaseException) -> BaseException:
    """The error inside DCP's CheckpointException (a BaseException holding each rank's), else e."""
    for inner, _ in getattr(e, "failures", {}).values():
        return inner
    return e


def save_error(final: str, rank: int, e: BaseException | str) -> Exception:
    """A failed save as an error naming the checkpoint folder; OSErrors say when the disk may be full."""
    e = _failure(e) if isinstance(e, BaseException) else e
    leftover = os.path.join(os.path.dirname(final), ".tmp-" + os.path.basename(final))
    if not isinstance(e, OSError):
        return e if isinstance(e, Exception) else RuntimeError(f"saving checkpoint {final} failed on rank {rank}: "
                                                               f"{e}")
    full = e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
    cause = ("disk full or file size limit: the disk may be full, or a file size limit (ulimit -f) or quota was "
             "reached" if full else "is the disk full, or the folder not writable?")
    where = f" ({e.filename})" if e.filename else ""
    return OSError(e.errno, f"saving checkpoint {final} failed on rank {rank}: {e.strerror or e}{where}: {cause}. "
                            f"Free space (or lower --keep_last) and resume from the previous checkpoint, which is "
                            f"intact; the partial {leftover} is ignored, and removed by the next save or a "
                            f"--load auto start")


# ---- what a --ckpt argument is -------------------------------------------------------------------------------

def _safetensors_header_ok(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return 0 < n <= size - 8 and head[8:9] == b"{"


def file_kind(path: str) -> str:
    """"safetensors" or "torch" (zip or legacy pickle) from a file's first bytes (and name); a clear error for
    a missing, empty or unrecognised file, naming it and listing what is accepted."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist; pass {ACCEPTED}")
    size = os.path.getsize(path)
    if size == 0:
        raise CheckpointCorruptError(f"checkpoint {path!r} is empty (0 bytes: an interrupted save, copy or "
                                     f"download?); copy it again or pass another checkpoint")
    with open(path, "rb") as f:
        head = f.read(16)
    if path.endswith(".safetensors") or _safetensors_header_ok(head, size):
        if not _safetensors_header_ok(head, size):
            raise CheckpointCorruptError(f"{path} is not a readable safetensors file (bad header: truncated or "
                                         f"corrupt); export it again or pass the checkpoint folder it came from")
        return "safetensors"
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return "torch"
    raise ValueError(f"{path!r} is not a checkpoint (neither a safetensors nor a torch file); pass {ACCEPTED}")


def checkpoint_kind(path: str) -> str:
    """What a --ckpt / load_weights argument is: "diffusers", "step" (a step directory), "safetensors" or
    "torch" (a .pt). A missing path, an empty or unrecognised file, or a folder that is not a checkpoint is
    an error naming it and listing what is accepted (a run or checkpoints folder: its step folders)."""
    from opendit.models.convert_diffusers import is_diffusers_dir

    path = os.fspath(path)
    if is_diffusers_dir(path):
        return "diffusers"
    if not os.path.isdir(path):
        return file_kind(path)
    if os.path.exists(os.path.join(path, ".metadata")) or STEP_DIR.match(os.path.basename(path)):
        return "step"
    steps = sorted(str(p) for p in Path(path).glob("*step-*") if STEP_DIR.match(p.name))
    steps += sorted(str(p) for p in Path(path).glob("checkpoints/step-*") if STEP_DIR.match(p.name))
    hint = f" It holds step folders: pass one, e.g. {steps[-1]}." if steps else \
        f" It holds: {sorted(os.listdir(path))[:8]}."
    raise ValueError(f"{path!r} is a folder but not a checkpoint (no .metadata, no config.json, no "
                     f"transformer/).{hint} Accepted: {ACCEPTED}")


def verify_listed_file(path: str) -> None:
    """A file inside a step directory with a manifest (ema.safetensors) is checked against its entry."""
    folder, name = os.path.split(os.path.abspath(path))
    files = read_manifest(folder) if STEP_DIR.match(os.path.basename(folder)) else None
    if files and name in files:
        why = file_problem(folder, name, files[name])
        if why:
            fix = ("; delete it to sample from the step folder's own shards (the same EMA weights), or export it "
                   "again" if name == "ema.safetensors" else "")
            raise CheckpointCorruptError(f"{why}{fix}")
