"""Checkpoints: one torch.distributed.checkpoint (DCP) directory per step, resumable at any world size or
plugin, plus single-file safetensors exports for sample.py.

A step directory root/step-000100 holds:
  .metadata, *.distcp   DCP: {"model", "optim", "ema"} in one FQN layout (official keys, no wrapper
                        prefixes; FSDP2 DTensors are saved sharded, DDP/plain tensors whole), so it
                        loads under ddp, zero2/zero3/hsdp or a single process, at any world size
  trainer.pt            step, lr scheduler state, rank 0's `extra`
  ranks/rank-00003.pt   each rank's RNG states (torch CPU, CUDA, numpy, python) and its own `extra`
                        (data position differs per rank; resolved config, ...)
  meta.json             step, world size, what is inside (for people and for resolve_checkpoint)
  manifest.json         every file above with its size and CRC-32 (opendit/checkpoint_integrity.py), written
                        last; ema.safetensors/ema.json exported into the folder afterwards are added to it
  (ema.safetensors, ema.json, config.yaml: written beside it by train.py, for sample.py)

It is written as root/.tmp-step-000100 and renamed by rank 0 after every rank finished, so a crash or a full
disk mid-save never leaves a step-* directory that does not load; `.tmp-*` leftovers are ignored, and removed by
the next save or by find_resume_checkpoint (a training start with --load auto). A failed write is an OSError
naming the checkpoint folder (ENOSPC/EFBIG/EDQUOT: "disk full or file size limit"). After the rename, all but
the newest `keep_last` step directories are deleted.

Loading verifies the manifest (sizes always, checksums unless checksums=False): a truncated or corrupt file is
a CheckpointCorruptError naming it. `latest` (resolve_checkpoint, latest_run_checkpoint) and
find_resume_checkpoint skip a checkpoint that fails verification, with a warning naming it and why, and take
the previous one. Step directories saved before manifests existed load unverified.
"""
import io
import json
import logging
import os
import random
import shutil
import time
import warnings
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor

from opendit import checkpoint_integrity as integrity
from opendit.checkpoint_integrity import (CheckpointCorruptError, checkpoint_kind, checkpoint_problem,  # noqa: F401
                                          list_checkpoints, verify_checkpoint)
from opendit.ema import ShardedEMA
from opendit.safe_load import SafeReader, dcp_load, load_torch_file, safe_load
from opendit.seeding import mix_seed

log = logging.getLogger(__name__)


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _barrier() -> None:
    if _dist():
        dist.barrier()


@contextmanager
def _quiet_single_process():
    """DCP warns on every save/load without a process group; single-process runs are intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def latest_run_checkpoint(outputs: str, checksums: bool = True) -> str:
    """The newest complete, verifying checkpoint of the newest run folder (outputs/NNN-model/checkpoints) that
    has one. A newer checkpoint that fails verification is skipped with a warning naming it and why; none
    left: FileNotFoundError (no checkpoint at all) or CheckpointCorruptError (listing the failures).
    Leftovers of interrupted saves (.tmp-*) are ignored, not removed (a training run may be saving now)."""
    path, skipped = integrity.search_runs(outputs, checksums)
    if path is not None:
        return path
    if skipped:
        raise CheckpointCorruptError(f"latest: no checkpoint under {outputs} verifies: {'; '.join(skipped)}")
    runs = [p.name for p in integrity.run_folders(outputs)]
    raise FileNotFoundError(f"latest: no complete checkpoint under {outputs}/NNN-*/checkpoints (run folders: "
                            f"{runs}); train first, or pass a checkpoint folder")


def find_resume_checkpoint(outputs: str, checksums: bool = True, clean: bool = True) -> str | None:
    """For train.py --load auto (call on rank 0): the checkpoint `latest` would resume from (newest verifying
    one of the newest run folder that has one, skipping failing ones with a warning), or None when `outputs`
    holds no complete checkpoint at all (a first start: train from scratch, no error). If checkpoints exist
    but none verifies it raises CheckpointCorruptError rather than silently starting over. clean: remove the
    chosen run's `.tmp-*` leftovers of an interrupted save (the next save would)."""
    path, skipped = integrity.search_runs(outputs, checksums)
    if path is None:
        if skipped:
            raise CheckpointCorruptError(f"--load auto: checkpoints exist under {outputs} but none verifies "
                                         f"({'; '.join(skipped)}); pass one explicitly or move them away")
        return None
    if clean:
        _clean_tmp(os.path.dirname(path))
    return path


