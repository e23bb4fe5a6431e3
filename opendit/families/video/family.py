"""Video diffusion transformers as a model family: VDiT (OpenDiT's: full attention over all T·H·W tokens) and
Latte (spatial and temporal attention alternating; the official class-conditional checkpoints load) on clips
[B, C, T, H, W]. Data: the moving-digits demo, a CSV of videos, or cached latents. Conditioning: class labels,
or captions through a frozen CLIP text encoder (--clip) whose pooled embedding joins the timestep embedding.
The 2-D VAE encodes and decodes frame by frame. Sampling writes one MP4 per sample, a PNG strip per sample,
grid.png / grid.gif, and with --npz a uint8 [N, T, H, W, 3] array.

What the models' forward takes: forward(x [B, C, T, h, w], t [B], y [B] labels) or, trained on captions,
forward(x, t, text=[B, D] pooled CLIP) -> [B, 2C or C, T, h, w]; forward_with_cfg(..., cfg_scale) on [cond; uncond].
"""
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from opendit.checkpoint import load_weights
from opendit.data import CLIP_STREAMS, LATENTS, MOVING_DIGITS, VIDEO_CSV, dataset_map
from opendit.diffusion import SAMPLERS
from opendit.diffusion.flow import RectifiedFlow, cfg_velocity, euler_sample
from opendit.diffusion.objective import DiffusionObjective
from opendit.encoders.text import CLIP_SOURCE, FixedEmbeddings, encoder_dtype, load_text_encoder, text_encoder_dim
from opendit.encoders.vae import decode_frames, load_vae, posterior_frames, posterior_sample
from opendit.families.base import ModelSpec, match_registry, preview_prompts
from opendit.families.clips import ClipCacheOptions, ClipFamily, ClipSampleOptions, ClipTrainOptions
from opendit.families.gaussian import (GaussianDiffusionFamily, GaussianSampleOptions, GaussianTrainOptions,
                                       official_shapes)
from opendit.families.latent import check_multiple, is_none, latent_geometry
from opendit.families.video.latte import Latte
from opendit.families.video.vdit import VDiT
from opendit.models.blocks import DIT_SIZES, is_per_sample_layer
from opendit.models.layers import Attention
from opendit.options import opt
from opendit.perf import matmul_macs
from opendit.seeding import sampling_generator


def _spec(name, ctor, depth, hidden, heads, patch):
    return ModelSpec(name, "video", ctor, dict(depth=depth, hidden_size=hidden, num_heads=heads, patch_size=patch))


VIDEO_MODELS = {
    **{f"VDiT-{s}/{p}": _spec(f"VDiT-{s}/{p}", VDiT, d, h, n, tuple(int(v) for v in p.split("x")))
       for s, (d, h, n) in DIT_SIZES.items() for p in ("1x2x2", "2x2x2")},
    **{f"Latte-{s}/{p}": _spec(f"Latte-{s}/{p}", Latte, d, h, n, p)
       for s, (d, h, n) in DIT_SIZES.items() for p in (2, 4, 8)},
    "VDiT-debug": _spec("VDiT-debug", VDiT, 2, 64, 4, (1, 2, 2)),
    "Latte-debug": _spec("Latte-debug", Latte, 2, 64, 4, 2),
}

OBJECTIVES = ("diffusion", "flow")
CLIP_HELP = ("a local CLIP text encoder folder (transformers save_pretrained layout, or a pipeline folder with "
             "text_encoder/)")


@dataclass(frozen=True)
class VideoTrainOptions(ClipTrainOptions, GaussianTrainOptions):
    clip: str = opt("none", CLIP_HELP + "; captions then condition instead of class labels")
    objective: str = opt("diffusion", "diffusion: IDDPM (DDPM / DDIM sampling); flow: flow matching (the model "
                                      "predicts the velocity at logit-normal t, Euler sampling; implies "
                                      "--learn_sigma false)", OBJECTIVES)


@dataclass(frozen=True)
class VideoSampleOptions(ClipSampleOptions, GaussianSampleOptions):
    clip: str | None = opt(None, "CLIP text encoder folder; default: the checkpoint's", from_checkpoint=True)


@dataclass
class VideoEncoders:
    vae: torch.nn.Module | None  # None: pixel space, or training on cached latents
    text: object | None  # a CLIPTextEncoder (or FixedEmbeddings); None: class labels condition


