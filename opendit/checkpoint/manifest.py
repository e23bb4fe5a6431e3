"""The manifest of a step directory and its verification.

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
import json
import logging
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist

from opendit.distributed import all_gather_objects, current_rank, in_process_group

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
CHUNK = 8 << 20
_VERIFIED: set[tuple] = set()  # (absolute path, size, mtime_ns, crc32) of files verified in this process


class CheckpointCorruptError(ValueError):
    """A checkpoint file is truncated, corrupt or unreadable; the message names it and what to do."""


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


def verify_checkpoint(path: str, checksums: bool = True, names=None) -> None:
    """Check a step directory against its manifest: on every rank of a job at once (a collective: each rank
    checks its share of the files), else in this process. Raises CheckpointCorruptError naming each file
    that differs; a step directory without a manifest passes (with an info note)."""
    files = read_manifest(path)
    if files is None:
        _unverified(path)
        return
    names = sorted((n for n in files if names is None or n in names), key=lambda n: (-files[n]["size"], n))
    if in_process_group():  # skip checksums everywhere if one rank (rank 0 resolving `latest`) just verified them all
        known = all_gather_objects(all(is_verified(path, n, files[n]) for n in names))
        checksums = checksums and not any(known)
        rank, world = current_rank(), dist.get_world_size()
        found = problems(path, names[rank::world], checksums)
        found = [p for ps in all_gather_objects(found) for p in ps]
    else:
        found = problems(path, names, checksums)
    if found:
        raise corrupt_error(path, found)
