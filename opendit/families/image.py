"""What every image diffusion family shares: images (digits, class folders, cached VAE latents) through a
frozen VAE, Gaussian diffusion (IDDPM) training, DDPM / DDIM sampling with classifier-free guidance on class
labels, and PNG / npz outputs. A family built on it (DiT, or a test's toy model) adds its registry, how its
model is built from the latent shape, and its FLOP count.
"""
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from opendit.data import build_dataset, read_manifest
from opendit.diffusion import SAMPLERS, GaussianSampler
from opendit.encoders.vae import SD_VAE_SCALE, decode, load_vae, vae_geometry
from opendit.families.base import ModelFamily
from opendit.families.writers import ImageWriter
from opendit.training.objective import DiffusionObjective


@dataclass
class ImageEncoders:
    vae: torch.nn.Module | None  # None: pixel space, or training on cached latents


def latent_geometry(image_size: int, vae, data_channels: int, patch_size: int) -> tuple[int, int]:
    """(input_size, in_channels) of the model for images of image_size through `vae` (None: pixel space);
    a clear error when the sizes do not fit."""
    factor, latent_channels = vae_geometry(vae)
    if image_size <= 0 or image_size % (factor * patch_size):
        need = "patch size" if vae is None else f"{factor} (the VAE's downsampling) x patch size"
        step = factor * patch_size
        raise ValueError(f"--image_size {image_size} must be a positive multiple of {need} = {step}; "
                         f"e.g. {max(1, image_size // step) * step}")
    return image_size // factor, (data_channels if vae is None else latent_channels)


def settings_from_cache(cfg, keys=("image_size", "vae", "vae_scale")):
    """--dataset latents: image size, VAE and scale (and the family's cache_keys) come from the cache's manifest
    (the class count from the dataset, later). A flag left out is taken from it; one given that disagrees is
    an error."""
    manifest = read_manifest(cfg.data_path)
    updates = {}
    for key in keys:
        given, cached = getattr(cfg, key), manifest[key]
        path = key in ("vae", "t5", "clip")  # folders: "none" means "the cache's"; the same folder may be spelt anew
        if given is None or given == cached or (path and given.lower() == "none"):
            updates[key] = cached
        elif not (path and os.path.realpath(given) == os.path.realpath(cached)):
            raise ValueError(f"--{key} {given} disagrees with the latent cache {cfg.data_path!r}, built with "
                             f"{key}={cached}; pass --{key} {cached} or leave it out, or rebuild the cache")
    # keeps cfg.vae = the cache's VAE, so config.yaml tells sample.py which VAE decodes the samples
    return dataclasses.replace(cfg, **updates)


