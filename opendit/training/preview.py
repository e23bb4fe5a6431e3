"""Preview grids while training: every --sample_every steps the EMA (the weights themselves with --ema_decay 0)
samples a fixed grid into <run>/previews/step-NNNNNN.png (one class or prompt per row; video: also an animated
.gif and, with PyAV, an .mp4 of the grid) and into TensorBoard ("preview").

Everything that could make two previews differ except the weights is fixed: the conditions (the family's
preview_conditions: every class of a data set with up to MAX_ROWS classes, else the first ones; or prompts), the
noise (seeded by --global_seed, the same at every step), the sampler and its steps (the family's preview_settings;
--preview_steps overrides the steps), the guidance (the family's default scale) and the step cache
(--preview_cache, at the family's default threshold).

Sampling never disturbs training: it runs on a separate copy of the model (built from the config, filled from
the full weights, freed afterwards) in eval mode under no_grad, and the global RNGs (torch CPU and CUDA, numpy,
random) are left exactly as they were, so a run with previews draws the same noise, makes the same steps and
resumes exactly like a run without.

The trainer, as wired:

    previewer = Previewer(family, cfg, encoders, device, run_dir, dataset=dataset)  # every rank (see below)
    ...
    if previewer.due(step):                                  # every rank
        weights = gather_preview_weights(model, ema)         # a collective; full tensors on rank 0, {} elsewhere
        if rank == 0:
            previewer(step, weights, tb=run_logger.tb)
        del weights
        dist.barrier()

The constructor asks the family for encoders that can sample the fixed conditions later (a text family encodes
its prompts then; under the FSDP plugins the T5 encoder is sharded, which makes that a collective): build the
Previewer on every rank.
"""
import contextlib
import logging
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.distributed.tensor import DTensor

from opendit import config as cfglib
from opendit.booster.precision import cast_forward_io, compute_dtype
from opendit.checkpoint import load_into_meta_model
from opendit.distributed import unwrap_model
from opendit.ema import clean_fqn
from opendit.families.base import LoadedModel
from opendit.images import rgb, strip, tile, upscale
from opendit.inference import attach_step_cache, check_step_cache, complete_sample_config
from opendit.lora import add_lora

logger = logging.getLogger("opendit")

MAX_ROWS = 16  # conditions shown, one row each: every class of the digits, the first 16 of ImageNet's
PER_ROW = 2  # samples of each
MIN_TILE = 64  # pixels: smaller samples (the 8x8 digits) are upscaled, nearest neighbour, to at least this
MAX_STRIP_FRAMES = 8  # video: frames per sample in the PNG (evenly spaced); the GIF / MP4 show all


@contextlib.contextmanager
def kept_rng(device: torch.device | None = None):
    """Leave torch's (CPU and `device`'s CUDA), numpy's and Python's global RNG states as they were."""
    py, npy = random.getstate(), np.random.get_state()
    devices = [device] if device is not None and torch.device(device).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


@torch.no_grad()
def gather_preview_weights(model: nn.Module, ema=None) -> dict[str, torch.Tensor]:
    """The weights a preview samples, as full CPU tensors keyed like the unwrapped model's state dict: the EMA's
    (ShardedEMA.full_state_dict), or with ema None the model's own. A collective: call it on every rank; rank 0
    gets the tensors, the others {} (one process: the tensors)."""
    if ema is not None and not ema.trainable_only:
        return ema.full_state_dict(rank0_only=True)
    state = unwrap_model(model).state_dict()
    keep = not dist.is_initialized() or dist.get_rank() == 0
    out = {}
    for name, value in state.items():  # same order on every rank: full_tensor() is a collective
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if keep:  # a copy: the preview model must not share storage with the one being trained
            out[clean_fqn(name)] = value.detach().to("cpu", copy=True)
    if ema is not None:  # it averages the trained part only (LoRA's adapters): the frozen rest is the model's
        out.update(ema.full_state_dict(rank0_only=True))
    return out


