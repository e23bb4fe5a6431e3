"""The seam every model family plugs into: registry entries, the model contract, and the family interface.

A family bundles what differs between image DiT, video DiT and FLUX: its model names, its options and datasets,
what a batch means, the conditioning encoders, the objective, the sampler, the FLOP count, the latent shape and
what sampling writes. `Trainer`, `opendit.inference`, `sample.py` and `preprocess.py` ask the family; none of them
names a family, dataset, encoder or sampler. docs/architecture.md walks through adding one.
"""
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn as nn

from opendit.checkpoint import load_weights
from opendit.checkpoint.folders import model_folder, read_config, read_safetensors
from opendit.data import DatasetSpec, distinct_captions
from opendit.encoders.vae_decode import DecodeOptions
from opendit.families.writers import ImageWriter
from opendit.options import opt


@dataclass(frozen=True)
class ModelSpec:
    """One registry entry: `name` (e.g. "DiT-XL/2") builds `constructor(**arch, **kwargs)`.

    arch holds the fixed architecture (depth, widths, heads, patch); kwargs the run's settings (input size,
    channels, classes). constants: what else the model implies for a run (FLUX: T5 tokens per caption, sampling
    steps, whether its schedule shifts); the family reads them. num_heads is what sequence parallelism splits."""
    name: str
    family: str
    constructor: Callable[..., nn.Module]
    arch: Mapping[str, Any] = field(default_factory=dict)
    constants: Mapping[str, Any] = field(default_factory=dict)

    def build(self, **kwargs) -> nn.Module:
        """kwargs may also override an architecture value (e.g. depth=3 for a quick test)."""
        return self.constructor(**{**self.arch, **kwargs})

    @property
    def num_heads(self) -> int:
        return self.arch["num_heads"]

    @property
    def sp_kinds(self) -> tuple[str, ...]:
        """The sequence-parallel methods the model implements (its class's `parallel_plan`; none without one)."""
        plan = getattr(self.constructor, "parallel_plan", None)
        return () if plan is None else plan.kinds


def match_registry(models: Mapping[str, ModelSpec], **arch) -> str | None:
    """The registered name whose architecture has these values (e.g. depth, hidden_size, patch_size), or None:
    how a checkpoint without a config is named from its tensor shapes."""
    found = [name for name, spec in models.items() if all(spec.arch.get(k) == v for k, v in arch.items())]
    return found[0] if found else None


@dataclass(frozen=True)
class MemoryProbe:
    """What the memory planner (opendit.plan) needs of a run before anything is loaded: the per-sample model input
    (what latent_shape gives with the run's VAE) and {encoder: bytes} of the frozen encoders training holds on the
    device (none when it trains from a latent cache)."""
    latent_shape: tuple[int, ...]
    encoders: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class DiffusionModel(Protocol):
    """What shared code needs from a model: declarations, no switches to write.

    _block_lists: names of the nn.ModuleList attributes holding repeated blocks, in forward order (FLUX:
      ("double_blocks", "single_blocks")); the booster checkpoints, compiles and shards them one by one.
    parallel_plan: an opendit.parallel.ParallelPlan, or None for a model whose sequence cannot be split: the
      methods its forward implements, the attention layers that get the hook, what is split and what stays
      whole. opendit.parallel.enable_sequence_parallel applies it; the forward reads `self.sequence_parallel`
      (None, or the hook) to split and gather around its blocks, and every rank returns the whole output.
    partly_used (optional, True): a step trains only part of the model (Wan2.2's two experts in one run); DDP then
      expects parameters without gradients.
    Kernel switches are declared by the layers (`kernel_switches`, see opendit.kernels.set_kernels); a model
    built from opendit's layers has them.

    The forward is the family's business: each family documents what its objective and sampler call (DiT:
    forward(x, t, y) and forward_with_cfg; FLUX: the official forward(img, img_ids, txt, txt_ids, timesteps, y,
    guidance)).
    """
    _block_lists: tuple[str, ...]
    parallel_plan: Any


def check_model_contract(model: nn.Module, name: str) -> None:
    """A clear error when a family's model misses part of the DiffusionModel contract."""
    missing = [m for m in ("_block_lists", "parallel_plan") if not hasattr(model, m)]
    lists = getattr(model, "_block_lists", ())
    bad = [n for n in lists if not isinstance(getattr(model, n, None), nn.ModuleList)]
    if missing or bad or not lists:
        raise TypeError(f"model {name!r} ({type(model).__name__}) does not meet opendit.families.DiffusionModel: "
                        f"missing {missing}, block lists that are not nn.ModuleList {bad}; see "
                        f"docs/architecture.md 'Adding a model family'")