def resolve_checkpoint(path_or_latest: str | None, root: str | None = None, checksums: bool = True) -> str:
    """'latest' (or None) -> the newest complete step directory under root that verifies (a newer one that
    fails is skipped with a warning naming it and why); a path -> that directory, checked to be complete (a
    load verifies it). Raises FileNotFoundError naming the path and what is missing."""
    if path_or_latest in (None, "latest"):
        if root is None:
            raise ValueError("resolve_checkpoint('latest') needs root= (the run's checkpoint folder)")
        path, skipped = integrity.newest_verifying(root, checksums)
        if path is not None:
            return path
        if skipped:
            raise CheckpointCorruptError(f"no checkpoint under {root!r} verifies: {'; '.join(skipped)}")
        listing = sorted(os.listdir(root)) if os.path.isdir(root) else "folder does not exist"
        raise FileNotFoundError(f"no complete checkpoint (step-* with {', '.join(integrity.REQUIRED)}) under "
                                f"{root!r}; it holds: {listing}. Start without resume or pass a checkpoint path")
    path = str(path_or_latest)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path!r} is not a directory; pass a step-* directory or 'latest'")
    missing = integrity.missing(path)
    if missing:
        raise FileNotFoundError(f"checkpoint {path!r} is incomplete: missing {missing} (a save interrupted "
                                "before its rename?); pass another step directory or 'latest'")
    return path


