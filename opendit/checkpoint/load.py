"""Resuming: restore a step directory (any world size or plugin it was saved at) into a boosted model, its
optimizer, EMA and lr scheduler, and this rank's RNG states. Loading verifies the manifest first (sizes always,
checksums unless checksums=False): a truncated or corrupt file is a CheckpointCorruptError naming it; a
checkpoint of another model is a ValueError naming the weights that differ and the flags it was saved with.
"""
import logging
import os

import torch
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

from opendit.checkpoint.discovery import resolve_checkpoint
from opendit.checkpoint.layout import EXPORTS, app_state, check_args, rank_file, read_meta, state_options
from opendit.checkpoint.manifest import read_manifest, verify_checkpoint
from opendit.checkpoint.safe_read import SafeReader, dcp_load, quiet_single_process, safe_load
from opendit.config_files import settings_of
from opendit.distributed import current_rank, in_process_group
from opendit.seeding import seed_from_coordinates, set_rng_state

log = logging.getLogger(__name__)


def load_checkpoint(path: str, model, optimizer=None, ema=None, lr_scheduler=None,
                    checksums: bool = True, trainable_only: bool = False) -> tuple[int, dict]:
    """Restore a step directory (from save_checkpoint, any world size or plugin) into the given objects.

    A collective: call on every rank, with the objects already wrapped (booster.boost) and the EMA built.
    First verifies the files it reads against manifest.json (sizes; checksums unless checksums=False, each
    rank checking a share): CheckpointCorruptError naming a bad file. Restores this rank's RNG states; a rank
    that did not exist at save time gets a deterministic seed from (step, rank), rank 0's `extra` and a
    warning. trainable_only: the checkpoint holds the trainable parameters only (save_checkpoint's flag); the
    frozen ones stay as they are. Returns (step, this rank's extra).
    """
    check_args(optimizer, ema, lr_scheduler)
    path = resolve_checkpoint(path)
    files = read_manifest(path) or {}
    verify_checkpoint(path, checksums, names=[n for n in files if n not in EXPORTS])
    meta = read_meta(path)
    if ema is not None and not meta["has_ema"]:
        raise ValueError(f"checkpoint {path!r} has no EMA; pass ema=None or start a fresh EMA from the weights")
    state = app_state(model, optimizer, ema, trainable_only)
    _check_same_model(path, state["model"])
    with quiet_single_process():
        dcp_load(state, path, no_dist=not in_process_group())
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=state_options(trainable_only))
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=state_options(trainable_only))
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
            run = settings_of(yaml.safe_load(f) or {})
        saved_with = " (" + " ".join(f"--{k} {run[k]}" for k in ("model", "image_size", "num_classes",
                                                                 "num_frames", "vae") if run.get(k) is not None) + ")"
    except (OSError, ValueError, yaml.YAMLError):
        pass
    raise ValueError(f"checkpoint {path} holds another model than this run builds: {'; '.join(filter(None, found))}"
                     f". Resume with the flags it was saved with{saved_with}, or start from its weights "
                     f"with --init_weights")


def _restore_rank_state(path: str, trainer: dict, saved_world: int) -> dict:
    """Set this rank's RNG states from the checkpoint and return its `extra`."""
    own = rank_file(path, current_rank())
    if os.path.exists(own):
        state = safe_load(own)
        set_rng_state(state["rng"])
        return state["extra"]
    log.warning("checkpoint %s was saved by %d ranks and has no state for rank %d; seeding its RNG from "
                "(step, rank) and giving it rank 0's extra, so its random draws and data differ from the "
                "original run", path, saved_world, current_rank())
    seed_from_coordinates(trainer["step"], current_rank())
    return trainer["extra"]
