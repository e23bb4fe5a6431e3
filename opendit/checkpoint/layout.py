"""What a checkpoint step directory holds, and the state dict DCP saves into it.

A step directory root/step-000100 holds:
  .metadata, *.distcp   DCP: {"model", "optim", "ema"} in one FQN layout (official keys, no wrapper
                        prefixes; FSDP2 DTensors are saved sharded, DDP/plain tensors whole), so it
                        loads under ddp, zero2/zero3/hsdp or a single process, at any world size
  trainer.pt            step, lr scheduler state, rank 0's `extra`
  ranks/rank-00003.pt   each rank's RNG states (torch CPU, CUDA, numpy, python) and its own `extra`
                        (data position differs per rank; resolved config, ...)
  meta.json             step, world size, what is inside (for people and for resolve_checkpoint)
  manifest.json         every file above with its size and CRC-32 (manifest.py), written last
  ema.safetensors, ema.json, config.yaml   written beside it by the trainer, for sample.py (EXPORTS)
  lora.safetensors, lora_kohya.safetensors a LoRA run's adapters (instead of ema.*), diffusers and kohya layouts
"""
import json
import os
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

from opendit.checkpoint.manifest import CheckpointCorruptError
from opendit.ema import ShardedEMA

STEP_DIR = re.compile(r"^step-(\d+)$")
REQUIRED = (".metadata", "trainer.pt", "meta.json", "ranks")
# written beside a saved step, not read by a resume
EXPORTS = ("ema.safetensors", "ema.json", "config.yaml", "lora.safetensors", "lora_kohya.safetensors")


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def is_step_dir(path: str) -> bool:
    """A folder DCP wrote (or named like a step directory, to be reported as incomplete if it is)."""
    return os.path.isdir(path) and (os.path.exists(os.path.join(path, ".metadata")) or
                                    bool(STEP_DIR.match(os.path.basename(os.path.normpath(path)))))


def rank_file(path: str, rank: int) -> str:
    return os.path.join(path, "ranks", f"rank-{rank:05d}.pt")


def missing(path: str) -> list[str]:
    return [name for name in REQUIRED if not os.path.exists(os.path.join(path, name))]


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


def check_args(optimizer, ema, lr_scheduler) -> None:
    for name, obj, kind in (("optimizer", optimizer, torch.optim.Optimizer), ("ema", ema, ShardedEMA),
                            ("lr_scheduler", lr_scheduler, torch.optim.lr_scheduler.LRScheduler)):
        if obj is not None and not isinstance(obj, kind):
            raise TypeError(f"{name} must be a {kind.__name__} or None, got {type(obj).__name__} "
                            "(arguments in the wrong order? pass them by keyword)")


def state_options(trainable_only: bool) -> StateDictOptions:
    """Only the trainable parameters are saved and loaded (loading then leaves the frozen ones as they are)."""
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def app_state(model, optimizer, ema, trainable_only: bool = False) -> dict:
    """The DCP state dict: sharded (DTensor) or plain tensors, keyed by official FQNs. trainable_only: the
    parameters that require grad (and buffers), not the frozen ones (a LoRA run saves its adapters only)."""
    options = state_options(trainable_only)
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=options)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
    if ema is not None:
        state["ema"] = ema.state_dict()
    return state