class ImageDiffusionFamily(ModelFamily):
    datasets = ("digits", "folder", "latents")
    samplers = SAMPLERS
    class_conditional = True  # False: no labels reach the model, no guidance
    default_image_size = 16
    default_vae_scale = SD_VAE_SCALE

    def patch_size(self, cfg) -> int:
        return self.models[cfg.model].arch["patch_size"]

    # ---- configuration and data ---------------------------------------------------------------------------
    def resolve_config(self, cfg):
        if cfg.dataset not in self.datasets:
            raise ValueError(f"unknown dataset {cfg.dataset!r} for {cfg.model}; "
                             f"valid names: {', '.join(self.datasets)}")
        if cfg.dataset == "latents":
            cfg = settings_from_cache(cfg, ("image_size", "vae", "vae_scale") + self.cache_keys)
        return self._defaults(cfg)

    def _defaults(self, cfg):
        return dataclasses.replace(cfg, image_size=cfg.image_size or self.default_image_size,
                                   vae_scale=self.default_vae_scale if cfg.vae_scale is None else cfg.vae_scale)

    def load_encoders(self, cfg, device, training: bool) -> ImageEncoders:
        # training on cached latents skips the VAE (cfg.vae still names it, for sampling)
        skip = training and cfg.dataset == "latents"
        return ImageEncoders(vae=None if skip else load_vae(cfg.vae, device))

    def load_data(self, cfg, encoders: ImageEncoders):
        if cfg.dataset == "latents":
            kwargs = {"seed": cfg.global_seed}
        else:  # the built-in digits are grey; a VAE wants RGB
            kwargs = {"channels": 3} if cfg.dataset == "digits" and encoders.vae is not None else {}
        dataset = build_dataset(cfg.dataset, cfg.data_path, cfg.image_size, **kwargs)
        return dataset, self._resolve_classes(cfg, dataset)

    def _resolve_classes(self, cfg, dataset):
        found = dataset.num_classes
        if cfg.num_classes is None:
            return dataclasses.replace(cfg, num_classes=found)
        if self.class_conditional and cfg.num_classes < found:
            raise ValueError(f"--num_classes {cfg.num_classes} is fewer than the {found} classes of --dataset "
                             f"{cfg.dataset}; leave it out (the data's count is used) or pass at least {found}")
        return cfg

    # ---- model ---------------------------------------------------------------------------------------------
    def latent_shape(self, cfg, encoders, dataset=None, data_channels=None) -> tuple[int, int, int]:
        """(C, h, w): from a cached dataset, else from the image size, the VAE and the data's channels
        (dataset's; else data_channels; else 1 for the grey digits, 3 for other images)."""
        patch = self.patch_size(cfg)
        cached = getattr(dataset, "latent_shape", None)
        if cached is not None:
            if cached[1] % patch:
                raise ValueError(f"cached latents of size {cached[1]} are not a multiple of {cfg.model}'s patch "
                                 f"size {patch}; pick a model with a smaller patch or cache larger images")
            return tuple(cached)
        channels = getattr(dataset, "channels", None) or data_channels or self.pixel_channels(cfg)
        size, in_channels = latent_geometry(cfg.image_size, encoders.vae, channels, patch)
        return in_channels, size, size

    @staticmethod
    def pixel_channels(cfg) -> int:
        """Channels of the pixel-space data when nothing else says: the built-in digits are grey."""
        return 1 if cfg.dataset in ("digits", "captioned_digits") else 3

    def objective(self, cfg, encoders: ImageEncoders) -> DiffusionObjective:
        return DiffusionObjective(encoders.vae, cfg.vae_scale, cfg.learn_sigma, labels=self.class_conditional)

    # ---- sampling ------------------------------------------------------------------------------------------
    def sampling_config(self, settings: dict, flags: dict):
        from opendit.config import TrainConfig

        merged = {**settings, **flags}
        need = ("model", "image_size") + (("num_classes",) if self.class_conditional else ())
        missing = [k for k in need if merged.get(k) is None]
        if missing:
            raise ValueError(f"cannot tell {missing} from the checkpoint; pass them as flags "
                             f"({' '.join('--' + k for k in missing)})")
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        # a trained config is already resolved (a cache's settings included): defaults only, no data read
        return self._defaults(TrainConfig(**{k: v for k, v in merged.items() if k in known}))

    def conditions(self, sample_cfg, cfg) -> list:
        if not self.class_conditional:
            if sample_cfg.class_labels:
                raise ValueError(f"--class_labels: {cfg.model} is unconditional; leave them out")
            return [None]
        labels = sample_cfg.class_labels or list(range(cfg.num_classes))
        bad = [c for c in labels if not 0 <= c < cfg.num_classes]
        if bad:
            raise ValueError(f"--class_labels {bad} out of range 0..{cfg.num_classes - 1}")
        return labels

    def make_sampler(self, sample_cfg, cfg) -> GaussianSampler:
        sample_cfg = self.sample_defaults(sample_cfg, cfg)
        # pixel-space models know their data lies in [-1, 1]: clamping x_0 keeps an early model from diverging
        return GaussianSampler(sample_cfg.sampler, sample_cfg.num_sampling_steps, cfg.learn_sigma,
                               eta=sample_cfg.ddim_eta, clip_denoised=cfg.vae.lower() == "none")

    @torch.no_grad()
    def sample_batch(self, loaded, sampler, indices, conditions, sample_cfg, device) -> np.ndarray:
        """Images for global indices -> uint8 [n, H, W, C] (decoded by the VAE when there is one)."""
        out = self.sample_latents(loaded, sampler, indices, conditions, sample_cfg, device)
        vae = loaded.encoders.vae
        images = decode(vae, out, scale=loaded.cfg.vae_scale) if vae is not None else out.clamp(-1, 1)
        return ((images + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()

    @torch.no_grad()
    def sample_latents(self, loaded, sampler, indices, conditions, sample_cfg, device) -> torch.Tensor:
        """The sampler's output for global indices: float32 [n, *latent_shape] on device. Noise comes from a
        generator seeded by (seed, first index), so a batch is the same on any rank."""
        model, sample_cfg = loaded.model, self.sample_defaults(sample_cfg, loaded.cfg)
        gen = torch.Generator().manual_seed(sample_cfg.seed * 1_000_003 + indices.start)
        n = len(indices)
        z = torch.randn(n, *loaded.latent_shape, generator=gen).to(device)
        kwargs = self.condition_inputs(loaded, [conditions[i % len(conditions)] for i in indices], device)
        net = model  # model(...), not model.forward: input/output hooks (dtype casts) must run
        if kwargs and sample_cfg.cfg_scale > 1.0:  # [cond; uncond] halves, the second with the null condition
            null = self.null_inputs(loaded, n, device)
            z = torch.cat([z, z])
            kwargs = {**{k: torch.cat([v, null[k]]) for k, v in kwargs.items()}, "cfg_scale": sample_cfg.cfg_scale}
            net = model.forward_with_cfg

        def fn(x, t, **kw):  # the sampler's math stays fp32 whatever the model's dtype
            return net(x, t, **kw).float()
        return sampler(fn, z, kwargs, device=device, generator=gen)[:n].float()

    def condition_inputs(self, loaded, picked: list, device) -> dict:
        """The model's keyword inputs for one condition per sample ({} when unconditional)."""
        if not self.class_conditional:
            return {}
        return {"y": torch.tensor(picked, device=device)}

    def null_inputs(self, loaded, n: int, device) -> dict:
        """The unconditional inputs of classifier-free guidance: the null class."""
        return {"y": torch.full((n,), loaded.cfg.num_classes, device=device)}

    def writer(self, out_dir, sample_cfg, cfg) -> "ImageWriter":
        return ImageWriter(Path(out_dir), npz=sample_cfg.npz)

    # ---- caching -------------------------------------------------------------------------------------------
    def cache_encoders(self, cfg, device) -> ImageEncoders:
        return ImageEncoders(vae=load_vae(cfg.vae, device))

    def cache_source(self, cfg, encoders: ImageEncoders):
        """The images preprocess.py encodes: (x [3, H, W] in [-1, 1], label), no random flips."""
        factor, _ = vae_geometry(encoders.vae)
        if cfg.image_size % factor:
            raise ValueError(f"--image_size {cfg.image_size} must be a multiple of the VAE's downsampling {factor}")
        if cfg.dataset == "latents":
            raise ValueError("--dataset latents is already a cache; encode digits or an image folder")
        if cfg.dataset == "digits":  # grey digits become RGB for the VAE, as in training
            return build_dataset("digits", image_size=cfg.image_size, channels=3)
        return build_dataset(cfg.dataset, cfg.data_path, cfg.image_size, random_flip=False)

    @torch.no_grad()
    def cache_encode(self, encoders: ImageEncoders, x: torch.Tensor, captions=None) -> dict:
        """x [B, 3, H, W] in [-1, 1] -> {"mean", "std"} float32 [B, C, h, w]: the VAE posterior, unscaled."""
        vae = encoders.vae
        param = next(vae.parameters())
        posterior = vae.encode(x.to(device=param.device, dtype=param.dtype)).latent_dist
        return {"mean": posterior.mean.float().cpu(), "std": posterior.std.float().cpu()}
