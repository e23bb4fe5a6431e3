"""The options every run has, whatever its model family: train.py's (TrainOptions), sample.py's (SampleOptions) and
preprocess.py's (PreprocessOptions), each a frozen dataclass of named sections whose fields are `opendit.options.opt`
(help, valid values, range check). opendit.config merges them with each registered family's own options into the
entry scripts' configs; choices and help that name models, datasets or samplers read the registry when asked."""
from dataclasses import dataclass

from opendit.booster import PLUGINS, PRECISIONS
from opendit.data.digits import DIGITS_HELP
from opendit.data.latents import CACHE_DTYPES
from opendit.families import FAMILIES, all_datasets, all_models, all_samplers
from opendit.models.step_cache import CACHES
from opendit.optim import FORMATS, MASTER_MODES, OPTIMIZER_NAMES
from opendit.options import grouped, opt
from opendit.parallel import KINDS


def _models():
    return list(all_models())


def _datasets():
    return list(all_datasets())


def _dataset_help() -> str:
    return "; ".join(f"{name}: {spec.help}" for name, spec in all_datasets().items())


def _sp_kinds():
    return [*KINDS, "auto"]


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
    control_directory: str | None = opt(None, "editing pairs (--dataset edit_pairs): the folder of control images, "
                                              "each named as its target (photo.png; photo_0.png, photo_1.png, ... "
                                              "for several)")
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
    control_key: str | None = opt(None, "editing pairs from a stream (--dataset edit_webdataset, edit_parquet, "
                                        "edit_hf): where a sample's controls are, a field of one image or a list of "
                                        "them, or numbered (control_0.png, control_1.png, ...); default: control.jpg,"
                                        "control.jpeg,control.png,control.webp,control_image,control_images,control")
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
