"""The one home of defaults. Entry scripts turn flags into a config; library code takes plain values.

A config is a dataclass whose fields carry their help text and, where a registry defines the valid values
(models, plugins, precisions, samplers, ...), a function that lists them: `build_parser` derives the argparse
flags (help, defaults, choices, sections) from it, `from_args` builds the config, `save_yaml` / `load_yaml`
round-trip it (unknown keys in a yaml are an error naming the key and the valid ones).
"""
import argparse
import dataclasses
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


# Valid values, read from the registries that define them (imported when a parser is built, not before).
def _models():
    from opendit.families import all_models
    return list(all_models())


def _families():
    from opendit.families import FAMILIES
    return list(FAMILIES)


def _datasets():
    from opendit.families import all_datasets
    return list(all_datasets())


def _samplers():
    from opendit.families import all_samplers
    return list(all_samplers())


def _plugins():
    from opendit.booster.plugins import PLUGINS
    return list(PLUGINS)


def _precisions():
    from opendit.booster.precision import PRECISIONS
    return list(PRECISIONS)


def _optimizers():
    from opendit.training.optimizer import OPTIMIZER_NAMES
    return list(OPTIMIZER_NAMES)


def _state_formats():
    from opendit.optim import FORMATS
    return list(FORMATS)


def _master_modes():
    from opendit.optim import MASTER_MODES
    return list(MASTER_MODES)


def _sp_kinds():
    from opendit.parallel import KINDS
    return [*KINDS, "auto"]


def _timestep_samplings():
    from opendit.diffusion.flow import TIMESTEP_SAMPLINGS
    return list(TIMESTEP_SAMPLINGS)


def _cache_dtypes():
    from opendit.data.latents import CACHE_DTYPES
    return list(CACHE_DTYPES)


