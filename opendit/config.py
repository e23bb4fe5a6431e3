"""The one home of the shared options, merged with every model family's own into the configs of the entry scripts.

TrainConfig, SampleConfig and PreprocessConfig are dataclasses: the shared options below (TrainOptions,
SampleOptions, PreprocessOptions), then each registered family's `train_options`, `sample_options` or
`cache_options` (opendit.families.base.ModelFamily), made when first asked for and again when the registry changes
(a family registered later brings its flags). Every field is an `opendit.options.opt`: its help text, valid values
and range check. `build_parser` derives the argparse flags (help, defaults, choices, sections) from a config,
`from_args` builds one, `save_yaml` / `load_yaml` round-trip it (unknown keys in a yaml are an error naming the key
and the valid ones), and `check_config` refuses values no run can use. Only the entry scripts see flags; the
library takes these configs.
"""
import argparse
import dataclasses
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from opendit.booster import PLUGINS, PRECISIONS
from opendit.config_files import DECIDED, settings_of  # noqa: F401 (readers of a run's settings use it)
from opendit.data.digits import DIGITS_HELP, parse_digits
from opendit.data.latents import CACHE_DTYPES
from opendit.families import FAMILIES, all_datasets, all_models, all_samplers, family_of
from opendit.models.step_cache import CACHES
from opendit.optim import FORMATS, MASTER_MODES, OPTIMIZER_NAMES
from opendit.options import check_value, choices_of, default_of, grouped, help_of, opt
from opendit.parallel import KINDS


def _models():
    return list(all_models())


def _datasets():
    return list(all_datasets())


def _dataset_help() -> str:
    return "; ".join(f"{name}: {spec.help}" for name, spec in all_datasets().items())


def _sp_kinds():
    return [*KINDS, "auto"]


def flag_help(f) -> str:
    """A flag's help: its field's text, then each registered family's default of it in words (defaults_help)."""
    found = [fam.defaults_help[f.name] for fam in FAMILIES.values() if f.name in fam.defaults_help]
    return help_of(f) + (f" ({'; '.join(found)})" if found else "")


def _sp_help(lead: str):
    """A help text: `lead`, then which methods each model class declares (its parallel_plan)."""
    def text():
        kinds = {}
        for spec in all_models().values():
            kinds.setdefault(", ".join(spec.sp_kinds) or "none", {}).setdefault(spec.constructor.__name__)
        return f"{lead}; " + "; ".join(f"{k} ({', '.join(names)})" for k, names in kinds.items())
    return text


BUCKETS_HELP = ("aspect-ratio buckets instead of square crops: auto (sizes of about --bucket_area pixels, aspect "
                "ratios 1:4 to 4:1, sides multiples of the VAE's downsampling x the patch size), or a list WxH,WxH,... "
                "in pixels; each item goes to the nearest aspect ratio, is resized to cover it and center-cropped "
                "(captioned images, class folders, video CSVs)")


@dataclass
class SpeedOptions:
    """The speed flags train.py and sample.py share: one declaration each."""
    mixed_precision: str = opt("fp32", "compute dtype of the weights and activations (sampling's own math stays fp32; "
                                       "training in fp16 adds dynamic loss scaling)", PRECISIONS)
    compile: bool = opt(False, "torch.compile each block")
    enable_modulate_kernel: bool = opt(False, "fused Triton LayerNorm + adaLN modulate and gated residual")
    enable_layernorm_kernel: bool = opt(False, "fused LayerNorm (apex, else Triton)")
    enable_flashattn: bool = opt(False, "FlashAttention (flash-attn 3 or 2 when installed), else SDPA")


@dataclass
class SequenceParallelOptions:
    """Sequence parallelism, in train.py and sample.py alike."""
    sequence_parallel_size: int = opt(1, "split each sample's tokens over this many ranks (under torchrun); 1: off",
                                      check="positive")
    sequence_parallel_type: str = opt("auto", _sp_help("auto picks the model's method with the smaller "
                                                       "communication volume: dsp where declared, else fastseq at 2 "
                                                       "ranks, ulysses above"), _sp_kinds)