class WeightAdapter:
    """How a family's weights are laid out elsewhere. Our keys are the official release's, so official <-> opendit
    is the identity; a diffusers transformer folder converts both ways. A family sets one (ModelFamily.weights):
    load_weights, checkpoint recognition and LoRA's module map (opendit.lora.formats, which reads to_diffusers'
    key names) use it, and every file goes through opendit.checkpoint.folders.

    diffusers_classes: the config.json `_class_name`s of its diffusers transformers. A subclass converts state
    dicts (to_diffusers, from_diffusers; `arch`: our constructor kwargs, for conversions that need them) and
    configs (arch_from_diffusers, and where an export needs it arch_to_diffusers); load_official reads a release
    layout opendit's own loader does not (a sharded folder)."""
    diffusers_classes: tuple[str, ...] = ()
    # LoRA files in the diffusers layout name the diffusers modules (to_diffusers' key names give the map);
    # False: they name the official modules (no trainer publishes LoRAs in this diffusers model's names)
    diffusers_lora: bool = True

    def lora_converter(self):
        """What opendit.lora.formats maps module names with: to_diffusers, or None (official names)."""
        return self.to_diffusers if self.diffusers_lora else None

    def to_diffusers(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def from_diffusers(self, state: dict[str, torch.Tensor], arch: dict | None = None) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def arch_from_diffusers(self, config: dict) -> dict:
        raise NotImplementedError

    def check_class(self, config: dict, where: str) -> None:
        found = config.get("_class_name")
        if found not in self.diffusers_classes:
            raise ValueError(f"{where} describes a {found!r}, not a {' or '.join(self.diffusers_classes)}; point "
                             f"at the transformer's folder (or the pipeline folder holding transformer/)")

    def diffusers_folder(self, path) -> str | None:
        """The model folder of a diffusers folder of this family's transformer (`path`, or a pipeline's
        transformer/); None for anything else, another model's diffusers folder included."""
        folder = None if path is None or not Path(path).is_dir() else model_folder(path)
        return folder if folder and read_config(folder).get("_class_name") in self.diffusers_classes else None

    def load_diffusers(self, path) -> tuple[dict, dict[str, torch.Tensor]]:
        """A diffusers folder of this family's transformer -> (our constructor kwargs, our state dict)."""
        folder = model_folder(path)
        if folder is None:
            raise FileNotFoundError(f"{str(path)!r} is not a diffusers transformer folder: expected config.json + "
                                    f"diffusion_pytorch_model*.safetensors, or a pipeline folder with transformer/")
        config = read_config(folder)
        self.check_class(config, f"{folder}/config.json")
        arch = self.arch_from_diffusers(config)
        state = self.from_diffusers(read_safetensors(folder), arch)
        return self.arch_from_weights(arch, state, config, folder), state

    def arch_from_weights(self, arch: dict, state: dict[str, torch.Tensor], config: dict, folder: str) -> dict:
        """The constructor kwargs completed (and checked) from the converted weights, for what a diffusers config
        does not say; default: arch as it is."""
        return arch

    def load_official(self, path) -> dict[str, torch.Tensor] | None:
        """An official release at `path` in a layout opendit's load_weights does not read; None: not one."""
        return None


class Objective(Protocol):
    """What one training micro-batch costs. prepare: a loader batch -> (model input x [B, ...], cond: dict of
    model keyword tensors, each [B, ...]; train=False: no condition dropout). losses: per-sample losses [B] in
    fp32 and each sample's noise level in [0, 1] [B], with noise level and noise drawn from the global RNG, or
    given (the validation loss's fixed ones). Optional begin_step(step): the Trainer calls it before each
    training step's micro-batches (Wan's two experts draw a micro-batch's expert from the step)."""

    def prepare(self, batch, device: torch.device, train: bool = True) -> tuple[torch.Tensor, dict]: ...

    def losses(self, model: nn.Module, x: torch.Tensor, cond: dict, t_frac: torch.Tensor | None = None,
               noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class LoadedModel:
    """A model ready to sample: what opendit.inference.load_model returns and the family's sampler takes."""
    family: "ModelFamily"
    model: nn.Module
    encoders: Any
    cfg: Any  # the run's training config
    latent_shape: tuple[int, ...]  # per-sample model input to sample, e.g. (C, h, w) (see ModelFamily.sample_shape)
    weights: str  # where the weights came from
    vae_decode: DecodeOptions = DecodeOptions()  # how the VAE decodes samples (sample.py's --vae_tiling ...)
    companions: dict = field(default_factory=dict)  # role -> a model ModelFamily.companion_checkpoints
    # named, on the CPU until the family's sampler moves it to the device (Wan2.2 A14B: "low_noise", its expert)


def preview_prompts(dataset, rows: int, model: str) -> list[str]:
    """Up to `rows` prompts for the preview grid of a model trained on captions: the dataset's own (its
    preview_prompts(k), e.g. the captioned digits' "a handwritten zero" ...), else its first distinct captions;
    a ValueError when it has none."""
    own = getattr(dataset, "preview_prompts", None)
    prompts = list(own(rows)) if callable(own) else [c for _, c in distinct_captions(dataset, rows)]
    if not prompts:
        raise ValueError(f"--sample_every: {model} samples from prompts, but the training data has no captions to "
                         f"take them from")
    return prompts


@dataclass(frozen=True)
class NegativePromptOption:
    """sample.py's --negative_prompt, for a text-conditioned family with true classifier-free guidance (its
    sample options list this among their bases)."""
    negative_prompt: str = opt("", "with --cfg_scale > 1 (true classifier-free guidance): the unconditional caption")


def prompt_conditions(sample_cfg, model: str) -> list[str]:
    """The prompts of --prompts and --prompts_file (one per non-blank line) of a model trained on captions;
    --class_labels or no prompt at all is a ValueError."""
    if sample_cfg.class_labels:
        raise ValueError(f"--class_labels: {model} is conditioned on captions; pass --prompts")
    prompts = list(sample_cfg.prompts)
    if sample_cfg.prompts_file:
        lines = Path(sample_cfg.prompts_file).read_text(encoding="utf-8").splitlines()
        prompts += [line.strip() for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"{model} samples from captions: pass --prompts \"...\" or --prompts_file")
    return prompts


class ModelFamily:
    """The family interface. Subclasses set the class attributes and implement the methods; opendit.families.
    latent (data through a frozen VAE), .gaussian (Gaussian diffusion) and the built-in families implement it.

    `cfg` below is always the run's training config: the live one while training, the one a checkpoint was trained
    with (flags applied on top) while sampling. It is frozen and of the family's own class (opendit.config.
    family_class: the shared options and this family's `train_options` only, and an instance of that class, so a
    family's hooks annotate `cfg: FluxTrainOptions`); another family's option is not there. `sample_cfg` (a
    SampleConfig) and preprocess.py's config are made the same way, from `sample_options` and `cache_options`;
    `encoders` is whatever `load_encoders` returns.
    """
    name: str = ""
    models: Mapping[str, ModelSpec] = {}
    # README's table of models (opendit.models_doc): the family's name there, how its model is built, the weights
    # it loads beside opendit's own checkpoints
    title: str = ""
    built_from: str = "opendit's own layers"
    weight_formats: str = ""
    datasets: Mapping[str, DatasetSpec] = {}  # --dataset values it trains on (opendit.data.dataset_map)
    samplers: tuple[str, ...] = ()  # --sampler values; the first is the default
    default_cfg_scale: float = 4.0  # sample.py's --cfg_scale when not given
    # Its defaults of shared flags in words, {option field: text}, e.g. {"cfg_scale": "Wan2.1 5, Wan-debug 3"}:
    # the --help of those flags lists every family's (opendit.config); the values themselves come from the hooks
    defaults_help: Mapping[str, str] = {}
    # sample.py's --cache_threshold when not given, per step cache (opendit.models.step_cache); a family sets the
    # values benchmarks/sample_accel.py measured for it (speed against quality); these are a starting point
    cache_thresholds: Mapping[str, float] = {"teacache": 0.1, "fbcache": 0.08}
    cache_keys: tuple[str, ...] = ()  # settings a latent cache records beyond image size and VAE (and imposes)
    checkpoint_formats: tuple[str, ...] = ()  # foreign checkpoints recognize_checkpoint knows, for error messages
    weights: WeightAdapter | None = None  # its weights in diffusers' layout and official release layouts
    # --lora_targets' default: a regex fully matching the names of the Linear layers that get adapters
    lora_targets: str = ""
    # Option dataclasses (opendit.options.opt fields; frozen=True, as a run's config subclasses them) merged into
    # train.py's, sample.py's and preprocess.py's flags by opendit.config; a field of the same name in two
    # families must have the same type and default.
    train_options: type | None = None
    sample_options: type | None = None
    cache_options: type | None = None

    # ---- configuration and data ---------------------------------------------------------------------------
    def resolve_config(self, cfg):
        """Settings that come from elsewhere (a latent cache's manifest, the family's defaults) -> cfg. Runs
        before any process group or data exists; a flag that disagrees with the data is an error."""
        return cfg

    def load_encoders(self, cfg, device: torch.device, training: bool):
        """Frozen encoders (VAE, text encoders) for this run; training from a cache may skip some."""
        raise NotImplementedError

    def load_data(self, cfg, encoders):
        """-> (dataset, cfg with data-derived settings filled in, e.g. the class count)."""
        raise NotImplementedError

    # ---- model ---------------------------------------------------------------------------------------------
    def latent_shape(self, cfg, encoders, dataset=None, data_channels: int | None = None) -> tuple[int, ...]:
        """Per-sample model input shape, e.g. (C, H, W) or (C, T, H, W); from the dataset when it is cached."""
        raise NotImplementedError

    def build_model(self, cfg, latent_shape: tuple[int, ...]) -> nn.Module:
        raise NotImplementedError

    def train_flops_per_sample(self, model: nn.Module) -> float:
        """Model FLOPs of one training sample (3 passes x 2 FLOP per MAC), for the TFLOP/s and MFU in the log;
        0: not counted (the log leaves them out)."""
        return 0.0

    def objective(self, cfg, encoders) -> Objective:
        raise NotImplementedError

    def load_weights(self, path: str) -> dict[str, torch.Tensor]:
        """{official key: tensor} from `path` (--init_weights, a sampled checkpoint): an official release or a
        diffusers folder its weight adapter reads (converted), else opendit's own formats."""
        if self.weights is not None:
            official = self.weights.load_official(path)
            if official is not None:
                return official
            folder = model_folder(path) if Path(path).is_dir() else None
            if folder is not None and "_class_name" in read_config(folder):  # a diffusers folder: ours, or an error
                return self.weights.load_diffusers(path)[1]
            if folder is None and Path(path, "model_index.json").is_file():
                raise FileNotFoundError(f"{path!r} is a diffusers pipeline folder without transformer/config.json; "
                                        f"download its transformer/ folder too")
        return load_weights(path)

    def kohya_lora_names(self, keys) -> dict[str, tuple[str, ...]] | None:
        """The modules LoRA files in the kohya/ComfyUI layout name, where they are not the model's own: {name: the
        model's Linears whose output rows it stacks, in order} for the model of state-dict `keys`. None: files name
        the model's own Linears."""
        return None

    # ---- memory planning (opendit.plan) -----------------------------------------------------------------------
    def memory_probe(self, cfg, device: torch.device) -> MemoryProbe:
        """The run's latent shape and frozen encoders' bytes, from cfg alone (no encoder, folder or data read)."""
        raise NotImplementedError(f"model family {self.name!r} has no memory_probe: opendit.plan cannot size its runs")

    def memory_model(self, cfg, latent_shape: tuple[int, ...]) -> nn.Module:
        """The model build_model makes, built without reading encoder folders (the planner calls it on meta)."""
        return self.build_model(cfg, latent_shape)

    def memory_inputs(self, cfg, model: nn.Module, latent_shape: tuple[int, ...], batch: int,
                      device: torch.device) -> dict:
        """Keyword arguments of model(**kw) for `batch` random samples, shaped and typed as training feeds it."""
        raise NotImplementedError(f"model family {self.name!r} has no memory_inputs: opendit.plan cannot measure "
                                  f"its activations")

    # ---- sampling ------------------------------------------------------------------------------------------
    def recognize_checkpoint(self, path: str) -> tuple[dict, dict | None] | None:
        """A checkpoint that carries no opendit config (an official release, a diffusers folder) -> (training
        settings it implies, its state_dict when reading the settings already loaded it); None if not ours."""
        return None

    def sampling_config(self, cfg, given: set[str]):
        """The training config a checkpoint implies (its settings with sample.py's flags on top; `given`: the
        keys that were actually known) -> that config checked (what cannot be told is an error naming the flag
        to pass) and with the family's defaults filled in."""
        return cfg

    def default_sampling_steps(self, cfg) -> int:
        """sample.py's --num_sampling_steps when not given."""
        return 250

    def sample_defaults(self, sample_cfg, cfg) -> dict:
        """The family's values for the sample.py settings left out (None): sampler, steps, guidance scale, the
        step cache's threshold. opendit.inference.complete_sample_config applies them, once, for sample.py and
        previews alike."""
        return {"sampler": self.samplers[0], "num_sampling_steps": self.default_sampling_steps(cfg),
                "cfg_scale": self.default_cfg_scale, "cache_threshold": self.cache_thresholds.get(sample_cfg.cache)}

    def conditions(self, sample_cfg, cfg) -> list:
        """What sample i is conditioned on is conditions[i % len(conditions)] (class labels, prompts, None)."""
        raise NotImplementedError

    def make_sampler(self, sample_cfg, cfg):
        """The sampler of a completed sample config (defaults applied); sample_batch uses it."""
        raise NotImplementedError

    def sample_shape(self, loaded: LoadedModel, sample_cfg) -> tuple[int, ...]:
        """The per-sample latent shape to sample (load_model puts it in loaded.latent_shape): the one the model
        was loaded at, or the size sample_cfg asks for (--height / --width, video --num_frames); a ValueError
        naming the flag for a size the model cannot take."""
        return loaded.latent_shape

    def sampling_parts(self, model: nn.Module) -> tuple[nn.Module, dict[str, nn.Module]]:
        """A loaded checkpoint's model -> (the model sampling starts with, {role: companion}) (Wan2.2: both experts
        of one checkpoint -> the high-noise one and its "low_noise" companion). Default: the model alone."""
        return model, {}

    def companion_checkpoints(self, cfg, sample_cfg, weights: str) -> dict[str, str]:
        """Other models sampling needs beside --ckpt's, role -> checkpoint (Wan2.2 A14B: its low-noise expert):
        loaded as --ckpt is, into LoadedModel.companions. Default: none."""
        return {}

    def sample_batch(self, loaded: LoadedModel, sampler, indices: range, conditions: list, sample_cfg,
                     device: torch.device) -> np.ndarray:
        """Samples for global indices -> uint8 [n, ..., C] (images [n, H, W, C]). Noise must depend only on
        (sample_cfg.seed, indices), so N processes produce what one process would (opendit.seeding.
        sampling_generator)."""
        raise NotImplementedError

    def writer(self, out_dir, sample_cfg, cfg):
        """-> an object with write(index, sample) (each process, its own samples) and finish(num, conditions)
        (rank 0, after all have written); default: images (clips: opendit.families.clips.ClipFamily's)."""
        return ImageWriter(Path(out_dir), npz=sample_cfg.npz)

    # ---- previews while training (opendit.training.preview) -------------------------------------------------
    def preview_settings(self, cfg) -> dict:
        """sample.py settings of a quick, deterministic preview (the sampler and its steps)."""
        return {"num_sampling_steps": min(self.default_sampling_steps(cfg), 20)}

    def preview_conditions(self, cfg, dataset, rows: int) -> list:
        """Up to `rows` conditions, one row of the preview grid each: class labels, prompts, or [None]."""
        return [None]

    def preview_encoders(self, cfg, encoders, conditions: list, dataset):
        """Encoders that can sample exactly `conditions` later on rank 0 alone. Called on every rank (a sharded
        text encoder encodes collectively): text families encode their prompts here (encoders.text.
        FixedEmbeddings); others return `encoders`."""
        return encoders

    def sampling_encoders(self, cfg, encoders, device: torch.device):
        """The training encoders completed for sampling (e.g. the VAE, which training on a cache skips)."""
        return encoders

    # ---- caching (preprocess.py) ---------------------------------------------------------------------------
    def resolve_cache_config(self, cfg):
        """preprocess.py's config with the family's defaults filled in (what the manifest records)."""
        return cfg

    def cache_encoders(self, cfg, device: torch.device):
        """The encoders preprocess.py runs (cfg: an opendit.config.PreprocessConfig)."""
        raise NotImplementedError(f"model family {self.name!r} has no latent cache")

    def cache_source(self, cfg, encoders):
        """The dataset preprocess.py encodes (cfg: a PreprocessConfig): items (x, label[, caption])."""
        raise NotImplementedError(f"model family {self.name!r} has no latent cache")

    def cache_encode(self, encoders, x: torch.Tensor, captions: list[str] | None = None) -> dict:
        """A batch of source items -> {"mean": [B, ...], "std": [B, ...]} float32 on the CPU, unscaled (and the
        captions' text embeddings, for a family that caches them; captions None: the image parts only)."""
        raise NotImplementedError(f"model family {self.name!r} has no latent cache")

    def cache_extras(self, encoders) -> dict:
        """Tensors stored once per cache (FLUX: the empty caption's embeddings), {} for none."""
        return {}
