"""Checkpoints: one torch.distributed.checkpoint (DCP) directory per step, resumable at any world size or
plugin, plus single-file safetensors exports for sample.py. One job per module:

  layout.py      what a step directory holds (files, meta.json, the DCP state dict)
  manifest.py    manifest.json: every file's size and CRC-32, written last; verification on load
  discovery.py   run folders, complete step directories, `latest`, `--load auto`, leftovers of interrupted saves
  save.py        save_checkpoint: written under a temporary name, renamed when every rank has finished
  async_save.py  AsyncCheckpointer: the same save with the write in the background (--async_ckpt)
  load.py        load_checkpoint: resume into the boosted model, optimizer, EMA, scheduler and RNGs
  weights.py     single sets of weights: export, load_weights, load_into_meta_model, what a --ckpt file is
  safe_read.py   reading without running code: allow-listed DCP metadata, torch.load(weights_only=True)
  folders.py     weights as published: safetensors files, sharded checkpoints, pipeline component folders

Formats that are not opendit's own (a diffusers folder, an official release) are recognised and converted by the
model family that owns them (its WeightAdapter, opendit.families), never here: folders.py only reads files.
"""
from opendit.checkpoint.discovery import find_resume_checkpoint, latest_run_checkpoint, new_run_dir, resolve_checkpoint
from opendit.checkpoint.load import load_checkpoint
from opendit.checkpoint.manifest import CheckpointCorruptError, record_files
from opendit.checkpoint.save import save_checkpoint
from opendit.checkpoint.weights import (checkpoint_kind, export_ema, export_weights, load_into_meta_model,
                                        load_weights, read_dcp_weights)

__all__ = ["CheckpointCorruptError", "checkpoint_kind", "export_ema", "export_weights", "find_resume_checkpoint",
           "latest_run_checkpoint", "load_checkpoint", "load_into_meta_model", "load_weights", "new_run_dir",
           "read_dcp_weights", "record_files", "resolve_checkpoint", "save_checkpoint"]