@dataclass
class TrainData:
    """The model and what it trains on."""
    model: str = opt("DiT-S/2", "model name; its family decides data, objective and sampler", _models)
    dataset: str = opt("digits", _dataset_help, _datasets)
    data_path: str | None = opt(None, "what the dataset reads: a class-folder root, a captioned folder or table, a "
                                      "video CSV, or a latent cache folder")
    dataset_config: str | None = opt(None, "a .toml or .yaml file listing datasets to mix, each with its kind, path, "
                                           "repeats, sizes and caption options (docs/training.md); replaces "
                                           "--dataset and --data_path")
    prior_loss_weight: float = opt(1.0, "the loss weight of the batches from a --dataset_config dataset marked "
                                        "prior = true (DreamBooth's prior preservation; python -m opendit.prior "
                                        "samples such images from the base)", check="nonneg")
    digits: str | None = opt(None, f"the built-in digits datasets (digits, captioned_digits): train on these digits "
                                   f"only, {DIGITS_HELP}; default: all ten")
    caption_extension: str = opt(".txt", "a captioned folder (--dataset captions): the extension of the caption file "
                                         "beside each image, e.g. .caption")
    image_size: int | None = opt(None, "pixels; default: a latent cache's size, else 16. With a VAE a multiple "
                                       "of its downsampling (8) x the patch size", check="positive")
    buckets: str | None = opt(None, BUCKETS_HELP)
    bucket_area: int | None = opt(None, "pixels per aspect-ratio bucket for --buckets auto; default: --image_size "
                                        "squared", check="positive")
    bucket_frames: list[int] = opt(help="video: the frame counts of the buckets (a clip goes to the longest it has "
                                        "frames for, shorter clips are left out); default: --num_frames",
                                   factory=list)
    num_classes: int | None = opt(None, "classes of the label embedding; default: the data's (digits 10, a "
                                        "folder's class folders, a cache's manifest)", check="positive")
    vae: str = opt("none", "none trains in pixel space; else a diffusers AutoencoderKL folder or hub id "
                           "(a latent cache names its own)")
    vae_scale: float | None = opt(None, "latents are multiplied by it; default: a cache's, else the family's",
                                  check="positive")
    num_workers: int | None = opt(None, "DataLoader worker processes per rank; default: this machine's CPU cores "
                                        "per process less one, at most 4", check="nonneg",
                                  fix="0 loads data in the main process")


@dataclass
class StreamFields:
    """What a sharded stream's samples hold and which to use: --dataset webdataset, parquet, hf (docs/data.md)."""
    image_key: str | None = opt(None, "where a stream's image (video: clip) is: tar member extensions or column names, "
                                      "comma-separated, the first present wins; default: jpg,jpeg,png,webp,image,img "
                                      "(video: mp4,webm,mkv,avi,mov,video)")
    caption_key: str | None = opt(None, "where a stream's caption is; json:FIELD reads a field of the sample's .json; "
                                        "default: txt,caption,text,json:caption,json:text")
    label_key: str | None = opt(None, "where a stream's class label is; default: cls,label,json:label,json:cls")
    crop: str = opt("center", "streams: where the square crop sits after the resize", ("center", "random"))
    min_image_size: int = opt(0, "streams: skip (and count) images or clips whose shorter side is below this many "
                                 "pixels", check="nonneg")
    max_aspect: float = opt(0.0, "streams: skip images whose long / short side exceeds this; 0: no limit",
                            check="nonneg")
    min_caption_chars: int = opt(0, "streams: skip samples whose caption is shorter", check="nonneg")
    max_caption_chars: int = opt(0, "streams: skip samples whose caption is longer; 0: no limit", check="nonneg")
    shard_cache: str | None = opt(None, "where remote (http) shards are kept, one copy per machine; default: "
                                        "~/.cache/opendit/shards")
    hf_args: str | None = opt(None, "--dataset hf: load_dataset's arguments as KEY=VALUE words, e.g. "
                                    "\"name=default split=train\" (split defaults to train)")


@dataclass
class StreamOrderOptions:
    """How a stream is read in training (docs/data.md)."""
    shuffle_buffer: int = opt(10000, "samples a stream shuffles together (a window of its shuffled shards)",
                              check="positive")
    stream_partitions: int = opt(1, "deal a stream's shards to this many partitions, each global batch taking the "
                                    "same count from each; a multiple of the data-parallel size reads each rank's "
                                    "own shards only (the same value resumes at any world size it divides)",
                                 check="positive")


@dataclass
class TrainSchedule:
    """How long and on how much."""
    epochs: int = opt(1400, "passes over the data (ignored when --max_steps is set)")
    max_steps: int = opt(0, "optimizer steps to train; 0: run all --epochs", check="nonneg",
                         fix="0 trains for --epochs")
    batch_size: int = opt(256, "global batch over all data-parallel ranks", check="positive",
                          fix="the global batch, e.g. 256")
    grad_accum: int = opt(1, "micro-batches per optimizer step (the batch is split into them)", check="positive")
    global_seed: int = opt(0, "seeds weights, noise, timesteps and data order; same seed, same run")