class VideoDiffusionObjective(DiffusionObjective):
    """Gaussian diffusion on clips. A batch is (video [B, C, T, H, W] in [-1, 1], labels [B], captions) or a
    cached one ((mean, std) [B, C, T, h, w], labels[, captions]); the VAE posterior is taken per frame and
    sampled as mean + std * randn over the whole clip, so training on a cache equals training on the fly.
    With a text encoder the captions condition, each replaced by "" with probability drop_prob (for
    classifier-free guidance); else the labels (the model drops those itself)."""

    def __init__(self, vae, vae_scale, learn_sigma, text=None, drop_prob: float = 0.1):
        super().__init__(vae, vae_scale, learn_sigma, labels=text is None)
        self.text, self.drop_prob = text, drop_prob

    def prepare(self, batch, device, train: bool = True):
        x, y, captions = batch[0], batch[1], (batch[2] if len(batch) > 2 else None)
        if isinstance(x, (list, tuple)):
            mean, std = (t.to(device, non_blocking=True) for t in x)
        elif self.vae is not None:
            mean, std = posterior_frames(self.vae, x.to(device, non_blocking=True))
        else:
            mean, std = x.to(device, non_blocking=True), None
        x = mean if std is None else posterior_sample(mean, std) * self.vae_scale
        if self.text is None:
            return x, {"y": y.to(device, non_blocking=True)}
        drop = (torch.rand(len(captions)) < (self.drop_prob if train else 0.0)).tolist()  # same on SP ranks
        return x, {"text": self.text([("" if d else c) for c, d in zip(captions, drop)]).to(device)}


