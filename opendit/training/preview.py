"""Preview grids while training: every --sample_every steps the EMA (the weights themselves with --ema_decay 0)
samples a fixed grid into <run>/previews/step-NNNNNN.png (one class or prompt per row; video: also an animated
.gif and, with PyAV, an .mp4 of the grid) and into TensorBoard ("preview").

Everything that could make two previews differ except the weights is fixed: the classes (up to 8, the first
ones) or prompts (the demo's built-in digit captions, else the first distinct captions of the training data),
the noise (seeded by --global_seed, the same at every step), the sampler (DDIM with eta 0, or the family's
Euler) with a quick number of steps (--preview_steps), and the guidance (the family's default scale).

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

The constructor encodes the fixed prompts once (text-conditioned families); under the FSDP plugins the T5
encoder is sharded, which makes that a collective: build the Previewer on every rank.
"""
import contextlib
import dataclasses
import logging
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from opendit import config as cfglib
from opendit.families.base import LoadedModel

logger = logging.getLogger("opendit")

MAX_ROWS = 8  # classes or prompts, one per row
PER_ROW = 2  # samples of each
MIN_TILE = 64  # pixels: smaller samples (the 8x8 digits) are upscaled, nearest neighbour, to at least this
MAX_STRIP_FRAMES = 8  # video: frames per sample in the PNG (evenly spaced); the GIF / MP4 show all
CAPTION_SCAN = 2048  # dataset items looked at for distinct captions


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


def quick_steps(family, cfg) -> int:
    """A preview's denoising steps when --preview_steps is not given: 50 DDIM steps for the Gaussian diffusion
    families, else the family's own default capped at 20 (FLUX: 4 for schnell, 20 for the others)."""
    if "ddim" in family.samplers:
        return 50
    return min(family.default_sampling_steps(cfg), 20)


def _caption_of(dataset, i: int) -> str | None:
    """Item i's caption without decoding its image where the dataset keeps captions aside."""
    captions = getattr(dataset, "captions", None)
    if isinstance(captions, (list, tuple)):
        return captions[i]
    if callable(getattr(dataset, "caption", None)):  # moving digits
        return dataset.caption(i)
    samples = getattr(dataset, "samples", None)  # a video CSV: (path, label, caption)
    if isinstance(samples, (list, tuple)) and isinstance(samples[i], tuple) and len(samples[i]) == 3 \
            and isinstance(samples[i][2], str):
        return samples[i][2]
    item = dataset[i]
    return next((x for x in item[1:] if isinstance(x, str)), None) if isinstance(item, (list, tuple)) else None


def first_captions(dataset, k: int) -> list[tuple[int, str]]:
    """The first k distinct non-empty captions of `dataset` as (index, caption); [] when it has none."""
    found: dict[str, int] = {}
    if dataset is None:
        return []
    for i in range(min(len(dataset), CAPTION_SCAN)):
        caption = _caption_of(dataset, i)
        if caption is None:
            return []  # no captions in this dataset
        if caption.strip() and caption not in found:
            found[caption] = i
            if len(found) == k:
                break
    return [(i, c) for c, i in found.items()]


def preview_prompts(dataset, cfg, k: int = MAX_ROWS) -> list[str]:
    """The captioned digits demo: "a handwritten zero" ... (one template, the first k digits); else the
    training data's first k distinct captions."""
    if cfg.dataset == "captioned_digits":
        from opendit.data.captions import digit_caption

        return [digit_caption(d) for d in range(min(k, 10))]
    return [c for _, c in first_captions(dataset, k)]