@dataclass
class TrainOptimizer:
    """The optimizer and its memory options."""
    lr: float = opt(1e-4, "AdamW learning rate", check="positive", fix="e.g. 1e-4 (DiT's)")
    weight_decay: float = opt(0.0, "AdamW weight decay", check="nonneg")
    warmup_steps: int = opt(0, "linear learning-rate warm-up steps", check="nonneg")
    grad_clip: float = opt(0.0, "clip the global gradient norm to this; 0: off", check="nonneg")
    optimizer: str = opt("adamw", "adamw (torch's, fused kernel on CUDA; opendit's when a lean option is set), "
                                  "nadamw, adan (opendit's), adafactor (torch's, --plugin ddp only)", OPTIMIZER_NAMES)
    optimizer_offload: bool = opt(False, "optimizer states in host memory, streamed per parameter")
    optimizer_state_dtype: str = opt("fp32", "storage of the optimizer states: fp32, bf16, u16 (block-wise "
                                             "companded, 2.03 bytes) or f24", FORMATS)
    master_weights: str = opt("fp32", "bf16 weights (needs --mixed_precision bf16) with an fp32 master copy "
                                      "(fp32_copy: the fast one-GPU step), an int16 residual (bf16_exact) or "
                                      "stochastic rounding (bf16_stochastic)", MASTER_MODES)
    fused_backward: bool = opt(False, "update each parameter in its gradient hook and free the gradient at once")
    blocks_to_swap: int = opt(0, "keep the last N blocks' weights on the host, streamed to the GPU one block "
                                 "ahead (one process, --plugin ddp)", check="nonneg")
    memory_budget: str | None = opt(None, "GPU_GiB[,HOST_GiB] or auto (90 percent of the free GPU and available "
                                          "host memory): choose the fastest memory options left at their defaults that "
                                          "fit (docs/memory_planner.md); the chosen ones are recorded in config.yaml")


@dataclass
class TrainEMA:
    """The weights' exponential moving average, which sampling uses."""
    ema_decay: float = opt(0.9999, "EMA of the weights, updated every step (starts as a copy); 0: no EMA (sampling "
                                   "uses the weights; saves 4 bytes per parameter)", check="fraction",
                           fix="0 turns the EMA off, DiT uses 0.9999")
    ema_on_host: bool = opt(False, "keep the EMA (fp32) in host memory, one process: e.g. flux-dev's 48 GB off the "
                                   "GPU; each step copies the weights to the host")


@dataclass
class TrainLogging:
    """What the run reports."""
    log_every: int = opt(50, "steps between log lines (loss, lr, img/s, MFU)", check="positive")
    val_every: int = opt(0, "steps between validation losses (fixed samples, stratified timesteps, fixed noise: "
                            "comparable across steps and runs); 0: off", check="nonneg")
    val_data_path: str | None = opt(None, "validation data of the same --dataset kind; default: --val_samples held "
                                          "out of the training data")
    val_samples: int = opt(256, "samples the validation loss averages over", check="positive")
    val_timesteps: int = opt(0, "score every validation sample at N equidistant noise levels k/N and average (the "
                                "MLPerf FLUX.1 benchmark's validation loss uses 8; N forward passes per sample); 0: "
                                "one level per sample, stratified over 4 buckets", check="nonneg")


@dataclass
class TrainPreviews:
    """Preview grids sampled while training."""
    sample_every: int = opt(0, "steps between preview grids sampled from the EMA (fixed classes or prompts and "
                               "noise) into <run>/previews and TensorBoard; 0: off", check="nonneg")
    preview_steps: int | None = opt(None, "denoising steps of a preview; default: the family's quick setting",
                                    check="positive")
    preview_cache: str = opt("none", "the step cache of previews (sample.py's --cache; teacache and fbcache at the "
                                     "family's default threshold)", CACHES)


@dataclass
class TrainCheckpoints:
    """Saving, resuming, starting from weights, surviving faults."""
    ckpt_every: int = opt(5000, "steps between checkpoints (and one at the end)", check="positive")
    keep_last: int = opt(3, "checkpoints kept; older ones are deleted", check="positive",
                         fix="the newest checkpoints kept, e.g. 3")
    async_ckpt: bool = opt(False, "write checkpoints in the background: the step waits only for the copy to host "
                                  "memory (one save in flight; the run's end waits for the last)")
    outputs: str = opt("outputs", "runs go to <outputs>/NNN-<model>/")
    load: str | None = opt(None, "resume: a checkpoint folder; latest: the newest complete one under --outputs "
                                 "(an error if there is none); auto: the same, else start fresh (for torchrun "
                                 "--max-restarts and requeued jobs)")
    save_on_signal: bool = opt(True, "on SIGTERM or SIGUSR1 (preemption) every rank saves a checkpoint after the "
                                     "current step and the run exits 0; false: the signal's default action")
    max_bad_steps: int = opt(20, "a step whose loss or gradient norm is not finite is skipped (nothing updated); "
                                 "this many in a row stop the run; 0: no check (saves a host sync per step)",
                             check="nonneg")
    dist_timeout: float = opt(10.0, "minutes a rank waits for its peers in a collective before it fails with an "
                                    "error (a dead or hung peer), instead of hanging", check="positive")
    init_weights: str | None = opt(None, "fine-tune: start from these weights at step 0 (an official checkpoint "
                                         "such as flux1-dev.safetensors or a DiT .pt, an EMA export); keys must "
                                         "match the model exactly")