def rng_state() -> dict:
    """This process's torch (CPU and current CUDA device), numpy and python RNG states, as tensors and plain
    Python values only, so a checkpoint loads with torch.load(weights_only=True) (no code runs on load)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, py_gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
             "python": [version, torch.tensor(internal, dtype=torch.int64), py_gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's current device
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, py_gauss = state["python"]
    random.setstate((version, tuple(int(v) for v in internal.tolist()), py_gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _seed_fallback(step: int, rank: int) -> None:
    """Deterministic RNG for a rank that has no saved state (resumed at a larger world size)."""
    seed = mix_seed(step, rank) % 2**32  # np.random.seed takes at most 32 bits
    torch.manual_seed(seed)  # seeds CUDA too
    np.random.seed(seed)
    random.seed(seed)


def _check_args(optimizer, ema, lr_scheduler) -> None:
    for name, obj, kind in (("optimizer", optimizer, torch.optim.Optimizer), ("ema", ema, ShardedEMA),
                            ("lr_scheduler", lr_scheduler, torch.optim.lr_scheduler.LRScheduler)):
        if obj is not None and not isinstance(obj, kind):
            raise TypeError(f"{name} must be a {kind.__name__} or None, got {type(obj).__name__} "
                            "(arguments in the wrong order? pass them by keyword)")


def _app_state(model, optimizer, ema) -> dict:
    """The DCP state dict: sharded (DTensor) or plain tensors, keyed by official FQNs."""
    options = StateDictOptions()
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=options)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
    if ema is not None:
        state["ema"] = ema.state_dict()
    return state


def _clean_tmp(root: str) -> None:
    """Remove `.tmp-*` leftovers of interrupted saves or deletions (rank 0 only)."""
    for name in os.listdir(root):
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _prune(root: str, keep_last: int) -> None:
    """Keep the newest `keep_last` complete step dirs. Each is renamed to .tmp-del-* before rmtree, so a
    deletion cut short leaves an ignored .tmp-* dir, never a half-deleted step-* dir."""
    for _, path in list_checkpoints(root)[:-keep_last]:
        doomed = os.path.join(root, ".tmp-del-" + os.path.basename(path))
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _write_trainer_files(tmp: str, step: int, lr_scheduler, extra: dict | None, has_ema: bool) -> dict:
    """Rank 0: trainer.pt (scheduler, extra) and meta.json, written before the rename like the rest; their
    manifest entries."""
    trainer = {"step": step, "lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict(),
               "extra": extra or {}}
    world = dist.get_world_size() if _dist() else 1
    meta = {"step": step, "world_size": world, "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "has_ema": has_ema, "has_lr_scheduler": lr_scheduler is not None, "extra_keys": sorted(extra or {})}
    return {"trainer.pt": integrity.write_bytes(os.path.join(tmp, "trainer.pt"), _torch_bytes(trainer)),
            "meta.json": integrity.write_bytes(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1).encode())}


def _write_rank_files(tmp, step, model, optimizer, ema, lr_scheduler, extra) -> dict:
    """This rank's part of a save: DCP shards, its rank file (rank 0: trainer.pt, meta.json); their manifest
    entries, checksummed by this rank."""
    writer = integrity.RecordingWriter(tmp)
    try:
        with _quiet_single_process():
            dcp.save(_app_state(model, optimizer, ema), checkpoint_id=tmp, storage_writer=writer,
                     no_dist=not _dist())
    except (Exception, dcp.api.CheckpointException) as e:
        if writer.write_errors:  # the OSError under torch.save's RuntimeError
            raise writer.write_errors[0] from e
        raise
    entries = integrity.describe_files(tmp, writer.written)
    rank_file = os.path.relpath(_rank_file(tmp, _rank()), tmp)
    entries[rank_file] = integrity.write_bytes(os.path.join(tmp, rank_file),
                                               _torch_bytes({"rng": rng_state(), "extra": extra or {}}))
    if _rank() == 0:
        entries.update(_write_trainer_files(tmp, step, lr_scheduler, extra, ema is not None))
    return entries


def save_checkpoint(root: str, step: int, model, optimizer=None, ema=None, lr_scheduler=None,
                    extra: dict | None = None, keep_last: int | None = None) -> str:
    """Save everything needed to resume at `step` into root/step-XXXXXX and return that path.

    A collective: call on every rank; `root` must be on a filesystem all ranks share. `extra` is a
    picklable dict saved per rank (data positions differ per rank): sampler state, resolved config, ...
    `keep_last`: keep only the newest K step dirs (None: keep all). Writes root/.tmp-step-XXXXXX, which
    rank 0 renames after every rank has written and manifest.json lists every file; re-saving an existing
    step replaces it. A failure on any rank raises on every rank (OSError naming the folder for write errors).
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    _check_args(optimizer, ema, lr_scheduler)
    final = os.path.join(root, step_dir_name(step))
    tmp = os.path.join(root, ".tmp-" + step_dir_name(step))
    failure, entries = None, {}
    if _rank() == 0:
        try:
            os.makedirs(root, exist_ok=True)
            _clean_tmp(root)
            os.makedirs(os.path.join(tmp, "ranks"))
        except OSError as e:
            failure = e
    if all(integrity.all_gather(failure is None)):  # every rank writes its files into tmp, then reports them
        try:
            entries = _write_rank_files(tmp, step, model, optimizer, ema, lr_scheduler, extra)
        except (Exception, dcp.api.CheckpointException) as e:
            failure = e
    reports = integrity.all_gather(entries if failure is None else None)
    if _rank() == 0 and None not in reports:  # rank 0: the manifest, the rename, pruning
        try:
            files = {name: entry for report in reports for name, entry in report.items()}
            found = [os.path.relpath(os.path.join(d, f), tmp) for d, _, fs in os.walk(tmp) for f in fs]
            files.update(integrity.describe_files(tmp, [f for f in found if f not in files]))  # every file
            integrity.write_manifest(tmp, files, step=step)
            if os.path.exists(final):  # re-saving a step: move the old one aside first (rename cannot overwrite)
                os.replace(final, os.path.join(root, ".tmp-old-" + step_dir_name(step)))
            os.replace(tmp, final)
            if keep_last is not None:
                _prune(root, keep_last)
            _clean_tmp(root)
        except Exception as e:
            failure = e
    error = None if failure is None else integrity.save_error(final, _rank(), failure)
    report = None if error is None else (isinstance(error, OSError), getattr(error, "errno", None), str(error))
    outcomes = integrity.all_gather(report)  # also the barrier: on success the step dir exists now
    disk = next((r for r in outcomes if r is not None and r[0]), None)  # a write error: the clearest cause
    if error is not None and (isinstance(error, OSError) or disk is None):
        raise error from (None if error is failure else failure)
    if disk is not None:
        raise OSError(disk[1], disk[2])
    failed = next((r for r in outcomes if r is not None), None)
    if failed is not None:
        raise RuntimeError(f"saving checkpoint {final} failed: {failed[2]}")
    return final


