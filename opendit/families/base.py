"""The seam every model family plugs into: registry entries, the model contract, and the family interface.

A family bundles what differs between image DiT, video DiT and FLUX: its model names, what a batch means,
the conditioning encoders, the objective, the sampler, the FLOP count, the latent shape and what sampling
writes. `Trainer`, `opendit.inference`, `sample.py` and `preprocess.py` ask the family; none of them tests
a model's name. docs/architecture.md walks through adding a family.
"""
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn as nn


@dataclass(frozen=True)
class ModelSpec:
    """One registry entry: `name` (e.g. "DiT-XL/2") builds `constructor(**arch, **kwargs)`.

    arch holds the fixed architecture (depth, widths, heads, patch); kwargs the run's settings
    (input size, channels, classes). num_heads is what sequence parallelism splits."""
    name: str
    family: str
    constructor: Callable[..., nn.Module]
    arch: Mapping[str, Any] = field(default_factory=dict)

    def build(self, **kwargs) -> nn.Module:
        """kwargs may also override an architecture value (e.g. depth=3 for a quick test)."""
        return self.constructor(**{**self.arch, **kwargs})

    @property
    def num_heads(self) -> int:
        return self.arch["num_heads"]

    @property
    def sp_kinds(self) -> tuple[str, ...]:
        """The sequence-parallel methods the model implements (its class's `sp_kinds`; default FastSeq and
        Ulysses, which every model built on opendit.models.layers.Attention gets)."""
        from opendit.parallel.plan import HEAD_KINDS

        return getattr(self.constructor, "sp_kinds", HEAD_KINDS)


@runtime_checkable
class DiffusionModel(Protocol):
    """What the booster, the kernels switch, sequence parallelism and the samplers need from a model.

    _block_lists: names of the nn.ModuleList attributes holding repeated blocks, in forward order (FLUX:
      ("double_blocks", "single_blocks")); the booster checkpoints, compiles and shards them one by one.
    set_kernels: switch fused kernels / the attention backend ("sdpa", "flash", "math"); same math.
    enable_sequence_parallel: split each sample's tokens over `group` (None turns it off); returns the
      opendit.parallel.SequenceParallel hook. Every rank of the group gets the same inputs.
    forward(x, t, **cond): x [B, *latent_shape], t [B] -> the objective's prediction, x's spatial shape.
    forward_with_cfg(x, t, cfg_scale, **cond): classifier-free guidance on a batch [cond half; uncond half].
    """
    _block_lists: tuple[str, ...]

    def set_kernels(self, modulate: bool = False, layernorm: bool = False, attn_backend: str = "sdpa") -> None: ...

    def enable_sequence_parallel(self, group, kind: str = "auto", counter=None): ...

    def forward(self, x: torch.Tensor, t: torch.Tensor, **cond) -> torch.Tensor: ...

    def forward_with_cfg(self, x: torch.Tensor, t: torch.Tensor, cfg_scale: float, **cond) -> torch.Tensor: ...


def match_registry(models: Mapping[str, ModelSpec], **arch) -> str | None:
    """The registered name whose architecture has these values (e.g. depth, hidden_size, patch_size), or None:
    how a checkpoint without a config is named from its tensor shapes."""
    found = [name for name, spec in models.items() if all(spec.arch.get(k) == v for k, v in arch.items())]
    return found[0] if found else None


def check_model_contract(model: nn.Module, name: str) -> None:
    """A clear error when a family's model misses part of the DiffusionModel contract."""
    missing = [m for m in ("set_kernels", "enable_sequence_parallel", "forward_with_cfg", "_block_lists")
               if not hasattr(model, m)]
    lists = getattr(model, "_block_lists", ())
    bad = [n for n in lists if not isinstance(getattr(model, n, None), nn.ModuleList)]
    if missing or bad or not lists:
        raise TypeError(f"model {name!r} ({type(model).__name__}) does not meet opendit.families.DiffusionModel: "
                        f"missing {missing}, block lists that are not nn.ModuleList {bad}; see "
                        f"docs/architecture.md 'Adding a model family'")