@dataclass
class TrainLoRA:
    """Low-rank adapters on frozen weights."""
    lora_rank: int = opt(0, "train low-rank adapters of this rank on the frozen --init_weights (LoRA); 0: train "
                            "all weights", check="nonneg")
    lora_alpha: float | None = opt(None, "adapter scale numerator (scale = alpha / rank); default: the rank",
                                   check="positive")
    lora_dropout: float = opt(0.0, "dropout on the adapters' input", check="fraction")
    lora_targets: str | None = opt(None, "regex fully matching the Linear layers to adapt; default: the family's "
                                         "attention and MLP layers")
    init_lora: str | None = opt(None, "start the adapters from this LoRA file (diffusers/PEFT or kohya/ComfyUI "
                                      "layout, e.g. one made by another tool)")
    base_dtype: str = opt("auto", "how the frozen Linear weights of the model's blocks are stored: auto (the compute "
                                  "dtype: bf16 under --mixed_precision bf16, else fp32) or fp8 (float8_e4m3fn with a "
                                  "scale per output row, upcast layer by layer for the matmul: half of bf16's memory; "
                                  "--plugin ddp)", ("auto", "fp8"))


@dataclass
class TrainParallel:
    """How the work is spread over processes."""
    plugin: str = opt("ddp", "how the model is made data-parallel (see the plugin table in the README)", PLUGINS)
    dp_replicate: int = opt(1, "--plugin hsdp: replica groups (shards within, replicas across)", check="positive")


@dataclass
class TrainSpeed:
    """Speed settings of training only."""
    tf32: bool = opt(True, "allow TF32 matmuls and convolutions on NVIDIA GPUs in fp32 compute (the published "
                           "DiT recipe's setting); false: exact fp32")
    grad_checkpoint: int = opt(0, "activation checkpointing: 0 off, 1 every block, k every k-th block",
                               check="nonneg")


TrainOptions = grouped("TrainOptions",
                       ("model and data", TrainData), ("streamed data", StreamFields, StreamOrderOptions),
                       ("schedule", TrainSchedule), ("optimizer", TrainOptimizer), ("EMA", TrainEMA),
                       ("logging and validation", TrainLogging),
                       ("sampling previews", TrainPreviews), ("checkpoints and resuming", TrainCheckpoints),
                       ("LoRA", TrainLoRA), ("parallelism", TrainParallel, SequenceParallelOptions),
                       ("speed", SpeedOptions, TrainSpeed))


@dataclass
class SampleModel:
    """What to sample from."""
    ckpt: str | None = opt(None, "EMA export (.safetensors), training checkpoint folder, an official release or "
                                 "diffusers folder a model family knows, or latest (newest checkpoint under "
                                 "--outputs)")
    outputs: str = opt("outputs", "where --ckpt latest looks (train.py's --outputs)")
    model: str | None = opt(None, "default: the checkpoint's", _models, from_checkpoint=True)
    image_size: int | None = opt(None, "default: the checkpoint's", check="positive", from_checkpoint=True)
    num_classes: int | None = opt(None, "default: the checkpoint's", check="positive", from_checkpoint=True)
    height: int | None = opt(None, "pixels to sample at, any multiple of the VAE's downsampling x the patch size "
                                   "(e.g. 16 for DiT-XL/2 with SD's VAE); default: the trained --image_size",
                             check="positive")
    width: int | None = opt(None, "pixels, as --height; default: the trained --image_size", check="positive")
    vae: str | None = opt(None, "default: the checkpoint's (none: the model's own space, no decoding)",
                          from_checkpoint=True)
    in_channels: int | None = opt(None, "pixel-space channels when nothing says (default 1 for digits, else 3)",
                                  check="positive")
    lora: list[str] = opt(help="LoRA files to apply without merging, each FILE or FILE:STRENGTH (diffusers/PEFT or "
                               "kohya/ComfyUI layout; a LoRA run's checkpoint applies its own)", factory=list)