def load_checkpoint(path: str, model, optimizer=None, ema=None, lr_scheduler=None,
                    checksums: bool = True) -> tuple[int, dict]:
    """Restore a step directory (from save_checkpoint, any world size or plugin) into the given objects.

    A collective: call on every rank, with the objects already wrapped (booster.boost) and the EMA built.
    First verifies the files it reads against manifest.json (sizes; checksums unless checksums=False, each
    rank checking a share): CheckpointCorruptError naming a bad file. Restores this rank's RNG states; a rank
    that did not exist at save time gets a deterministic seed from (step, rank), rank 0's `extra` and a
    warning. Returns (step, this rank's extra).
    """
    _check_args(optimizer, ema, lr_scheduler)
    path = resolve_checkpoint(path)
    files = integrity.read_manifest(path) or {}
    verify_checkpoint(path, checksums, names=[n for n in files if n not in integrity.EXPORTS])
    meta = integrity.read_meta(path)
    if ema is not None and not meta["has_ema"]:
        raise ValueError(f"checkpoint {path!r} has no EMA; pass ema=None or start a fresh EMA from the weights")
    state = _app_state(model, optimizer, ema)
    _check_same_model(path, state["model"])
    with _quiet_single_process():
        dcp_load(state, path, no_dist=not _dist())
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=StateDictOptions())
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions())
    if ema is not None:
        ema.load_state_dict(state["ema"])
    trainer = safe_load(os.path.join(path, "trainer.pt"))
    if lr_scheduler is not None:
        if trainer["lr_scheduler"] is None:
            raise ValueError(f"checkpoint {path!r} has no lr scheduler state; pass lr_scheduler=None")
        lr_scheduler.load_state_dict(trainer["lr_scheduler"])
    return trainer["step"], _restore_rank_state(path, trainer, meta["world_size"])


def _check_same_model(path: str, model_state: dict) -> None:
    """A checkpoint of another model (other flags, e.g. --model or --image_size) is a ValueError naming the
    differing weights and the flags the checkpoint was saved with, before any data is read."""
    meta = SafeReader(path).read_metadata().state_dict_metadata
    saved = {k.removeprefix("model."): tuple(m.size) for k, m in meta.items()
             if k.startswith("model.") and hasattr(m, "size")}
    wanted = {k: tuple(v.shape) for k, v in model_state.items() if torch.is_tensor(v)}
    missing, unexpected = sorted(wanted.keys() - saved.keys()), sorted(saved.keys() - wanted.keys())
    shapes = [f"{k} {list(saved[k])} saved, {list(wanted[k])} here" for k in sorted(wanted.keys() & saved.keys())
              if saved[k] != wanted[k]]
    if not (missing or unexpected or shapes):
        return
    found = [f"{len(missing)} weights it lacks (e.g. {missing[0]})" if missing else "",
             f"{len(unexpected)} this model lacks (e.g. {unexpected[0]})" if unexpected else "",
             f"{len(shapes)} of another shape (e.g. {shapes[0]})" if shapes else ""]
    saved_with = ""
    try:
        import yaml

        with open(os.path.join(path, "config.yaml")) as f:
            run = yaml.safe_load(f) or {}
        saved_with = " (" + " ".join(f"--{k} {run[k]}" for k in ("model", "image_size", "num_classes",
                                                                 "num_frames", "vae") if run.get(k) is not None) + ")"
    except (OSError, ValueError, yaml.YAMLError):
        pass
    raise ValueError(f"checkpoint {path} holds another model than this run builds: {'; '.join(filter(None, found))}"
                     f". Resume with the flags it was saved with{saved_with}, or start from its weights "
                     f"with --init_weights")


def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, "ranks", f"rank-{rank:05d}.pt")


def _restore_rank_state(path: str, trainer: dict, saved_world: int) -> dict:
    """Set this rank's RNG states from the checkpoint and return its `extra`."""
    rank_file = _rank_file(path, _rank())
    if os.path.exists(rank_file):
        state = safe_load(rank_file)
        set_rng_state(state["rng"])
        return state["extra"]
    log.warning("checkpoint %s was saved by %d ranks and has no state for rank %d; seeding its RNG from "
                "(step, rank) and giving it rank 0's extra, so its random draws and data differ from the "
                "original run", path, saved_world, _rank())
    _seed_fallback(trainer["step"], _rank())
    return trainer["extra"]


def _sidecar(path: str) -> str:
    return os.path.splitext(path)[0] + ".json"