@torch.no_grad()
def gather_preview_weights(model: nn.Module, ema=None) -> dict[str, torch.Tensor]:
    """The weights a preview samples, as full CPU tensors keyed like the unwrapped model's state dict: the EMA's
    (ShardedEMA.full_state_dict), or with ema None the model's own. A collective: call it on every rank; rank 0
    gets the tensors, the others {} (one process: the tensors)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from opendit.distributed import unwrap_model
    from opendit.ema import clean_fqn

    if ema is not None:
        return ema.full_state_dict(rank0_only=True)
    state = unwrap_model(model).state_dict()
    keep = not dist.is_initialized() or dist.get_rank() == 0
    out = {}
    for name, value in state.items():  # same order on every rank: full_tensor() is a collective
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if keep:  # a copy: the preview model must not share storage with the one being trained
            out[clean_fqn(name)] = value.detach().to("cpu", copy=True)
    return out


def _rgb(x: np.ndarray) -> np.ndarray:
    return np.repeat(x, 3, axis=-1) if x.shape[-1] == 1 else x


def _upscale(x: np.ndarray, s: int) -> np.ndarray:
    """Nearest-neighbour upscaling of [..., H, W, C] by s."""
    return x if s == 1 else x.repeat(s, axis=-3).repeat(s, axis=-2)


def tile(cells: list[np.ndarray], rows: int, cols: int, gap: int = 2) -> np.ndarray:
    """Equal-sized uint8 [h, w, 3] cells in row-major order -> [rows*(h+gap)+gap, cols*(w+gap)+gap, 3] on white."""
    h, w, _ = cells[0].shape
    grid = np.full((rows * (h + gap) + gap, cols * (w + gap) + gap, 3), 255, np.uint8)
    for i, cell in enumerate(cells):
        r, c = divmod(i, cols)
        grid[gap + r * (h + gap): gap + r * (h + gap) + h, gap + c * (w + gap): gap + c * (w + gap) + w] = cell
    return grid


class _FixedText:
    """Text embeddings of the fixed prompts, computed once: stands in for a text encoder while sampling.
    table: caption -> tuple of CPU tensors (video: (CLIP pooled [D],); FLUX: (T5 [L, D], CLIP [D]))."""

    def __init__(self, table: dict[str, tuple[torch.Tensor, ...]], vae=None):
        self.table, self.vae = table, vae

    def _stack(self, captions: list[str]) -> tuple[torch.Tensor, ...]:
        missing = [c for c in captions if c not in self.table]
        if missing:
            raise KeyError(f"preview captions {missing[:3]} were not encoded when the Previewer was built")
        return tuple(torch.stack(parts) for parts in zip(*(self.table[c] for c in captions)))

    def __call__(self, captions: list[str]) -> torch.Tensor:  # VideoEncoders.text
        return self._stack(captions)[0]

    def encode(self, captions: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:  # FluxEncoders.encode
        t5, clip = self._stack(captions)
        return t5.float().to(device), clip.float().to(device)


class Previewer:
    """Samples the fixed preview grid of a run. Build it once, on every rank (it may encode prompts: see the
    module docstring); call it on rank 0 with the full weights (gather_preview_weights) at the steps where
    `due(step)`.

    family, cfg, encoders, device: the trainer's (cfg with the data's settings filled in, e.g. the class count;
    encoders as the family loaded them for training). dataset: the training data (the latent shape of a cache,
    the captions of text-conditioned data). rows / per_row: conditions shown and samples of each."""

    def __init__(self, family, cfg, encoders, device, run_dir, dataset=None, rows: int = MAX_ROWS,
                 per_row: int = PER_ROW):
        self.family, self.cfg, self.encoders = family, cfg, encoders
        self.device = torch.device(device)
        self.out = Path(run_dir) / "previews"
        self.every = int(getattr(cfg, "sample_every", 0) or 0)
        with kept_rng(self.device):
            self.latent_shape = tuple(family.latent_shape(cfg, encoders, dataset))
            self.conditions = self._conditions(rows, dataset)
            self._text = self._encode_prompts(dataset) if isinstance(self.conditions[0], str) else None
        if self.conditions == [None]:  # unconditional: a square grid of samples
            side = max(1, math.isqrt(rows * per_row))
            self.rows, self.cols = side, side
        else:
            self.rows, self.cols = len(self.conditions), per_row
        steps = cfg.preview_steps or quick_steps(family, cfg)
        sampler = "ddim" if "ddim" in family.samplers else None
        self.sample_cfg = family.sample_defaults(
            cfglib.SampleConfig(sampler=sampler, num_sampling_steps=steps, ddim_eta=0.0, seed=cfg.global_seed,
                                batch_size=self.rows * self.cols), cfg)
        self._vae = None  # loaded at the first preview when training does not hold one (a latent cache)

    # ---- set-up ----------------------------------------------------------------------------------------------
    def _conditions(self, rows: int, dataset) -> list:
        """The first `rows` classes, else the prompts (text-conditioned families), else [None] (unconditional);
        the family decides which applies (its conditions() refuses the others)."""
        base = cfglib.SampleConfig()
        if self.cfg.num_classes:
            labels = list(range(min(rows, self.cfg.num_classes)))
            with contextlib.suppress(ValueError):
                return self.family.conditions(dataclasses.replace(base, class_labels=labels), self.cfg)
        prompts = preview_prompts(dataset, self.cfg, rows)
        if prompts:
            with contextlib.suppress(ValueError):
                return self.family.conditions(dataclasses.replace(base, prompts=prompts), self.cfg)[:rows]
        try:
            return self.family.conditions(base, self.cfg)
        except ValueError as e:
            raise ValueError(f"--sample_every: no preview prompts for {self.cfg.model} ({e}); the training data "
                             f"has no captions to take them from") from None

    def _encode_prompts(self, dataset) -> _FixedText:
        """Each prompt's (and the empty caption's) text embeddings, on the CPU, computed now (on every rank:
        a sharded T5 encodes collectively) so that sampling on rank 0 alone needs no encoder."""
        enc, captions = self.encoders, list(self.conditions)
        negative = self.family.sample_defaults(cfglib.SampleConfig(), self.cfg).negative_prompt
        wanted = list(dict.fromkeys(captions + ["", negative]))
        if hasattr(enc, "t5"):  # FLUX: T5 tokens and the pooled CLIP vector
            if enc.t5 is not None and enc.clip is not None:
                t5, clip = enc.encode(wanted, "cpu")
                return _FixedText({c: (t5[i], clip[i]) for i, c in enumerate(wanted)})
            return _FixedText(self._cached_embeddings(dataset, captions))  # a cache: its stored embeddings
        text = getattr(enc, "text", None)
        if text is None:
            raise ValueError(f"--sample_every: {self.cfg.model} samples from prompts but has no text encoder")
        embedded = text(wanted).float().cpu()
        return _FixedText({c: (embedded[i],) for i, c in enumerate(wanted)})

    def _cached_embeddings(self, dataset, captions: list[str]) -> dict:
        """A FLUX latent cache: the embeddings stored with each prompt's first item, and the empty caption's."""
        index = dict((c, i) for i, c in first_captions(dataset, len(captions) * 4))
        table = {}
        for caption in captions:
            item = dataset[index[caption]]  # ((mean, std), label, caption, t5, clip)
            table[caption] = (item[3].float(), item[4].float())
        empty = self.encoders.empty if self.encoders.empty is not None else dataset.empty_embeddings()
        table[""] = tuple(e.float().cpu() for e in empty)
        return table

    def _sampling_encoders(self):
        """The encoders the family's sampler sees: the training ones with a VAE to decode (loaded once if
        training has none) and the fixed prompts' embeddings in place of the text encoders."""
        enc = self.encoders
        vae = getattr(enc, "vae", None)
        if vae is None and str(getattr(self.cfg, "vae", "none")).lower() != "none":
            if self._vae is None:
                from opendit.encoders.vae import load_vae

                self._vae = load_vae(self.cfg.vae, self.device)
            vae = self._vae
        if hasattr(enc, "t5"):  # FLUX: only encode() and vae are used while sampling
            return _FixedText(self._text.table, vae)
        if dataclasses.is_dataclass(enc):
            changes = {"vae": vae} if hasattr(enc, "vae") else {}
            if hasattr(enc, "text"):
                changes["text"] = self._text
            return dataclasses.replace(enc, **changes)
        return enc

    def _model(self, weights) -> nn.Module:
        """A fresh copy of the family's model holding `weights`, in eval mode on the device."""
        from opendit.booster.precision import cast_forward_io, compute_dtype
        from opendit.checkpoint import load_into_meta_model

        state = self._full_state(weights)
        dtype = compute_dtype(self.cfg.mixed_precision) if self.device.type == "cuda" else torch.float32
        dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32  # fp16 runs preview in fp32
        with torch.device("meta"):  # no random init of what the weights replace
            model = self.family.build_model(self.cfg, self.latent_shape)
        if any(n not in model.state_dict() for n, _ in model.named_buffers()):
            # buffers computed at build time (non-persistent): build for real, then load
            model = self.family.build_model(self.cfg, self.latent_shape)
            model.load_state_dict(state, strict=True)
        else:
            load_into_meta_model(model, state, "preview weights")
        model.requires_grad_(False).eval()
        if dtype != torch.float32:
            model.to(dtype)
            cast_forward_io(model, dtype)
        return model.to(self.device)

    @staticmethod
    def _full_state(weights) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        if isinstance(weights, nn.Module):
            from opendit.distributed import unwrap_model
            from opendit.ema import clean_fqn

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
            model = self._model(weights)
            try:
                loaded = LoadedModel(self.family, model, self._sampling_encoders(), self.cfg, self.latent_shape,
                                     "preview")
                sampler = self.family.make_sampler(self.sample_cfg, self.cfg)
                return self.family.sample_batch(loaded, sampler, range(self.num_samples), self.conditions,
                                                self.sample_cfg, self.device)
            finally:
                del model
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    def _cells(self, samples: np.ndarray) -> list[np.ndarray]:
        """Samples in the grid's row-major order."""
        return [samples[c * self.rows + r] for r in range(self.rows) for c in range(self.cols)]

    def grid(self, samples: np.ndarray) -> np.ndarray:
        """uint8 [H', W', 3]: rows = conditions, columns = samples; a clip is a strip of (up to 8, evenly
        spaced) frames. Small samples are upscaled to MIN_TILE pixels."""
        h = samples.shape[-3]
        scale = max(1, math.ceil(MIN_TILE / h))
        cells = []
        for s in self._cells(samples):
            s = _upscale(_rgb(s), scale)
            if s.ndim == 4:  # a clip [T, H, W, 3] -> a strip [H, k*(W+2)-2, 3]
                picks = np.unique(np.linspace(0, len(s) - 1, min(len(s), MAX_STRIP_FRAMES)).round().astype(int))
                s = tile([s[t] for t in picks], 1, len(picks), gap=2)[2:-2, 2:-2]
            cells.append(s)
        return tile(cells, self.rows, self.cols)

    def animated_grid(self, samples: np.ndarray) -> np.ndarray:
        """Clips -> uint8 [T, H', W', 3]: the grid of every clip's frame t, rows = conditions."""
        scale = max(1, math.ceil(MIN_TILE / samples.shape[-3]))
        cells = [_upscale(_rgb(c), scale) for c in self._cells(samples)]
        return np.stack([tile([c[t] for c in cells], self.rows, self.cols) for t in range(samples.shape[1])])

    def write(self, step: int, samples: np.ndarray, tb=None) -> Path:
        """previews/step-NNNNNN.png (and for clips .gif, .mp4 with PyAV) and TensorBoard's "preview" image."""
        from PIL import Image

        self.out.mkdir(parents=True, exist_ok=True)
        png = self.out / f"step-{step:06d}.png"
        grid = self.grid(samples)
        Image.fromarray(grid).save(png)
        if samples.ndim == 5:
            import importlib.util

            from opendit.data.video_io import write_gif, write_mp4

            frames, fps = self.animated_grid(samples), self.sample_cfg.fps
            write_gif(png.with_suffix(".gif"), frames, fps=fps)
            if importlib.util.find_spec("av") is not None:
                write_mp4(png.with_suffix(".mp4"), frames, fps=fps)
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