@dataclass
class SampleSampling:
    """The sampler and the conditions."""
    cfg_scale: float | None = opt(None, "classifier-free guidance scale, 1: off; default: the family's")
    num_sampling_steps: int | None = opt(None, "denoising steps; default: the family's", check="positive",
                                         fix="e.g. 250 (ddpm) or 50 (ddim)")
    sampler: str | None = opt(None, "the family's samplers", all_samplers)
    seed: int = opt(0, "sample i's noise depends only on (seed, i), whatever the number of processes")
    class_labels: list[int] = opt(help="classes to sample, cycled; default: every class", factory=list)
    prompts: list[str] = opt(help="captions to sample, cycled (a model trained on captions)", factory=list,
                             aliases=("--prompt",))
    prompts_file: str | None = opt(None, "a text file with one caption per line, appended to --prompts")
    num_samples: int = opt(0, "0: one per class label (or class)", check="nonneg")
    batch_size: int = opt(32, "per process", check="positive")


@dataclass
class SampleOutput:
    """What is written."""
    out: str = opt("samples", "output folder")
    npz: bool = opt(False, "also write samples.npz (uint8 [N, H, W, 3], video [N, T, H, W, 3]) for FID tools")


@dataclass
class SampleParallel:
    """Sampling over several processes."""
    cfg_parallel: bool = opt(False, "classifier-free guidance's conditional and unconditional halves on two rank "
                                    "groups (under torchrun: 2 x --sequence_parallel_size processes, or a "
                                    "multiple); needs --cfg_scale > 1")


@dataclass
class SampleDecode:
    """How the VAE decodes the samples."""
    vae_tiling: bool = opt(False, "decode with the VAE's own (diffusers') tiling: overlapping tiles, blended; bounds "
                                  "the decoder's memory for large images and videos (output differs slightly near "
                                  "seams)")
    vae_tile_size: int | None = opt(None, "a tile's side in pixels, a multiple of 4 x the VAE's downsampling (32 for "
                                          "an 8x VAE); turns --vae_tiling on; default: the VAE's own (diffusers': "
                                          "its config's sample_size, 256 for a causal video VAE)",
                                    check="positive")
    vae_batch: int = opt(64, "images, frames (a 2-D VAE decodes video frame by frame) or clips (a causal video "
                             "VAE) per decoder call", check="positive")
    parallel_decode: bool = opt(False, "the ranks that share each sample (--sequence_parallel_size, --cfg_parallel) "
                                       "split its decode: by images or frames, or by tiles (--vae_tiling) when there "
                                       "are fewer than ranks; a causal video VAE's clips never by frames")


@dataclass
class SampleCaches:
    """Reusing work across denoising steps."""
    cache: str = opt("none", "reuse the previous denoising step's work: teacache (skip every block while block 0's "
                             "modulated input has changed little), fbcache (skip all blocks after the first while its "
                             "residual has changed little), pab (broadcast attention outputs; video models); none: "
                             "off", CACHES)
    cache_threshold: float | None = opt(None, "teacache / fbcache: skip while the relative L1 change stays below it "
                                              "(0: never skip); default: the family's (see docs/sampling.md)",
                                              check="nonneg")
    pab_range: list[float] = opt(help="pab: START STOP, the fractions of the steps between which attention is "
                                      "broadcast (equal: never)", factory=lambda: [0.1, 0.9])
    pab_spatial_every: int = opt(2, "pab: recompute spatial (and full self-) attention every N steps in --pab_range",
                                 check="positive")
    pab_temporal_every: int = opt(4, "pab: recompute temporal attention every N steps in --pab_range",
                                  check="positive")
    pab_cross_every: int = opt(6, "pab: recompute cross-attention every N steps in --pab_range", check="positive")


SampleOptions = grouped("SampleOptions",
                        ("checkpoint and model", SampleModel), ("sampling", SampleSampling),
                        ("output", SampleOutput), ("parallelism", SequenceParallelOptions, SampleParallel),
                        ("VAE decoding", SampleDecode), ("step caches (docs/sampling.md)", SampleCaches),
                        ("speed", SpeedOptions))