def opt(default=None, help: str = "", choices=None, factory=None):
    """A config field with its help text and (optionally) a function listing its valid values."""
    meta = {"help": help, "choices": choices}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    SECTIONS = {"model": "model and data", "epochs": "schedule", "optimizer": "optimizer and EMA",
                "log_every": "logging and checkpoints", "plugin": "distributed and speed"}
    model: str = opt("DiT-S/2", "model name; its family decides data, objective and sampler", _models)
    dataset: str = opt("digits", "digits (built in, no download), folder (ImageNet-style class folders) or "
                                 "latents (a cache written by preprocess.py)", _datasets)
    data_path: str | None = opt(None, "the class-folder root or the latent cache folder")
    image_size: int | None = opt(None, "pixels; default: a latent cache's size, else 16. With a VAE a multiple "
                                       "of its downsampling (8) x the patch size")
    num_classes: int | None = opt(None, "classes of the label embedding; default: the data's (digits 10, a "
                                        "folder's class folders, a cache's manifest)")
    vae: str = opt("none", "none trains in pixel space; else a diffusers AutoencoderKL folder or hub id "
                           "(a latent cache names its own)")
    vae_scale: float | None = opt(None, "latents are multiplied by it; default: a cache's, else the family's "
                                        "VAE scale (SD's 0.18215 for DiT)")
    learn_sigma: bool = opt(True, "the model also predicts the variance (DiT's IDDPM loss); false: fixed variance")
    class_dropout_prob: float = opt(0.1, "labels replaced by the null class (captions by the empty one) this "
                                         "often, for classifier-free guidance")
    num_frames: int | None = opt(None, "video: frames per clip; default: a latent cache's, else 16")
    frame_interval: int | None = opt(None, "video: take every k-th frame of the source video; default: a "
                                           "cache's, else 1")
    clip: str = opt("none", "a local CLIP text encoder folder (transformers save_pretrained layout, or a "
                            "pipeline folder with text_encoder/); video: captions then condition instead of "
                            "class labels; FLUX: the pooled vector (CLIP-L), required")
    t5: str = opt("none", "FLUX: a local T5 encoder folder (T5EncoderModel + tokenizer, or a pipeline folder with "
                          "text_encoder_2/), required")
    t5_max_length: int | None = opt(None, "FLUX: T5 tokens per caption; default: a cache's, else the model's "
                                          "(flux-dev 512, flux-schnell 256, flux-debug 16)")
    text_dropout_prob: float = opt(0.447, "FLUX: each text encoder's output is replaced by the empty caption's "
                                          "this often, independently (0.447: about 20%% of samples see neither)")
    timestep_sampling: str = opt("logit_normal", "FLUX: training t ~ sigmoid(N(0, 1)) or uniform, then FLUX's "
                                                 "resolution-dependent shift", _timestep_samplings)
    guidance: float = opt(1.0, "FLUX models with a guidance embedding (flux-dev, flux-debug): the value it sees "
                               "while training")
    epochs: int = opt(1400, "passes over the data (ignored when --max_steps is set)")
    max_steps: int = opt(0, "optimizer steps to train; 0: run all --epochs")
    batch_size: int = opt(256, "global batch over all data-parallel ranks")
    grad_accum: int = opt(1, "micro-batches per optimizer step (the batch is split into them)")
    lr: float = opt(1e-4, "AdamW learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    warmup_steps: int = opt(0, "linear learning-rate warm-up steps")
    grad_clip: float = opt(0.0, "clip the global gradient norm to this; 0: off")
    optimizer: str = opt("adamw", "adamw (torch's, fused kernel on CUDA; opendit's when a lean option is set), "
                                  "nadamw, adan (opendit's), adafactor (torch's, --plugin ddp only)", _optimizers)
    optimizer_offload: bool = opt(False, "optimizer states in host memory, streamed per parameter")
    optimizer_state_dtype: str = opt("fp32", "storage of the optimizer states: fp32, bf16, u16 (block-wise "
                                             "companded, 2.03 bytes) or f24", _state_formats)
    master_weights: str = opt("fp32", "bf16 weights (needs --mixed_precision bf16) with an fp32 master copy "
                                      "(fp32_copy: the fast one-GPU step), an int16 residual (bf16_exact) or "
                                      "stochastic rounding (bf16_stochastic)", _master_modes)
    fused_backward: bool = opt(False, "update each parameter in its gradient hook and free the gradient at once")
    blocks_to_swap: int = opt(0, "keep the last N blocks' weights on the host, streamed to the GPU one block "
                                 "ahead (one process, --plugin ddp)")
    ema_decay: float = opt(0.9999, "EMA of the weights, updated every step (starts as a copy); 0: no EMA (sampling "
                                   "uses the weights; saves 4 bytes per parameter)")
    ema_on_host: bool = opt(False, "keep the EMA (fp32) in host memory, one process: e.g. flux-dev's 48 GB off the "
                                   "GPU; each step copies the weights to the host")
    global_seed: int = opt(0, "seeds weights, noise, timesteps and data order; same seed, same run")
    num_workers: int | None = opt(None, "DataLoader worker processes per rank; default: this machine's CPU cores "
                                        "per process less one, at most 4")
    log_every: int = opt(50, "steps between log lines (loss, lr, img/s, MFU)")
    val_every: int = opt(0, "steps between validation losses (fixed samples, stratified timesteps, fixed noise: "
                            "comparable across steps and runs); 0: off")
    val_data_path: str | None = opt(None, "validation data of the same --dataset kind; default: --val_samples held "
                                          "out of the training data")
    val_samples: int = opt(256, "samples the validation loss averages over")
    sample_every: int = opt(0, "steps between preview grids sampled from the EMA (fixed classes or prompts and "
                               "noise) into <run>/previews and TensorBoard; 0: off")
    preview_steps: int | None = opt(None, "denoising steps of a preview; default: the family's quick setting")
    ckpt_every: int = opt(5000, "steps between checkpoints (and one at the end)")
    keep_last: int = opt(3, "checkpoints kept; older ones are deleted")
    outputs: str = opt("outputs", "runs go to <outputs>/NNN-<model>/")
    load: str | None = opt(None, "resume: a checkpoint folder; latest: the newest complete one under --outputs "
                                 "(an error if there is none); auto: the same, else start fresh (for torchrun "
                                 "--max-restarts and requeued jobs)")
    save_on_signal: bool = opt(True, "on SIGTERM or SIGUSR1 (preemption) every rank saves a checkpoint after the "
                                     "current step and the run exits 0; false: the signal's default action")
    max_bad_steps: int = opt(20, "a step whose loss or gradient norm is not finite is skipped (nothing updated); "
                                 "this many in a row stop the run; 0: no check (saves a host sync per step)")
    dist_timeout: float = opt(10.0, "minutes a rank waits for its peers in a collective before it fails with an "
                                    "error (a dead or hung peer), instead of hanging")
    init_weights: str | None = opt(None, "fine-tune: start from these weights at step 0 (an official checkpoint "
                                         "such as flux1-dev.safetensors or a DiT .pt, an EMA export); keys must "
                                         "match the model exactly")
    plugin: str = opt("ddp", "how the model is made data-parallel (see the README's plugin table)", _plugins)
    mixed_precision: str = opt("fp32", "compute dtype; fp16 adds dynamic loss scaling", _precisions)
    tf32: bool = opt(True, "allow TF32 matmuls and convolutions on NVIDIA GPUs in fp32 compute (the published "
                           "DiT recipe's setting); false: exact fp32")
    dp_replicate: int = opt(1, "--plugin hsdp: replica groups (shards within, replicas across)")
    grad_checkpoint: int = opt(0, "activation checkpointing: 0 off, 1 every block, k every k-th block")
    compile: bool = opt(False, "torch.compile each block")
    enable_modulate_kernel: bool = opt(False, "fused Triton LayerNorm + adaLN modulate and gated residual")
    enable_layernorm_kernel: bool = opt(False, "fused LayerNorm (apex, else Triton)")
    enable_flashattn: bool = opt(False, "FlashAttention (flash-attn 3 or 2 when installed), else SDPA")
    sequence_parallel_size: int = opt(1, "split each sample's tokens over this many ranks; 1: off")
    sequence_parallel_type: str = opt("auto", "auto picks the model's method with the smaller communication "
                                              "volume: fastseq at 2 ranks, ulysses above (DiT, VDiT); dsp for "
                                              "Latte", _sp_kinds)


@dataclass
class SampleConfig:
    SECTIONS = {"ckpt": "checkpoint and model", "cfg_scale": "sampling", "out": "output",
                "mixed_precision": "speed and parallelism"}
    ckpt: str | None = opt(None, "EMA export (.safetensors), training checkpoint folder, official DiT .pt, "
                                 "diffusers DiT folder, or latest (newest checkpoint under --outputs)")
    outputs: str = opt("outputs", "where --ckpt latest looks (train.py's --outputs)")
    model: str | None = opt(None, "default: the checkpoint's", _models)
    image_size: int | None = opt(None, "default: the checkpoint's")
    num_classes: int | None = opt(None, "default: the checkpoint's")
    vae: str | None = opt(None, "default: the checkpoint's (none: the model's own space, no decoding)")
    clip: str | None = opt(None, "CLIP text encoder folder; default: the checkpoint's")
    t5: str | None = opt(None, "FLUX: T5 encoder folder; default: the checkpoint's")
    learn_sigma: bool | None = opt(None, "default: the checkpoint's")
    in_channels: int | None = opt(None, "pixel-space channels when nothing says (default 1 for digits, else 3)")
    cfg_scale: float | None = opt(None, "classifier-free guidance scale, 1: off; default: the family's (DiT and "
                                        "video 4; FLUX 1: its guidance embedding instead, see --guidance)")
    num_sampling_steps: int | None = opt(None, "denoising steps; default: the family's (DiT and video 250; FLUX: "
                                               "flux-schnell 4, others 50)")
    sampler: str | None = opt(None, "ddpm (ancestral) or ddim (DiT, video; default ddpm); euler (FLUX)", _samplers)
    guidance: float = opt(3.5, "FLUX models with a guidance embedding (flux-dev): the guidance they are given")
    negative_prompt: str = opt("", "FLUX with --cfg_scale > 1 (true classifier-free guidance): the unconditional "
                                   "caption")
    ddim_eta: float = opt(0.0, "DDIM noise; 0: deterministic")
    seed: int = opt(0, "sample i's noise depends only on (seed, i), whatever the number of processes")
    class_labels: list[int] = opt(help="classes to sample, cycled; default: every class", factory=list)
    prompts: list[str] = opt(help="captions to sample, cycled (a model trained on captions)", factory=list)
    prompts_file: str | None = opt(None, "a text file with one caption per line, appended to --prompts")
    num_samples: int = opt(0, "0: one per class label (or class)")
    batch_size: int = opt(32, "per process")
    out: str = opt("samples", "output folder")
    npz: bool = opt(False, "also write samples.npz (uint8 [N, H, W, 3], video [N, T, H, W, 3]) for FID tools")
    fps: int = opt(8, "video: frames per second of the MP4s and the GIF")
    mixed_precision: str = opt("fp32", "the model's weights and compute (the sampler's math stays fp32)",
                               _precisions)
    compile: bool = opt(False, "torch.compile each block")
    enable_flashattn: bool = opt(False, "FlashAttention when installed, else SDPA")
    enable_modulate_kernel: bool = opt(False, "fused Triton LayerNorm + adaLN modulate")
    enable_layernorm_kernel: bool = opt(False, "fused LayerNorm (apex, else Triton)")
    sequence_parallel_size: int = opt(1, "split each sample's tokens over this many ranks (under torchrun)")
    sequence_parallel_type: str = opt("auto", "fastseq, ulysses (DiT, VDiT), dsp (Latte), or auto", _sp_kinds)


@dataclass
class PreprocessConfig:
    SECTIONS = {"family": "data", "out": "cache"}
    family: str = opt("dit", "the model family whose data and encoders to cache", _families)
    dataset: str = opt("folder", "the images to encode (not latents)", _datasets)
    data_path: str | None = opt(None, "the class-folder root")
    image_size: int = opt(256, "pixels; a multiple of the VAE's downsampling")
    num_frames: int = opt(16, "video: frames per clip")
    frame_interval: int = opt(1, "video: take every k-th frame of the source video")
    vae: str = opt("stabilityai/sd-vae-ft-ema", "a diffusers AutoencoderKL folder or hub id")
    vae_scale: float | None = opt(None, "recorded in the manifest for training; default: the family's")
    clip: str = opt("none", "FLUX: the CLIP text encoder folder whose pooled vectors to cache")
    t5: str = opt("none", "FLUX: the T5 encoder folder whose token embeddings to cache")
    t5_max_length: int | None = opt(None, "FLUX: T5 tokens per caption; default: the model's (see --model)")
    model: str | None = opt(None, "FLUX: the model the cache is for (sets the default --t5_max_length)", _models)
    out: str | None = opt(None, "the cache folder to write (required)")
    batch_size: int = opt(64, "images per encoder call, per process")
    flip_both: bool = opt(False, "also cache each image's horizontal flip")
    dtype: str = opt("float32", "storage of the posterior mean and std", _cache_dtypes)
    shard_size: int = opt(8192, "images per shard file")
    num_workers: int = opt(4, "DataLoader worker processes per rank")
    overwrite: bool = opt(False, "replace an existing cache folder")


def _str2bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if v.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {v!r}")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the module docstring's layout; appends "(default: X)" where a default is set; never breaks a
    line inside a hyphenated name (DiT-XL/2)."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and action.default not in (None, [], argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One --flag per field, grouped by the class's SECTIONS; bools take an optional value (`--compile` or
    `--compile false`); long lists of choices are shown in the help instead of the usage line."""
    hints, sections, group = typing.get_type_hints(cls), getattr(cls, "SECTIONS", {}), parser
    for f in dataclasses.fields(cls):
        if f.name in sections:
            group = parser.add_argument_group(sections[f.name])
        hint, default = hints[f.name], f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kind = hint
        if typing.get_origin(hint) in (typing.Union, types.UnionType):  # "X | None" -> X
            kind = next(a for a in typing.get_args(hint) if a is not type(None))
        kw = {"default": default, "help": f.metadata.get("help", "")}
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]()
            if len(kw["choices"]) > 8:
                kw["metavar"] = "NAME"
                kw["help"] += "; one of: " + ", ".join(kw["choices"])
        if kind is bool:
            group.add_argument(f"--{f.name}", type=_str2bool, nargs="?", const=True, metavar="BOOL", **kw)
        elif typing.get_origin(kind) is list:
            group.add_argument(f"--{f.name}", type=typing.get_args(kind)[0], nargs="*", **kw)
        else:
            group.add_argument(f"--{f.name}", type=kind, **kw)


def build_parser(cls, description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    add_arguments(parser, cls)
    return parser


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


def check_config(cfg) -> list[str]:
    """Refuse the flag values no run can use, before anything is built (no process group, folder or model):
    a ValueError "--flag value: what it must be; the fix", which the entry scripts print as one line
    (opendit/cli.py). Returns warnings for values that work but are likely a mistake. Any config class."""
    import math

    pos, nonneg = (lambda v: v > 0, "must be {a}> 0"), (lambda v: v >= 0, "must be {a}>= 0")
    prob = (lambda v: 0 <= v <= 1, "must be a probability in [0, 1]")
    rules = dict.fromkeys(["batch_size", "lr", "log_every", "ckpt_every", "keep_last", "grad_accum", "image_size",
                           "num_classes", "num_frames", "frame_interval", "t5_max_length", "vae_scale", "shard_size",
                           "num_sampling_steps", "fps", "dp_replicate", "sequence_parallel_size", "in_channels",
                           "dist_timeout", "val_samples", "preview_steps"], pos)
    rules.update(dict.fromkeys(["max_steps", "warmup_steps", "grad_clip", "weight_decay", "num_workers",
                                "num_samples", "ddim_eta", "grad_checkpoint", "blocks_to_swap", "max_bad_steps",
                                "val_every", "sample_every"],
                               nonneg))
    rules.update(class_dropout_prob=prob, text_dropout_prob=prob,
                 ema_decay=(lambda v: 0 <= v < 1, "must be in [0, 1): 0 turns the EMA off, DiT uses 0.9999"))
    fixes = dict(max_steps="0 trains for --epochs", lr="e.g. 1e-4 (DiT's)", batch_size="the global batch, e.g. 256",
                 keep_last="the newest checkpoints kept, e.g. 3", num_workers="0 loads data in the main process",
                 num_sampling_steps="e.g. 250 (ddpm) or 50 (ddim)")
    names = {f.name for f in dataclasses.fields(cfg)}
    for name in sorted(names):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # None: the default decides
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"--{name} {value}: must be a finite number")
        if name in rules and not rules[name][0](value):
            fix = f"; {fixes[name]}" if name in fixes else ""
            what = rules[name][1].format(a="an integer " if isinstance(value, int) else "")
            raise ValueError(f"--{name} {value}: {what}{fix}")
    if "epochs" in names and cfg.max_steps == 0 and cfg.epochs < 1:
        raise ValueError(f"--epochs {cfg.epochs}: must be >= 1 when --max_steps is 0; set one of them")
    if "ckpt" in names and not cfg.ckpt:
        raise ValueError("--ckpt is required: an EMA .safetensors, a checkpoint folder, an official DiT .pt, "
                         "or latest (the newest checkpoint under --outputs)")
    if isinstance(cfg, PreprocessConfig) and not cfg.out:
        raise ValueError("--out is required: the cache folder to write")
    warnings = []
    if getattr(cfg, "mixed_precision", None) == "fp16":
        import torch
        if not torch.cuda.is_available():
            warnings.append("--mixed_precision fp16 without a CUDA GPU runs under CPU autocast, slower than "
                            "fp32; on a CPU use fp32 (or bf16)")
    return warnings