def export_weights(path: str, state_dict: dict[str, torch.Tensor], metadata: dict | None = None) -> str | None:
    """Write {fqn: full tensor} to one .safetensors file (+ a .json sidecar with `metadata`, e.g. model name
    and config) via a temporary name and a rename. No collective inside: only rank 0 writes, other ranks
    return None, so it may be called on all ranks or on rank 0 alone."""
    path = os.fspath(path)
    if _rank() != 0:
        return None
    from safetensors.torch import save_file

    if not path.endswith(".safetensors"):
        raise ValueError(f"export path {path!r} must end with .safetensors")
    bad = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor) or isinstance(v, DTensor)]
    if bad:
        raise TypeError(f"export_weights needs full plain tensors; {bad[:3]} are not (gather DTensors first, "
                        "e.g. ShardedEMA.full_state_dict())")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # safetensors refuses shared or strided storage: give each tensor its own contiguous CPU copy.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}
    tmp = path + ".tmp"
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        if metadata is not None:
            integrity.write_bytes(_sidecar(path) + ".tmp", json.dumps(metadata, indent=1, default=str).encode())
            os.replace(_sidecar(path) + ".tmp", _sidecar(path))
        os.replace(tmp, path)
        folder = os.path.dirname(os.path.abspath(path))  # an export into a step directory joins its manifest
        if integrity.STEP_DIR.match(os.path.basename(folder)):
            integrity.record_files(folder, [os.path.basename(p) for p in (path, _sidecar(path)) if os.path.isfile(p)])
    except Exception as e:  # safetensors reports a full disk as its own error type
        for leftover in (tmp, _sidecar(path) + ".tmp"):
            if os.path.exists(leftover):
                os.remove(leftover)
        raise OSError(getattr(e, "errno", None), f"exporting weights to {path} failed ({type(e).__name__}: {e}); "
                                                 f"is the disk full, or the folder not writable?") from e
    return path


def export_ema(ema: ShardedEMA, path: str, metadata: dict | None = None) -> str | None:
    """Gather a ShardedEMA and export it (a collective: call on every rank); rank 0 writes the file."""
    weights = ema.full_state_dict(rank0_only=True)
    out = export_weights(path, weights, metadata)
    _barrier()  # the file exists on return, on every rank
    return out


def _load_dcp_weights(path: str, key: str) -> dict[str, torch.Tensor]:
    """Full tensors of one top-level entry ("ema" or "model") of a step directory, in this process."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = SafeReader(path).read_metadata()
    prefix = key + "."
    state = {fqn[len(prefix):]: torch.empty(md.size, dtype=md.properties.dtype)
             for fqn, md in metadata.state_dict_metadata.items()
             if fqn.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
    if not state:
        raise KeyError(f"checkpoint {path!r} holds no {key!r} weights; use key='model' or another checkpoint")
    with _quiet_single_process():
        dcp_load({key: state}, path, no_dist=True)
    return state


def load_weights(path: str, key: str | None = None, mmap: bool = False) -> dict[str, torch.Tensor]:
    """{official fqn: tensor} on the CPU from a .safetensors export, an official DiT .pt (a plain state_dict
    or a training checkpoint {"model", "ema", ...}), a step directory, or a diffusers DiT folder (model folder
    with config.json, or pipeline folder with transformer/; converted to official keys). `key` picks "ema" or
    "model"; default: the EMA when the file has one (sampling wants the EMA). mmap: map a .pt's tensors
    instead of reading them (cheap for looking at keys and shapes). No collective inside. Step directories
    (and files listed in one's manifest) are verified first; nothing is unpickled beyond tensors."""
    from opendit.models.convert_diffusers import load_diffusers_dit

    path = os.fspath(path)
    kind = checkpoint_kind(path)
    if kind == "diffusers":
        if key is not None:
            raise ValueError(f"{path!r} is a diffusers folder with one set of weights; key={key!r} does not apply")
        return load_diffusers_dit(path)[1]
    if kind == "step":
        resolve_checkpoint(path)
        verify_checkpoint(path, names=[n for n in integrity.read_manifest(path) or {}
                                       if n == ".metadata" or n.endswith(".distcp")])
        return _load_dcp_weights(path, key or ("ema" if integrity.read_meta(path)["has_ema"] else "model"))
    integrity.verify_listed_file(path)
    if kind == "safetensors":
        if key is not None:
            raise ValueError(f"{path!r} is a single-weights file; key={key!r} applies to .pt or step directories")
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path, device="cpu")
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


def load_into_meta_model(model: torch.nn.Module, state: dict, source: str, keep_dtype: bool = False) -> None:
    """Fill a model built on the meta device with `state` (strict: every key, every shape): no time or memory
    goes into weights the file replaces (12B parameters take minutes to initialise). Tensors are taken as
    stored when keep_dtype (e.g. an official FLUX file's bf16, for a bf16 run), else floats become fp32."""
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"{source} does not fit {type(model).__name__}: missing keys {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}; check --model "
                         f"(and the model's input settings) against the checkpoint")
    if not keep_dtype:
        state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{source}: {type(model).__name__} has tensors outside its state dict ({left[:3]}); "
                         f"it cannot be filled from a file")