@dataclass
class PreprocessData:
    family: str = opt("dit", "the model family whose data and encoders to cache", lambda: list(FAMILIES))
    dataset: str = opt("folder", "the data to encode (not a cache)", _datasets)
    data_path: str | None = opt(None, "what the dataset reads (e.g. the class-folder root)")
    image_size: int = opt(256, "pixels; a multiple of the VAE's downsampling", check="positive")
    buckets: str | None = opt(None, BUCKETS_HELP + "; each item is cached at its bucket's size")
    bucket_area: int | None = opt(None, "pixels per aspect-ratio bucket for --buckets auto; default: --image_size "
                                        "squared", check="positive")
    bucket_frames: list[int] = opt(help="video: the frame counts of the buckets; default: --num_frames",
                                   factory=list)
    vae: str = opt("stabilityai/sd-vae-ft-ema", "a diffusers AutoencoderKL folder or hub id")
    vae_scale: float | None = opt(None, "recorded in the manifest for training; default: the family's",
                                  check="positive")
    model: str | None = opt(None, "the model the cache is for (e.g. sets FLUX's default --t5_max_length)", _models)


@dataclass
class PreprocessCache:
    out: str | None = opt(None, "the cache folder to write (required)")
    batch_size: int = opt(64, "images per encoder call, per process", check="positive")
    flip_both: bool = opt(False, "also cache each image's horizontal flip")
    dtype: str = opt("float32", "storage of the posterior mean and std", CACHE_DTYPES)
    shard_size: int = opt(8192, "images per shard file", check="positive")
    cache_format: str = opt("npy", "npy: memory-mapped .npy shards; webdataset: tar shards that training streams "
                                   "(--dataset latents reads both; docs/data.md)", ("npy", "webdataset"))
    skip_existing: bool = opt(False, "webdataset caches: keep the finished shards of an interrupted run of the same "
                                     "--out and encode only the rest (at any world size)")
    num_workers: int = opt(4, "DataLoader worker processes per rank", check="nonneg")
    overwrite: bool = opt(False, "replace an existing cache folder")


PreprocessOptions = grouped("PreprocessOptions", ("data", PreprocessData), ("streamed data", StreamFields),
                            ("cache", PreprocessCache))


# ---- the merge ------------------------------------------------------------------------------------------------
_MERGED: dict[tuple, type] = {}
_PARTS = {"TrainConfig": (TrainOptions, "train_options"), "SampleConfig": (SampleOptions, "sample_options"),
          "PreprocessConfig": (PreprocessOptions, "cache_options")}


def _family_fields(part: str) -> tuple[list, dict]:
    """Every registered family's option fields of `part`, merged by name -> ([(name, type, field)], sections).
    A name two families share must have the same type and default; their help texts are joined. Fields are
    grouped by the families that have them, one help section per group ("dit and video family options")."""
    found: dict[str, list] = {}  # name -> [type, field, default, [(family, help)]]
    for family in FAMILIES.values():
        options = getattr(family, part)
        if options is None:
            continue
        hints = typing.get_type_hints(options)
        for f in dataclasses.fields(options):
            default = default_of(f)
            kind, first, first_default, helps = found.setdefault(f.name, [hints[f.name], f, default, []])
            if kind != hints[f.name] or first_default != default:
                raise TypeError(f"option --{f.name} of family {family.name!r} ({hints[f.name]}, default {default!r})"
                                f" differs from another family's ({kind}, default {first_default!r}); rename it")
            helps.append((family.name, help_of(f)))
    groups: dict[tuple, list] = {}  # the families that have a field -> its fields, in order of appearance
    for name, (kind, f, _, helps) in found.items():
        texts = list(dict.fromkeys(h for _, h in helps))
        text = texts[0] if len(texts) == 1 else "; ".join(f"{fam}: {h}" for fam, h in helps)
        new = dataclasses.field(default=f.default, default_factory=f.default_factory, metadata={**f.metadata,
                                                                                                "help": text})
        groups.setdefault(tuple(fam for fam, _ in helps), []).append((name, kind, new))
    fields = [f for group in groups.values() for f in group]
    sections = {group[0][0]: f"{' and '.join(sorted(owners))} family options" for owners, group in groups.items()}
    return fields, sections


def run_family(cfg_or_cls, values: dict):
    """(the run's family, the option that names it, the family options' part) of a train.py or preprocess.py config
    class given its --model / --family values; None where the family is not known when parsing (sample.py without
    --model: the checkpoint tells it; or a name that is not registered: the parser reports that)."""
    cls = cfg_or_cls if isinstance(cfg_or_cls, type) else type(cfg_or_cls)
    if issubclass(cls, (TrainOptions, SampleOptions)) and values.get("model") in all_models():
        part = _PARTS["TrainConfig" if issubclass(cls, TrainOptions) else "SampleConfig"][1]
        return family_of(values["model"]), f"--model {values['model']}", part
    if issubclass(cls, PreprocessOptions) and values.get("family") in FAMILIES:
        return FAMILIES[values["family"]], f"--family {values['family']}", _PARTS["PreprocessConfig"][1]
    return None


