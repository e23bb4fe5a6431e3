"""The one home of defaults. Entry scripts turn flags into a config; library code takes plain values.

A config is a dataclass; `add_arguments` derives argparse flags from its fields, `from_args` builds it,
`save_yaml` / `load_yaml` round-trip it (unknown keys in a yaml are an error naming the key and the valid ones).
"""
import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass
class TrainConfig:
    # model and data
    model: str = "DiT-S/2"
    dataset: str = "digits"  # "digits" (built in, no download) or "folder" (ImageNet-style class folders)
    data_path: str | None = None
    image_size: int = 16
    num_classes: int = 10
    vae: str = "none"  # "none" trains in pixel space; else a diffusers AutoencoderKL folder or hub id
    vae_scale: float = 0.18215
    learn_sigma: bool = True
    class_dropout_prob: float = 0.1
    # schedule
    epochs: int = 1400
    max_steps: int = 0  # 0: run all epochs
    batch_size: int = 256  # global, over all data-parallel ranks
    grad_accum: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 0.0  # 0: off
    # optimizer (opendit/optim; docs/memory_lean.md). All defaults: torch's AdamW, as before
    optimizer: str = "adamw"  # adamw | nadamw | adan | adafactor (torch's)
    optimizer_offload: bool = False  # optimizer states in host memory, streamed per parameter
    optimizer_state_dtype: str = "fp32"  # fp32 | bf16 | u16 | f24
    master_weights: str = "fp32"  # fp32 | bf16_exact | bf16_stochastic | fp32_copy (bf16 params; needs bf16 mixed precision)
    fused_backward: bool = False  # update each parameter in its post-accumulate-grad hook; no full gradient set
    blocks_to_swap: int = 0  # keep the last N blocks' weights on the host (one process, --plugin ddp)
    ema_decay: float = 0.9999
    global_seed: int = 0
    num_workers: int = 4
    # logging and checkpoints
    log_every: int = 50
    ckpt_every: int = 5000
    keep_last: int = 3
    outputs: str = "outputs"
    load: str | None = None  # a checkpoint dir, or "latest" (newest complete checkpoint under --outputs)
    # distributed and speed
    plugin: str = "ddp"
    mixed_precision: str = "fp32"
    dp_replicate: int = 1
    grad_checkpoint: int = 0  # 0 off, 1 every block, k every k-th block
    compile: bool = False
    enable_modulate_kernel: bool = False
    enable_layernorm_kernel: bool = False
    enable_flashattn: bool = False
    sequence_parallel_size: int = 1
    sequence_parallel_type: str = "auto"


@dataclass
class SampleConfig:
    ckpt: str | None = None  # EMA export (.safetensors), training checkpoint dir, official DiT .pt, or "latest"
    outputs: str = "outputs"  # where "latest" looks (train.py's --outputs)
    model: str | None = None  # defaults come from the checkpoint's config.yaml when it has one
    image_size: int | None = None
    num_classes: int | None = None
    vae: str | None = None
    learn_sigma: bool | None = None
    in_channels: int | None = None
    cfg_scale: float = 4.0
    num_sampling_steps: int = 250
    sampler: str = "ddpm"  # "ddpm" or "ddim"
    ddim_eta: float = 0.0
    seed: int = 0
    class_labels: list[int] = field(default_factory=list)  # empty: cycle through all classes
    num_samples: int = 0  # 0: one per class label given (or per class)
    batch_size: int = 32  # per process
    out: str = "samples"
    npz: bool = False
    mixed_precision: str = "fp32"
    enable_flashattn: bool = False
    enable_modulate_kernel: bool = False
    enable_layernorm_kernel: bool = False
    sequence_parallel_size: int = 1
    sequence_parallel_type: str = "auto"


def _str2bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if v.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {v!r}")


def add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One --flag per field; bools take an optional value (`--compile` or `--compile false`)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, default = hints[f.name], f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kind = hint
        if typing.get_origin(hint) in (typing.Union, types.UnionType):  # "X | None" -> X
            kind = next(a for a in typing.get_args(hint) if a is not type(None))
        if kind is bool:
            parser.add_argument(f"--{f.name}", type=_str2bool, nargs="?", const=True, default=default)
        elif typing.get_origin(kind) is list:
            parser.add_argument(f"--{f.name}", type=typing.get_args(kind)[0], nargs="*", default=default)
        else:
            parser.add_argument(f"--{f.name}", type=kind, default=default)


def from_args(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def save_yaml(cfg, path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg) if dataclasses.is_dataclass(cfg) else cfg, sort_keys=False))


def load_yaml(cls, path):
    data = yaml.safe_load(Path(path).read_text()) or {}
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{path}: unknown config keys {unknown}; valid keys: {sorted(names)}")
    return cls(**data)