class Objective(Protocol):
    """What one training micro-batch costs. prepare: a loader batch -> (model input x [B, ...], cond: dict of
    model keyword tensors, each [B, ...]; train=False: no condition dropout); losses: per-sample losses [B] in
    fp32 and each sample's noise level t in [0, 1] [B], with t and noise from the global RNG, or given (the
    validation loss's fixed ones); loss: their mean."""

    def prepare(self, batch, device: torch.device, train: bool = True) -> tuple[torch.Tensor, dict]: ...

    def losses(self, model: nn.Module, x: torch.Tensor, cond: dict, t_frac: torch.Tensor | None = None,
               noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def loss(self, model: nn.Module, x: torch.Tensor, cond: dict) -> torch.Tensor: ...


@dataclass
class LoadedModel:
    """A model ready to sample: what opendit.inference.load_model returns and the family's sampler takes."""
    family: "ModelFamily"
    model: nn.Module
    encoders: Any
    cfg: Any  # the run's TrainConfig
    latent_shape: tuple[int, ...]  # per-sample model input, e.g. (C, h, w)
    weights: str  # where the weights came from


class ModelFamily:
    """The family interface. Subclasses set the class attributes and implement the methods; the image
    family (opendit.families.image) implements everything but the model-specific parts.

    `cfg` below is always an opendit.config.TrainConfig: the live one while training, the one a checkpoint
    was trained with (flags applied on top) while sampling. `encoders` is whatever `load_encoders` returns.
    """
    name: str = ""
    models: Mapping[str, ModelSpec] = {}
    datasets: tuple[str, ...] = ()  # --dataset values it trains on
    samplers: tuple[str, ...] = ()  # --sampler values; the first is the default
    default_cfg_scale: float = 4.0  # sample.py's --cfg_scale when not given
    cache_keys: tuple[str, ...] = ()  # settings a latent cache records beyond image size and VAE (and imposes)

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
        """Model FLOPs of one training sample (3 passes x 2 FLOP per MAC), for the MFU in the log."""
        raise NotImplementedError

    def objective(self, cfg, encoders) -> Objective:
        raise NotImplementedError

    # ---- sampling ------------------------------------------------------------------------------------------
    def recognize_checkpoint(self, path: str) -> tuple[dict, dict | None] | None:
        """A checkpoint that carries no opendit config (an official release, a diffusers folder) -> (training
        settings it implies, its state_dict when reading the settings already loaded it); None if not ours."""
        return None

    def sampling_config(self, settings: dict, flags: dict):
        """Training settings of a checkpoint + the sample.py flags given -> the run's cfg (a TrainConfig)."""
        raise NotImplementedError

    def default_sampling_steps(self, cfg) -> int:
        """sample.py's --num_sampling_steps when not given."""
        return 250

    def sample_defaults(self, sample_cfg, cfg):
        """The sample.py config with the family's defaults where a flag was left out (sampler, steps, cfg)."""
        return replace(
            sample_cfg, sampler=sample_cfg.sampler or self.samplers[0],
            num_sampling_steps=sample_cfg.num_sampling_steps or self.default_sampling_steps(cfg),
            cfg_scale=self.default_cfg_scale if sample_cfg.cfg_scale is None else sample_cfg.cfg_scale)

    def conditions(self, sample_cfg, cfg) -> list:
        """What sample i is conditioned on is conditions[i % len(conditions)] (class labels, prompts, None)."""
        raise NotImplementedError

    def make_sampler(self, sample_cfg, cfg):
        raise NotImplementedError

    def sample_batch(self, loaded: LoadedModel, sampler, indices: range, conditions: list, sample_cfg,
                     device: torch.device) -> np.ndarray:
        """Samples for global indices -> uint8 [n, ..., C] (images [n, H, W, C]). Noise must depend only on
        (sample_cfg.seed, indices), so N processes produce what one process would."""
        raise NotImplementedError

    def writer(self, out_dir, sample_cfg, cfg):
        """-> an object with write(index, sample) (each process, its own samples) and finish(num, conditions)
        (rank 0, after all have written)."""
        raise NotImplementedError

    # ---- caching (preprocess.py) ---------------------------------------------------------------------------
    def resolve_cache_config(self, cfg):
        """preprocess.py's config with the family's defaults filled in (what the manifest records)."""
        return cfg

    def cache_encoders(self, cfg, device: torch.device):
        """The encoders preprocess.py runs (cfg: an opendit.config.PreprocessConfig)."""
        raise NotImplementedError(f"model family {self.name!r} has no latent cache")

    def cache_source(self, cfg, encoders):
        """The dataset preprocess.py encodes (cfg: an opendit.config.PreprocessConfig): items (x, label)."""
        raise NotImplementedError(f"model family {self.name!r} has no latent cache")

    def cache_encode(self, encoders, x: torch.Tensor, captions: list[str] | None = None) -> dict:
        """A batch of source items -> {"mean": [B, ...], "std": [B, ...]} float32 on the CPU, unscaled (and the
        captions' text embeddings, for a family that caches them; captions None: the image parts only)."""
        raise NotImplementedError(f"model family {self.name!r} has no latent cache")

    def cache_extras(self, encoders) -> dict:
        """Tensors stored once per cache (FLUX: the empty caption's embeddings), {} for none."""
        return {}