def option_owners(part: str) -> dict[str, list[str]]:
    """{family option name: the families whose `part` options have it}."""
    owners: dict[str, list[str]] = {}
    for family in FAMILIES.values():
        options = getattr(family, part)
        for f in dataclasses.fields(options) if options is not None else ():
            owners.setdefault(f.name, []).append(family.name)
    return owners


def foreign_names(family, part: str) -> set[str]:
    """The family options of other families that `family` does not have."""
    return {name for name, families in option_owners(part).items() if family.name not in families}


def foreign_options(cfg, given, run=None) -> str | None:
    """The error for options among `given` (names set on the command line or in a --config file) that belong to
    other model families than the run's, None when there are none. `run`: (family, what names it, options part);
    default run_family's (train.py: --model's; preprocess.py: --family; sample.py: --model's, else the
    checkpoint's, which sample.py asks once it has read it)."""
    run = run or run_family(cfg, dataclasses.asdict(cfg))
    if run is None:
        return None
    family, which, part = run
    foreign = sorted(set(given) & foreign_names(family, part))
    if not foreign:
        return None
    owners = option_owners(part)
    told = "; ".join(f"--{name} is an option of the {' and '.join(owners[name])} family" for name in foreign)
    return (f"{told}, not of the {family.name} family that {which} belongs to; leave "
            f"{'it' if len(foreign) == 1 else 'them'} out (or pick a model of that family)")


def config_class(name: str) -> type:
    """The config dataclass `name` (TrainConfig, SampleConfig, PreprocessConfig) of the registry as it is now."""
    base, part = _PARTS[name]
    key = (name, tuple((f.name, getattr(f, part)) for f in FAMILIES.values()))
    if key not in _MERGED:
        fields, sections = _family_fields(part)
        shared = {f.name for f in dataclasses.fields(base)}
        clash = sorted(shared & {f[0] for f in fields})
        if clash:
            raise TypeError(f"family options {clash} clash with the shared options of {name}; rename them")
        cls = dataclasses.make_dataclass(name, fields, bases=(base,), frozen=True,
                                         namespace={"SECTIONS": {**base.SECTIONS, **sections}, "__module__": __name__})
        _MERGED[key] = cls
    return _MERGED[key]


_FAMILY_CLASSES: dict[tuple, type] = {}


def family_class(family, name: str) -> type:
    """The config class of one family's runs: the shared options of `name` (TrainConfig, SampleConfig,
    PreprocessConfig) and that family's own only, frozen. It subclasses the family's options class when that is a
    frozen dataclass (the built-in ones are), so the family's hooks take `cfg: FluxTrainOptions` and mean it;
    another family's option is not an attribute of it."""
    base, part = _PARTS[name]
    options = getattr(family, part)
    key = (name, family.name, options)
    if key not in _FAMILY_CLASSES:
        own = [] if options is None else dataclasses.fields(options)
        inherit = options is not None and options.__dataclass_params__.frozen
        fields = [] if inherit or options is None else [
            (f.name, typing.get_type_hints(options)[f.name],
             dataclasses.field(default=f.default, default_factory=f.default_factory, metadata=f.metadata))
            for f in own]
        sections = {**base.SECTIONS, **({own[0].name: f"{family.name} family options"} if own else {})}
        title = "".join(word.capitalize() for word in family.name.replace(".", "_").split("_"))
        _FAMILY_CLASSES[key] = dataclasses.make_dataclass(
            f"{title}{name}", fields, bases=(options, base) if inherit else (base,), frozen=True,
            namespace={"SECTIONS": sections, "__module__": __name__})
    return _FAMILY_CLASSES[key]


def for_family(cfg, family=None, which: str | None = None):
    """`cfg` (any config: the merged one the flags make, or one of family_class's) as its family's own config
    (train.py, preprocess.py: the family that --model / --family names; else `family`, e.g. the checkpoint's, named
    by `which` in words). A value other than the default of an option of another family is the one-line refusal of
    foreign_options, as a ValueError."""
    name = next(n for n, (base, _) in _PARTS.items() if isinstance(cfg, base))
    if family is None:
        run = run_family(cfg, {"model": getattr(cfg, "model", None), "family": getattr(cfg, "family", None)})
        if run is None:  # a model that is not registered: the caller's checks name it
            return cfg
        family, which, _ = run
    cls = family_class(family, name)
    if type(cfg) is cls:
        return cfg
    keep = {f.name for f in dataclasses.fields(cls)}
    given = {f.name for f in dataclasses.fields(cfg) if f.name not in keep and getattr(cfg, f.name) != default_of(f)}
    refusal = foreign_options(cfg, given, (family, which, _PARTS[name][1]))
    if refusal:
        raise ValueError(refusal)
    return cls(**{k: getattr(cfg, k) for k in keep})