class Previewer:
    """Samples the fixed preview grid of a run. Build it once, on every rank (see the module docstring); call it
    on rank 0 with the full weights (gather_preview_weights) at the steps where `due(step)`.

    family, cfg, encoders, device: the trainer's (cfg with the data's settings filled in, e.g. the class count;
    encoders as the family loaded them for training). dataset: the training data (the latent shape of a cache,
    the captions of text-conditioned data). rows / per_row: conditions shown at most and samples of each."""

    def __init__(self, family, cfg, encoders, device, run_dir, dataset=None, rows: int = MAX_ROWS,
                 per_row: int = PER_ROW):
        self.family, self.cfg = family, cfg
        self.device = torch.device(device)
        self.out = Path(run_dir) / "previews"
        self.every = int(getattr(cfg, "sample_every", 0) or 0)
        with kept_rng(self.device):
            self.latent_shape = tuple(family.latent_shape(cfg, encoders, dataset))
            self.conditions = family.preview_conditions(cfg, dataset, rows)[:rows]
            self.encoders = family.preview_encoders(cfg, encoders, self.conditions, dataset)
        if self.conditions == [None]:  # unconditional: a square grid of samples
            side = max(1, math.isqrt(rows * per_row))
            self.rows, self.cols = side, side
        else:
            self.rows, self.cols = len(self.conditions), per_row
        settings = family.preview_settings(cfg)
        if cfg.preview_steps:
            settings["num_sampling_steps"] = cfg.preview_steps
        self.sample_cfg = complete_sample_config(family, cfglib.family_class(family, "SampleConfig")(
            **settings, seed=cfg.global_seed, batch_size=self.rows * self.cols, cache=cfg.preview_cache), cfg)
        check_step_cache(self.sample_cfg, family.models[cfg.model].constructor)  # now, not at the first preview
        self._sampling_encoders = None  # completed for sampling (e.g. a VAE) at the first preview, on rank 0

    # ---- set-up ----------------------------------------------------------------------------------------------
    def _model(self, weights) -> nn.Module:
        """A fresh copy of the family's model holding `weights`, in eval mode on the device."""
        state = self._full_state(weights)
        dtype = compute_dtype(self.cfg.mixed_precision) if self.device.type == "cuda" else torch.float32
        dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32  # fp16 runs preview in fp32
        with torch.device("meta"):  # no random init of what the weights replace
            model = self._build()
        if any(n not in model.state_dict() for n, _ in model.named_buffers()):
            # buffers computed at build time (non-persistent): build for real, then load
            model = self._build()
            model.load_state_dict(state, strict=True)
        else:
            load_into_meta_model(model, state, "preview weights")
        model.requires_grad_(False).eval()
        if dtype != torch.float32:
            model.to(dtype)
            cast_forward_io(model, dtype)
        return model.to(self.device)

    def _build(self) -> nn.Module:
        """The family's model; in a LoRA run with the run's adapters, unmerged, as it trains them."""
        model = self.family.build_model(self.cfg, self.latent_shape)
        if self.cfg.lora_rank:
            add_lora(model, self.cfg.lora_rank, self.cfg.lora_alpha, self.cfg.lora_targets or self.family.lora_targets)
        return model

    @staticmethod
    def _full_state(weights) -> dict[str, torch.Tensor]:
        if isinstance(weights, nn.Module):
            weights = {clean_fqn(k): v.detach() for k, v in unwrap_model(weights).state_dict().items()}
        if not weights:
            raise ValueError("no preview weights: gather them on every rank with gather_preview_weights(model, "
                             "ema) and call the Previewer on rank 0, which holds them")
        bad = [k for k, v in weights.items() if isinstance(v, DTensor)]
        if bad:
            raise TypeError(f"preview weights must be full tensors; {bad[:3]} are sharded DTensors (gather them "
                            f"with gather_preview_weights(model, ema) on every rank)")
        return dict(weights)

    # ---- sampling --------------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    @property
    def num_samples(self) -> int:
        return self.rows * self.cols

    @torch.no_grad()
    def render(self, weights) -> np.ndarray:
        """The preview's samples, uint8 [rows*cols, H, W, C] (video [n, T, H, W, C]), sample i at row i % rows,
        column i // rows (row r: conditions[r]). The global RNGs are left as they were."""
        with kept_rng(self.device):
            if self._sampling_encoders is None:
                self._sampling_encoders = self.family.sampling_encoders(self.cfg, self.encoders, self.device)
            model, companions = self.family.sampling_parts(self._model(weights))
            attach_step_cache(model, self.sample_cfg, companions)  # a fresh model: the cache starts empty
            try:
                loaded = LoadedModel(self.family, model, self._sampling_encoders, self.cfg, self.latent_shape,
                                     "preview", companions=companions)
                sampler = self.family.make_sampler(self.sample_cfg, self.cfg)
                return self.family.sample_batch(loaded, sampler, range(self.num_samples), self.conditions,
                                                self.sample_cfg, self.device)
            finally:
                del model, companions
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    def _cells(self, samples: np.ndarray) -> list[np.ndarray]:
        """Samples in the grid's row-major order."""
        return [samples[c * self.rows + r] for r in range(self.rows) for c in range(self.cols)]

    def grid(self, samples: np.ndarray) -> np.ndarray:
        """uint8 [H', W', 3]: rows = conditions, columns = samples; a clip is a strip of (up to 8, evenly
        spaced) frames. Small samples are upscaled to MIN_TILE pixels."""
        scale = max(1, math.ceil(MIN_TILE / samples.shape[-3]))
        cells = []
        for s in self._cells(samples):
            s = upscale(rgb(s), scale)
            if s.ndim == 4:  # a clip [T, H, W, 3] -> a strip [H, k*(W+2)-2, 3]
                picks = np.unique(np.linspace(0, len(s) - 1, min(len(s), MAX_STRIP_FRAMES)).round().astype(int))
                s = strip([s[t] for t in picks])
            cells.append(s)
        return tile(cells, self.cols)

    def animated_grid(self, samples: np.ndarray) -> np.ndarray:
        """Clips -> uint8 [T, H', W', 3]: the grid of every clip's frame t, rows = conditions."""
        scale = max(1, math.ceil(MIN_TILE / samples.shape[-3]))
        cells = [upscale(rgb(c), scale) for c in self._cells(samples)]
        return np.stack([tile([c[t] for c in cells], self.cols) for t in range(samples.shape[1])])

    def write(self, step: int, samples: np.ndarray, tb=None) -> Path:
        """previews/step-NNNNNN.png (and for clips .gif, .mp4 with PyAV) and TensorBoard's "preview" image."""
        self.out.mkdir(parents=True, exist_ok=True)
        png = self.out / f"step-{step:06d}.png"
        grid = self.grid(samples)
        Image.fromarray(grid).save(png)
        if samples.ndim == 5:  # clips: the family's writer animates the grid at its frame rate
            self.family.writer(self.out, self.sample_cfg, self.cfg).write_animation(png, self.animated_grid(samples))
        if tb is not None:
            tb.add_image("preview", grid, step, dataformats="HWC")
            tb.flush()
        return png

    def __call__(self, step: int, weights, tb=None) -> Path | None:
        """Sample and write the preview of `step` from `weights` (full tensors, gather_preview_weights; or an
        unsharded model); rank 0 only. A failure is logged, not raised: training goes on. Returns the PNG."""
        start = time.perf_counter()
        try:
            path = self.write(step, self.render(weights), tb)
        except Exception:  # a preview is never worth a run (the other ranks wait at the trainer's barrier)
            logger.exception("step %d: the preview failed; training continues", step)
            return None
        logger.info("step %d: preview %s (%d x %d, %s %d steps, %.1fs)", step, path, self.rows, self.cols,
                    self.sample_cfg.sampler, self.sample_cfg.num_sampling_steps, time.perf_counter() - start)
        return path