class VideoFlowObjective(VideoDiffusionObjective):
    """Flow matching on clips (--objective flow), batches and conditioning as VideoDiffusionObjective's:
    x_t = (1 - t) x0 + t eps with t ~ sigmoid(N(0, 1)); the model, fed 1000 t as its timestep, predicts the
    velocity eps - x0; MSE in fp32."""

    def __init__(self, vae, vae_scale, text=None, drop_prob: float = 0.1):
        super().__init__(vae, vae_scale, learn_sigma=False, text=text, drop_prob=drop_prob)
        self.flow = RectifiedFlow(shift=False)

    def losses(self, model, x, cond: dict, t_frac=None, noise=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-sample loss [B] fp32, t [B]); t_frac / noise given: used as they are (validation)."""
        t = self.flow.sample_t(x.shape[0], x.device) if t_frac is None else t_frac.to(x.device, torch.float32)
        return self.flow.losses(lambda x_t, t: model(x_t, t * 1000, **cond), x, t, noise), t


@dataclass
class FlowSampler:
    steps: int
    progress: bool = False  # a progress bar over the steps (sample.py sets it on rank 0)


def video_forward_macs(model: nn.Module) -> int:
    """Multiply-accumulates of one forward pass for ONE clip of a video model (VDiT, Latte), from its layers.

    N = T'·S tokens per clip. A token-wise Linear(in, out) costs N * in * out, a per-sample one (timestep MLP,
    adaLN modulation, text projection) in * out, the patch conv N * weight.numel(), and each attention layer
    2 * L^2 * D per sequence of length L, as the model lays its sequences out (`attention_sequences()`):
    VDiT one sequence of T'·S tokens; Latte T' sequences of S (spatial blocks) and S sequences of T' (temporal).
    Latte evaluates the adaLN modulation once per frame / per position (its condition rows are repeated);
    model FLOPs count it once per clip, as the convention counts only what the model needs.
    """
    seqs = getattr(model, "attention_sequences", None)
    if seqs is None:
        raise ValueError(f"{type(model).__name__} has no attention_sequences(); video_forward_macs counts VDiT and "
                         f"Latte (opendit.families.video); image DiT: opendit.families.dit.family.dit_forward_macs")
    seqs = seqs()
    tokens = seqs[0][0] * seqs[0][1]
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    if len(attn) != len(seqs) or any(n * L != tokens for n, L in seqs):
        raise ValueError(f"{type(model).__name__}.attention_sequences() {seqs} does not cover its {len(attn)} "
                         f"attention layers with {tokens} tokens each")
    macs = matmul_macs(model, lambda name: 1 if is_per_sample_layer(name) else tokens)
    return macs + sum(n * 2 * L * L * m.num_heads * m.head_dim for m, (n, L) in zip(attn, seqs))


def video_train_flops_per_sample(model: nn.Module) -> float:
    """Training FLOPs per clip (3 passes x 2 FLOP x forward MACs) of a built VDiT or Latte (meta device is fine)."""
    return 3 * 2 * float(video_forward_macs(model))


class VideoDiffusionFamily(ClipFamily, GaussianDiffusionFamily):
    name = "video"
    title, weight_formats = "VDiT, Latte", "Latte `.pt`"
    models = VIDEO_MODELS
    datasets = dataset_map(MOVING_DIGITS, VIDEO_CSV, LATENTS, *CLIP_STREAMS)
    samplers = (*SAMPLERS, "euler")  # euler: models trained with --objective flow
    defaults_help = {"fps": "video DiTs 8", "cfg_scale": "video DiTs 4",
                     "num_sampling_steps": "video DiTs 250, with --objective flow 50",
                     "sampler": "video DiTs: ddpm (default) or ddim; euler with --objective flow",
                     "vae_scale": "video DiTs: SD's 0.18215"}
    checkpoint_formats = ("an official Latte .pt",)
    cache_thresholds = {"teacache": 0.5, "fbcache": 0.05}  # benchmarks/README.md: Latte digits, >= 2x, none lost
    train_options = VideoTrainOptions
    sample_options = VideoSampleOptions
    cache_options = ClipCacheOptions

    def patch_size(self, cfg) -> int:
        patch = self.models[cfg.model].arch["patch_size"]
        return patch[-1] if isinstance(patch, tuple) else patch

    def temporal_patch(self, cfg) -> int:
        patch = self.models[cfg.model].arch["patch_size"]
        return patch[0] if isinstance(patch, tuple) else 1

    # ---- configuration and data ---------------------------------------------------------------------------
    def fill_defaults(self, cfg):
        cfg = super().fill_defaults(cfg)
        return dataclasses.replace(cfg, learn_sigma=False) if cfg.objective == "flow" else cfg

    def load_encoders(self, cfg: VideoTrainOptions | ClipCacheOptions, device, training: bool) -> VideoEncoders:
        skip_vae = training and self.dataset_spec(cfg).cache
        return VideoEncoders(vae=None if skip_vae else load_vae(cfg.vae, device),
                             text=load_text_encoder(cfg.clip, device))

    def dataset_options(self, cfg: VideoTrainOptions, encoders, spec) -> dict:
        if spec.cache:
            return {"seed": cfg.global_seed}
        return dict(num_frames=cfg.num_frames, frame_interval=cfg.frame_interval, seed=cfg.global_seed,
                    channels=self.source_channels(cfg, encoders))

    def load_data(self, cfg: VideoTrainOptions, encoders: VideoEncoders):
        dataset, cfg = super().load_data(cfg, encoders)
        if encoders.text is None and not dataset.num_classes:
            raise ValueError(f"--dataset {cfg.dataset} {cfg.data_path or ''} has captions but no labels; pass "
                             f"--clip <a local CLIP text encoder folder> to condition on them")
        return dataset, cfg

    # ---- model ---------------------------------------------------------------------------------------------
    def latent_shape(self, cfg: VideoTrainOptions | ClipCacheOptions, encoders, dataset=None,
                     data_channels=None) -> tuple[int, int, int, int]:
        """(C, T, h, w): from a cached dataset, else from the clip length, image size, VAE and channels."""
        cached = getattr(dataset, "latent_shape", None)
        if cached is not None:
            shape = tuple(cached)
        else:
            channels = getattr(dataset, "channels", None) or data_channels or self.pixel_channels(cfg)
            size, in_channels = latent_geometry(cfg.image_size, encoders.vae, channels, self.patch_size(cfg))
            shape = (in_channels, cfg.num_frames, size, size)
        pt, p = self.temporal_patch(cfg), self.patch_size(cfg)
        if shape[1] % pt or shape[2] % p:
            raise ValueError(f"{cfg.model} patches {pt} frame(s) x {p}x{p} latents, which does not divide "
                             f"{shape[1]} frames of {shape[2]}x{shape[3]}; change --num_frames / --image_size")
        return shape

    def build_model(self, cfg: VideoTrainOptions, latent_shape):
        channels, frames, size, _ = latent_shape
        text_dim = text_encoder_dim(cfg.clip)
        return self.models[cfg.model].build(input_size=(frames, size, size), in_channels=channels,
                                            num_classes=0 if text_dim else cfg.num_classes,
                                            learn_sigma=cfg.learn_sigma, class_dropout_prob=cfg.class_dropout_prob,
                                            text_dim=text_dim)

    def train_flops_per_sample(self, model) -> float:
        return video_train_flops_per_sample(model)

    def text_encoder_bytes(self, cfg: VideoTrainOptions, device) -> dict:
        size = encoder_dtype(device).itemsize
        return {} if is_none(cfg.clip) else {"CLIP-L text": size * CLIP_SOURCE.params}

    def memory_model(self, cfg: VideoTrainOptions, latent_shape):
        """build_model's model; captions (--clip) as CLIP-L's pooled 768-wide vector, without reading the folder."""
        channels, frames, size, _ = latent_shape
        clip = None if is_none(cfg.clip) else 768
        return self.models[cfg.model].build(input_size=(frames, size, size), in_channels=channels,
                                            num_classes=0 if clip else (cfg.num_classes or 1000),
                                            learn_sigma=cfg.learn_sigma, class_dropout_prob=cfg.class_dropout_prob,
                                            text_dim=clip)

    def objective(self, cfg: VideoTrainOptions, encoders: VideoEncoders) -> VideoDiffusionObjective:
        if cfg.objective == "flow":
            return VideoFlowObjective(encoders.vae, cfg.vae_scale, encoders.text, cfg.class_dropout_prob)
        return VideoDiffusionObjective(encoders.vae, cfg.vae_scale, cfg.learn_sigma, encoders.text,
                                       cfg.class_dropout_prob)

    # ---- sampling ------------------------------------------------------------------------------------------
    def sample_shape(self, loaded, sample_cfg) -> tuple[int, int, int, int]:
        """(C, T, h, w) of --num_frames clips of --height x --width pixels (defaults: the trained ones): the models
        take any grid of whole patches, with the sin-cos positions of that grid."""
        c, h, w = super().sample_shape(loaded, sample_cfg)  # checks --height / --width
        pt = self.temporal_patch(loaded.cfg)
        frames = check_multiple("--num_frames", sample_cfg.num_frames or loaded.cfg.num_frames, pt,
                                f"{loaded.cfg.model}'s temporal patch")
        return c, frames, h, w

    def recognize_checkpoint(self, path: str):
        """An official class-conditional Latte .pt (e.g. Latte's UCF-101 release): settings from its shapes."""
        if Path(path).suffix != ".pt":
            return None
        state = load_weights(path, mmap=True)  # keys and shapes only: the tensors stay on disk
        if "temp_embed" not in state:
            return None
        found = official_shapes(state)  # Latte's unconditional releases (FaceForensics, ...) have 0 classes
        name = match_registry(VIDEO_MODELS, depth=found["depth"], hidden_size=found["hidden_size"],
                              patch_size=found["patch_size"])
        settings = dict(dataset="video_csv", vae="stabilityai/sd-vae-ft-ema", image_size=found["latent_side"] * 8,
                        num_frames=state["temp_embed"].shape[1], num_classes=found["num_classes"],
                        learn_sigma=found["learn_sigma"])
        return ({**settings, "model": name} if name else settings), None

    def conditions(self, sample_cfg: VideoSampleOptions, cfg: VideoTrainOptions) -> list:
        if is_none(cfg.clip):
            if sample_cfg.prompts:
                raise ValueError(f"--prompts: {cfg.model} was trained on class labels; pass --class_labels")
            if not cfg.num_classes:  # an unconditional model (e.g. an official unconditional Latte)
                if sample_cfg.class_labels:
                    raise ValueError(f"--class_labels: {cfg.model} is unconditional; leave them out")
                return [None]
            return super().conditions(sample_cfg, cfg)
        if not sample_cfg.prompts:
            raise ValueError(f"{cfg.model} was trained on captions (--clip {cfg.clip}); pass --prompts \"...\"")
        if sample_cfg.class_labels:
            raise ValueError(f"--class_labels: {cfg.model} was trained on captions; pass --prompts instead")
        return list(sample_cfg.prompts)

    def condition_inputs(self, loaded, picked: list, device) -> dict:
        if picked[0] is None:  # unconditional
            return {}
        if loaded.encoders.text is None:
            return super().condition_inputs(loaded, picked, device)
        return {"text": loaded.encoders.text(picked).to(device)}

    def null_inputs(self, loaded, n: int, device) -> dict:
        if loaded.encoders.text is None:
            return super().null_inputs(loaded, n, device)
        return {"text": loaded.encoders.text([""]).to(device).expand(n, -1)}

    def decode(self, loaded, latents: torch.Tensor) -> torch.Tensor:
        """Latent clips [n, C, T, h, w] -> clips in [-1, 1], decoded frame by frame by the VAE if any."""
        vae = loaded.encoders.vae
        if vae is None:
            return latents.clamp(-1, 1)
        return decode_frames(vae, latents, loaded.cfg.vae_scale, options=loaded.vae_decode)

    def sample_defaults(self, sample_cfg: VideoSampleOptions, cfg: VideoTrainOptions) -> dict:
        flow = {"sampler": "euler", "num_sampling_steps": 50} if cfg.objective == "flow" else {}
        return {**super().sample_defaults(sample_cfg, cfg), "fps": 8, **flow}

    def make_sampler(self, sample_cfg: VideoSampleOptions, cfg: VideoTrainOptions):
        if (sample_cfg.sampler == "euler") != (cfg.objective == "flow"):
            valid = "euler" if cfg.objective == "flow" else " or ".join(SAMPLERS)
            raise ValueError(f"--sampler {sample_cfg.sampler} does not apply to a model trained with --objective "
                             f"{cfg.objective}; use {valid}")
        return FlowSampler(sample_cfg.num_sampling_steps) if cfg.objective == "flow" else \
            super().make_sampler(sample_cfg, cfg)

    @torch.no_grad()
    def sample_latents(self, loaded, sampler, indices, conditions, sample_cfg, device) -> torch.Tensor:
        if not isinstance(sampler, FlowSampler):
            return super().sample_latents(loaded, sampler, indices, conditions, sample_cfg, device)
        model, n, scale = loaded.model, len(indices), sample_cfg.cfg_scale
        z = torch.randn(n, *loaded.latent_shape, generator=sampling_generator(sample_cfg.seed, indices.start))
        kwargs = self.condition_inputs(loaded, [conditions[i % len(conditions)] for i in indices], device)
        guided = bool(kwargs) and scale > 1.0
        if guided:  # [cond; uncond] in one pass, the second half with the null condition
            null = self.null_inputs(loaded, n, device)
            kwargs = {k: torch.cat([v, null[k]]) for k, v in kwargs.items()}

        def velocity(x, t):
            if not guided:
                return model(x, t * 1000, **kwargs).float()
            out = model(torch.cat([x, x]), torch.cat([t, t]) * 1000, **kwargs).float()
            return cfg_velocity(out[:n], out[n:], scale)
        return euler_sample(velocity, z.to(device), torch.linspace(1, 0, sampler.steps + 1), sampler.progress)

    # ---- previews ------------------------------------------------------------------------------------------
    def preview_settings(self, cfg: VideoTrainOptions) -> dict:
        if cfg.objective == "flow":
            return {"sampler": "euler", "num_sampling_steps": 20}
        return super().preview_settings(cfg)

    def preview_conditions(self, cfg: VideoTrainOptions, dataset, rows: int) -> list:
        if is_none(cfg.clip):
            return super().preview_conditions(cfg, dataset, rows)
        return preview_prompts(dataset, rows, cfg.model)

    def preview_encoders(self, cfg: VideoTrainOptions, encoders: VideoEncoders, conditions: list,
                         dataset) -> VideoEncoders:
        if encoders.text is None:
            return encoders
        return dataclasses.replace(encoders, text=FixedEmbeddings.encode(encoders.text, [*conditions, ""]))

    # ---- caching -------------------------------------------------------------------------------------------
    def cache_encoders(self, cfg: ClipCacheOptions, device) -> VideoEncoders:
        return VideoEncoders(vae=load_vae(cfg.vae, device), text=None)  # captions are stored as text

    def cache_dataset_options(self, cfg: ClipCacheOptions, spec) -> dict:
        """One fixed clip per video (epoch 0's start), 3 channels."""
        return dict(num_frames=cfg.num_frames, frame_interval=cfg.frame_interval, seed=0, channels=3)

    @torch.no_grad()
    def cache_encode(self, encoders, x, captions=None):  # captions are stored as text
        mean, std = posterior_frames(encoders.vae, x)
        return {"mean": mean.cpu(), "std": std.cpu()}
