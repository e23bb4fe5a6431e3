"""Single sets of weights: exporting them to one .safetensors file (the EMA for sample.py), reading them back
from an export, an official .pt, or a step directory's DCP shards, and filling a model built on the meta device.
What a --ckpt argument is (checkpoint_kind) is decided from a file's first bytes before anything is parsed; a
foreign format (a diffusers folder, an official release) is the business of the model family that owns it.
"""
import json
import os
from collections.abc import Collection
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from opendit.checkpoint.discovery import resolve_checkpoint
from opendit.checkpoint.folders import read_safetensors_file, write_safetensors
from opendit.checkpoint.layout import STEP_DIR, is_step_dir, read_meta
from opendit.checkpoint.manifest import (CheckpointCorruptError, file_problem, read_manifest, record_files,
                                         verify_checkpoint, write_bytes)
from opendit.checkpoint.safe_read import SafeReader, dcp_load, load_torch_file, quiet_single_process
from opendit.distributed import barrier, current_rank
from opendit.ema import ShardedEMA

ACCEPTED = "an EMA export (.safetensors), a training checkpoint folder (outputs/NNN-model/checkpoints/step-XXXXXX)"


def _sidecar(path: str) -> str:
    return os.path.splitext(path)[0] + ".json"


def export_weights(path: str, state_dict: dict[str, torch.Tensor], metadata: dict | None = None) -> str | None:
    """Write {fqn: full tensor} to one .safetensors file (+ a .json sidecar with `metadata`, e.g. model name
    and config) via a temporary name and a rename, tensor by tensor (no copy of the weights is made). No
    collective inside: only rank 0 writes, other ranks return None, so it may be called on all ranks or on rank 0
    alone."""
    path = os.fspath(path)
    if current_rank() != 0:
        return None
    _check_export_path(path)
    bad = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor) or isinstance(v, DTensor)]
    if bad:
        raise TypeError(f"export_weights needs full plain tensors; {bad[:3]} are not (gather DTensors first, "
                        "e.g. ShardedEMA.full_state_dict())")
    return _write_export(path, _layout(state_dict), state_dict.values(), metadata)


def export_ema(ema: ShardedEMA, path: str, metadata: dict | None = None) -> str | None:
    """Export a ShardedEMA, gathering one tensor at a time (a collective: call on every rank); rank 0 writes each
    gathered tensor as it comes, so no rank holds the whole EMA twice."""
    path = os.fspath(path)
    state = ema.state_dict()
    gathered = (v.full_tensor() if isinstance(v, DTensor) else v for v in state.values())  # every rank's order
    out = None
    try:
        if current_rank() == 0:
            _check_export_path(path)
            out = _write_export(path, _layout(state), gathered, metadata)
    finally:
        for _ in gathered:  # the other ranks, and rank 0 after a failed write, join the gathers left
            pass
    barrier()  # the file exists on return, on every rank
    return out


def _check_export_path(path: str) -> None:
    if not path.endswith(".safetensors"):
        raise ValueError(f"export path {path!r} must end with .safetensors")


def _layout(state: dict) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {k: (v.dtype, tuple(v.shape)) for k, v in state.items()}