def __getattr__(name: str):
    if name in _PARTS:
        return config_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- flags ----------------------------------------------------------------------------------------------------
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
        hint, default = hints[f.name], default_of(f)
        kind = hint
        if typing.get_origin(hint) in (typing.Union, types.UnionType):  # "X | None" -> X
            kind = next(a for a in typing.get_args(hint) if a is not type(None))
        kw = {"default": default, "help": flag_help(f), "dest": f.name}
        choices = choices_of(f)
        if choices:
            kw["choices"] = choices
            if len(choices) > 8:
                kw["metavar"] = "NAME"
                kw["help"] += "; one of: " + ", ".join(choices)
        flags = [f"--{f.name}", *f.metadata.get("aliases", ())]
        if kind is bool:
            group.add_argument(*flags, type=_str2bool, nargs="?", const=True, metavar="BOOL", **kw)
        elif typing.get_origin(kind) is list:
            group.add_argument(*flags, type=typing.get_args(kind)[0], nargs="*", **kw)
        else:
            group.add_argument(*flags, type=kind, **kw)


def build_parser(cls, description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    add_arguments(parser, cls)
    return parser


def from_args(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def run_record(chosen, resolved=None, family=None) -> dict:
    """A run of an entry script as it records itself (train.py: config.yaml, the checkpoint, the EMA export's
    sidecar; sample.py beside its samples; preprocess.py in its cache): the options it was given (the shared ones and
    its model family's own only, so a process that lacks another family's module reads it; `family` where the
    config does not name it, sample.py), then in a `decided` table the values that its data, cache, checkpoint or
    machine settled and that differ from them (a captioned set's 0 classes, a cache's image size, the worker count).
    Without that table the record is the run's options, so the file is always a valid --config (the rerun decides
    the same values again); `settings_of` lays the table over the options for what reads how the run ran."""
    base, part = next(_PARTS[name] for name in _PARTS if isinstance(chosen, _PARTS[name][0]))
    if family is None:
        family = family_of(chosen.model) if isinstance(chosen, TrainOptions) else FAMILIES[chosen.family]
    options = getattr(family, part)
    names = {f.name for f in dataclasses.fields(base)} | \
        ({f.name for f in dataclasses.fields(options)} if options is not None else set())
    record = {k: v for k, v in dataclasses.asdict(chosen).items() if k in names}
    final = dataclasses.asdict(resolved) if resolved is not None else record
    decided = {k: final[k] for k in record if k in final and final[k] != record[k]}
    return {**record, DECIDED: decided} if decided else record


def save_yaml(cfg, path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg) if dataclasses.is_dataclass(cfg) else cfg, sort_keys=False))


def load_yaml(cls, path):
    """A config.yaml as the run it records ran (the values it decided laid over its options: settings_of)."""
    data = settings_of(yaml.safe_load(Path(path).read_text()) or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{path}: unknown config keys {unknown}; valid keys: {sorted(names)}")
    return cls(**data)


def check_config(cfg) -> list[str]:
    """Refuse the flag values no run can use, before anything is built (no process group, folder or model):
    a ValueError "--flag value: what it must be; the fix", which the entry scripts print as one line
    (opendit/cli.py). Returns warnings for values that work but are likely a mistake. Any config class."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    for name in sorted(fields):
        check_value(fields[name], getattr(cfg, name))
    if isinstance(cfg, TrainOptions) and cfg.max_steps == 0 and cfg.epochs < 1:
        raise ValueError(f"--epochs {cfg.epochs}: must be >= 1 when --max_steps is 0; set one of them")
    if isinstance(cfg, TrainOptions) and cfg.digits is not None:
        parse_digits(cfg.digits)
    if isinstance(cfg, SampleOptions) and not cfg.ckpt:
        raise ValueError("--ckpt is required: an EMA .safetensors, a checkpoint folder, an official DiT .pt, "
                         "or latest (the newest checkpoint under --outputs)")
    if isinstance(cfg, PreprocessOptions) and not cfg.out:
        raise ValueError("--out is required: the cache folder to write")
    warnings = []
    if getattr(cfg, "mixed_precision", None) == "fp16" and not torch.cuda.is_available():
        warnings.append("--mixed_precision fp16 without a CUDA GPU runs under CPU autocast, slower than fp32; on a "
                        "CPU use fp32 (or bf16)")
    return warnings
