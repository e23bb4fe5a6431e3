"""Video diffusion transformers as a model family: VDiT (OpenDiT's: full attention over all T·H·W tokens) and
Latte (spatial and temporal attention alternating; the official class-conditional checkpoints load) on clips
[B, C, T, H, W]. Data: the moving-digits demo, a CSV of videos, or cached latents. Conditioning: class labels,
or captions through a frozen CLIP text encoder (--clip) whose pooled embedding joins the timestep embedding.
The 2-D VAE encodes and decodes frame by frame. Sampling writes one MP4 per sample, a PNG strip per sample,
grid.png / grid.gif, and with --npz a uint8 [N, T, H, W, 3] array.
"""
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from opendit.data import build_dataset
from opendit.encoders.text import load_text_encoder, text_encoder_dim
from opendit.encoders.vae import decode_frames, load_vae, posterior_frames
from opendit.checkpoint import load_weights
from opendit.families.base import ModelSpec, match_registry
from opendit.families.image import ImageDiffusionFamily, latent_geometry
from opendit.families.writers import VideoWriter
from opendit.models.latte import Latte
from opendit.models.vdit import VDiT
from opendit.training.objective import DiffusionObjective

# (depth, hidden, heads), as DiT's; Latte's depth counts spatial and temporal blocks together
_SIZES = {"Ti": (12, 192, 3), "S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}


def _spec(name, ctor, depth, hidden, heads, patch):
    return ModelSpec(name, "video", ctor, dict(depth=depth, hidden_size=hidden, num_heads=heads, patch_size=patch))


VIDEO_MODELS = {
    **{f"VDiT-{s}/{p}": _spec(f"VDiT-{s}/{p}", VDiT, d, h, n, tuple(int(v) for v in p.split("x")))
       for s, (d, h, n) in _SIZES.items() for p in ("1x2x2", "2x2x2")},
    **{f"Latte-{s}/{p}": _spec(f"Latte-{s}/{p}", Latte, d, h, n, p)
       for s, (d, h, n) in _SIZES.items() for p in (2, 4, 8)},
    "VDiT-debug": _spec("VDiT-debug", VDiT, 2, 64, 4, (1, 2, 2)),
    "Latte-debug": _spec("Latte-debug", Latte, 2, 64, 4, 2),
}


@dataclass
class VideoEncoders:
    vae: torch.nn.Module | None  # None: pixel space, or training on cached latents
    text: object | None  # opendit.encoders.CLIPTextEncoder; None: class labels condition


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
        x = mean if std is None else (mean + std * torch.randn(mean.shape, device=device, dtype=mean.dtype)) * \
            self.vae_scale
        if self.text is None:
            return x, {"y": y.to(device, non_blocking=True)}
        drop = (torch.rand(len(captions)) < (self.drop_prob if train else 0.0)).tolist()  # same on SP ranks
        return x, {"text": self.text([("" if d else c) for c, d in zip(captions, drop)]).to(device)}


class VideoDiffusionFamily(ImageDiffusionFamily):
    name = "video"
    models = VIDEO_MODELS
    datasets = ("moving_digits", "video_csv", "latents")
    cache_keys = ("num_frames", "frame_interval")
    default_num_frames, default_frame_interval = 16, 1

    def patch_size(self, cfg) -> int:
        patch = self.models[cfg.model].arch["patch_size"]
        return patch[-1] if isinstance(patch, tuple) else patch

    def temporal_patch(self, cfg) -> int:
        patch = self.models[cfg.model].arch["patch_size"]
        return patch[0] if isinstance(patch, tuple) else 1

    # ---- configuration and data ---------------------------------------------------------------------------
    def _defaults(self, cfg):
        cfg = dataclasses.replace(super()._defaults(cfg), num_frames=cfg.num_frames or self.default_num_frames,
                                  frame_interval=cfg.frame_interval or self.default_frame_interval)
        if cfg.num_frames < 1 or cfg.frame_interval < 1:
            raise ValueError(f"--num_frames {cfg.num_frames} and --frame_interval {cfg.frame_interval} must be >= 1")
        return cfg

    def load_encoders(self, cfg, device, training: bool) -> VideoEncoders:
        skip_vae = training and cfg.dataset == "latents"
        return VideoEncoders(vae=None if skip_vae else load_vae(cfg.vae, device),
                             text=load_text_encoder(cfg.clip, device))

    def load_data(self, cfg, encoders: VideoEncoders):
        kwargs = {"seed": cfg.global_seed}
        if cfg.dataset != "latents":
            kwargs.update(num_frames=cfg.num_frames, frame_interval=cfg.frame_interval,
                          channels=3 if encoders.vae is not None else self._pixel_channels(cfg))
        dataset = build_dataset(cfg.dataset, cfg.data_path, cfg.image_size, **kwargs)
        if encoders.text is None and not dataset.num_classes:
            raise ValueError(f"--dataset {cfg.dataset} {cfg.data_path or ''} has captions but no labels; pass "
                             f"--clip <a local CLIP text encoder folder> to condition on them")
        return dataset, self._resolve_classes(cfg, dataset)

    @staticmethod
    def _pixel_channels(cfg) -> int:
        return 1 if cfg.dataset == "moving_digits" else 3

    # ---- model ---------------------------------------------------------------------------------------------
    def latent_shape(self, cfg, encoders, dataset=None, data_channels=None) -> tuple[int, int, int, int]:
        """(C, T, h, w): from a cached dataset, else from the clip length, image size, VAE and channels."""
        cached = getattr(dataset, "latent_shape", None)
        if cached is not None:
            shape = tuple(cached)
        else:
            channels = getattr(dataset, "channels", None) or data_channels or self._pixel_channels(cfg)
            size, in_channels = latent_geometry(cfg.image_size, encoders.vae, channels, self.patch_size(cfg))
            shape = (in_channels, cfg.num_frames, size, size)
        pt, p = self.temporal_patch(cfg), self.patch_size(cfg)
        if shape[1] % pt or shape[2] % p:
            raise ValueError(f"{cfg.model} patches {pt} frame(s) x {p}x{p} latents, which does not divide "
                             f"{shape[1]} frames of {shape[2]}x{shape[3]}; change --num_frames / --image_size")
        return shape

    def build_model(self, cfg, latent_shape):
        channels, frames, size, _ = latent_shape
        text_dim = text_encoder_dim(cfg.clip)
        return self.models[cfg.model].build(input_size=(frames, size, size), in_channels=channels,
                                            num_classes=0 if text_dim else cfg.num_classes,
                                            learn_sigma=cfg.learn_sigma, class_dropout_prob=cfg.class_dropout_prob,
                                            text_dim=text_dim)

    def train_flops_per_sample(self, model) -> float:
        from opendit.perf import video_train_flops_per_sample

        return video_train_flops_per_sample(model)

    def objective(self, cfg, encoders: VideoEncoders) -> VideoDiffusionObjective:
        return VideoDiffusionObjective(encoders.vae, cfg.vae_scale, cfg.learn_sigma, encoders.text,
                                       cfg.class_dropout_prob)

    # ---- sampling ------------------------------------------------------------------------------------------
    def recognize_checkpoint(self, path: str):
        """An official class-conditional Latte .pt (e.g. Latte's UCF-101 release): settings from its shapes."""
        if Path(path).suffix != ".pt":
            return None
        state = load_weights(path, mmap=True)  # keys and shapes only: the tensors stay on disk
        if "temp_embed" not in state:
            return None
        hidden, patch = state["pos_embed"].shape[-1], state["x_embedder.proj.weight"].shape[-1]
        depth = sum(1 for k in state if k.endswith(".attn.qkv.weight"))
        name = match_registry(VIDEO_MODELS, depth=depth, hidden_size=hidden, patch_size=patch)
        side = int(state["pos_embed"].shape[1] ** 0.5) * patch
        in_channels = state["x_embedder.proj.weight"].shape[1]
        settings = dict(dataset="video_csv", vae="stabilityai/sd-vae-ft-ema", image_size=side * 8,
                        num_frames=state["temp_embed"].shape[1],
                        # Latte's unconditional releases (FaceForensics, SkyTimelapse, Taichi) have no y_embedder
                        num_classes=state["y_embedder.embedding_table.weight"].shape[0] - 1
                        if "y_embedder.embedding_table.weight" in state else 0,
                        learn_sigma=state["final_layer.linear.weight"].shape[0] == 2 * in_channels * patch * patch)
        return ({**settings, "model": name} if name else settings), None

    def conditions(self, sample_cfg, cfg) -> list:
        if cfg.clip.lower() == "none":
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

    @torch.no_grad()
    def sample_batch(self, loaded, sampler, indices, conditions, sample_cfg, device) -> np.ndarray:
        """Clips for global indices -> uint8 [n, T, H, W, C] (decoded frame by frame by the VAE if any)."""
        z = self.sample_latents(loaded, sampler, indices, conditions, sample_cfg, device)  # [n, C, T, h, w]
        vae = loaded.encoders.vae
        video = decode_frames(vae, z, loaded.cfg.vae_scale) if vae is not None else z.clamp(-1, 1)
        return ((video + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 4, 1).cpu().numpy()

    def writer(self, out_dir, sample_cfg, cfg) -> VideoWriter:
        return VideoWriter(Path(out_dir), npz=sample_cfg.npz, fps=sample_cfg.fps)

    # ---- caching -------------------------------------------------------------------------------------------
    def cache_encoders(self, cfg, device) -> VideoEncoders:
        return VideoEncoders(vae=load_vae(cfg.vae, device), text=None)  # captions are stored as text

    def cache_source(self, cfg, encoders):
        """The clips preprocess.py encodes: one fixed clip per video (epoch 0's start), 3 channels."""
        if cfg.dataset == "latents":
            raise ValueError("--dataset latents is already a cache; encode moving_digits or a video_csv")
        return build_dataset(cfg.dataset, cfg.data_path, cfg.image_size, num_frames=cfg.num_frames,
                             frame_interval=cfg.frame_interval, seed=0, channels=3)

    @torch.no_grad()
    def cache_encode(self, encoders, x, captions=None):  # captions are stored as text
        mean, std = posterior_frames(encoders.vae, x)
        return {"mean": mean.cpu(), "std": std.cpu()}