def _write_export(path: str, layout: dict, tensors, metadata: dict | None) -> str:
    """write_safetensors to a temporary name, the sidecar, the renames, and the step directory's manifest."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    try:
        write_safetensors(tmp, layout, tensors, metadata={"format": "pt"})
        if metadata is not None:
            write_bytes(_sidecar(path) + ".tmp", json.dumps(metadata, indent=1, default=str).encode())
            os.replace(_sidecar(path) + ".tmp", _sidecar(path))
        os.replace(tmp, path)
        folder = os.path.dirname(os.path.abspath(path))  # an export into a step directory joins its manifest
        if STEP_DIR.match(os.path.basename(folder)):
            record_files(folder, [os.path.basename(p) for p in (path, _sidecar(path)) if os.path.isfile(p)])
    except Exception as e:
        for leftover in (tmp, _sidecar(path) + ".tmp"):
            if os.path.exists(leftover):
                os.remove(leftover)
        if isinstance(e, (TypeError, ValueError)):  # a tensor safetensors cannot store, or a bad layout
            raise
        raise OSError(getattr(e, "errno", None), f"exporting weights to {path} failed ({type(e).__name__}: {e}); "
                                                 f"is the disk full, or the folder not writable?") from e
    return path


def read_dcp_weights(path: str, key: str) -> dict[str, torch.Tensor]:
    """Full tensors of one top-level entry ("ema" or "model") of a step directory, in this process: unverified
    and without a collective (safe from a background thread; load_weights verifies first)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = SafeReader(path).read_metadata()
    prefix = key + "."
    state = {fqn[len(prefix):]: torch.empty(md.size, dtype=md.properties.dtype)
             for fqn, md in metadata.state_dict_metadata.items()
             if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
    if not state:
        raise KeyError(f"checkpoint {path!r} holds no {key!r} weights; use key='model' or another checkpoint")
    with quiet_single_process():
        dcp_load({key: state}, path, no_dist=True)
    return state


def load_weights(path: str, key: str | None = None, mmap: bool = False) -> dict[str, torch.Tensor]:
    """{official fqn: tensor} on the CPU from a .safetensors export, a .pt (a plain state_dict, or a training
    checkpoint {"model", "ema", ...} as the DiT release writes it) or a step directory. `key` picks "ema" or
    "model"; default: the EMA when the file has one (sampling wants the EMA). mmap: map the file's tensors instead
    of reading them (cheap for looking at keys and shapes); a tensor read has its own buffer, so a caller that
    converts the tensors frees each as it goes. Step directories (and files listed in one's manifest) are verified
    first (for a step directory in a process group a collective: call on every rank); nothing is
    unpickled beyond tensors."""
    path = os.fspath(path)
    kind = checkpoint_kind(path)
    if kind == "step":
        resolve_checkpoint(path)
        verify_checkpoint(path, names=[n for n in read_manifest(path) or {}
                                       if n == ".metadata" or n.endswith(".distcp")])
        return read_dcp_weights(path, key or ("ema" if read_meta(path)["has_ema"] else "model"))
    verify_listed_file(path)
    if kind == "safetensors":
        if key is not None:
            raise ValueError(f"{path!r} is a single-weights file; key={key!r} applies to .pt or step directories")
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path, device="cpu") if mmap else read_safetensors_file(path)
        except SafetensorError as e:
            raise CheckpointCorruptError(f"{path} is not a readable safetensors file ({e}): truncated or "
                                         f"corrupt; export it again or pass the step folder it came from") from None
    obj = load_torch_file(path, mmap)
    if isinstance(obj, dict) and ("ema" in obj or "model" in obj):
        chosen = key or ("ema" if "ema" in obj else "model")
        if chosen not in obj:
            raise KeyError(f"{path!r} has entries {sorted(obj)}; no {chosen!r}")
        obj = obj[chosen]
    elif key is not None:
        raise ValueError(f"{path!r} is a plain state_dict; it has no {key!r} entry, pass key=None")
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path!r} does not hold a state_dict of tensors")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def load_into_meta_model(model: torch.nn.Module, state: dict, source: str,
                         keep_dtype: bool | Collection[str] = False) -> None:
    """Fill a model built on the meta device with `state` (strict: every key, every shape): no time or memory
    goes into weights the file replaces (12B parameters take minutes to initialise). Tensors are taken as
    stored when keep_dtype is True (e.g. an official FLUX file's bf16, for a bf16 run) or names their key (e.g. a
    LoRA run's frozen Linears: opendit.lora.run.kept_as_stored), other floats become fp32, in `state` itself one
    tensor at a time, so each tensor read is freed as its fp32 copy is made (a bf16 file is never held beside the
    fp32 model)."""
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"{source} does not fit {type(model).__name__}: missing keys {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}; check --model "
                         f"(and the model's input settings) against the checkpoint")
    if keep_dtype is not True:
        keep = keep_dtype or ()
        for k, v in state.items():
            if v.is_floating_point() and k not in keep:
                state[k] = v.float()
    model.load_state_dict(state, strict=True, assign=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{source}: {type(model).__name__} has tensors outside its state dict ({left[:3]}); "
                         f"it cannot be filled from a file")


def _safetensors_header_ok(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return 0 < n <= size - 8 and head[8:9] == b"{"


def file_kind(path: str, accepted: str = ACCEPTED) -> str:
    """"safetensors" or "torch" (zip or legacy pickle) from a file's first bytes (and name); a clear error for
    a missing, empty or unrecognised file, naming it and listing what is accepted."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist; pass {accepted}")
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
    raise ValueError(f"{path!r} is not a checkpoint (neither a safetensors nor a torch file); pass {accepted}")


def checkpoint_kind(path: str, accepted: str = ACCEPTED) -> str:
    """What a --ckpt / load_weights argument is: "step" (a step directory), "safetensors" or "torch" (a .pt).
    A missing path, an empty or unrecognised file, or a folder that is not a step directory is an error naming
    it and listing what is `accepted` (a run or checkpoints folder: its step folders)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return file_kind(path, accepted)
    if is_step_dir(path):
        return "step"
    steps = sorted(str(p) for p in Path(path).glob("*step-*") if STEP_DIR.match(p.name))
    steps += sorted(str(p) for p in Path(path).glob("checkpoints/step-*") if STEP_DIR.match(p.name))
    hint = f" It holds step folders: pass one, e.g. {steps[-1]}." if steps else \
        f" It holds: {sorted(os.listdir(path))[:8]}."
    raise ValueError(f"{path!r} is a folder but not a checkpoint (no .metadata).{hint} Accepted: {accepted}")


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
