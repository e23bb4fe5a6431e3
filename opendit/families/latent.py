"""What every family that trains on images through a frozen VAE (or in pixel space) shares, whatever its
objective: the latent geometry (image size, VAE downsampling, patch size), settings taken from a latent cache,
data built from the family's dataset specs, decoding samples to uint8 images, and the image half of
preprocess.py's cache (the VAE posterior's mean and std). The objective, the sampler and the conditioning are
the subclass's: Gaussian diffusion (opendit.families.gaussian) or FLUX's rectified flow (opendit.families.flux).
"""
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from opendit.data import CAPTIONED_DIGITS, DIGITS, read_manifest
from opendit.data.digits import parse_digits
from opendit.encoders.vae import SD_VAE_SCALE, decode, load_vae, vae_geometry
from opendit.families.base import ModelFamily
from opendit.families.writers import ImageWriter
from opendit.images import to_uint8


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
        # folders: "none" means "the cache's"; the same folder may be spelt anew
        path = key in ("vae", "t5", "clip", "umt5")
        if given is None or given == cached or (path and given.lower() == "none"):
            updates[key] = cached
        elif not (path and os.path.realpath(given) == os.path.realpath(cached)):
            raise ValueError(f"--{key} {given} disagrees with the latent cache {cfg.data_path!r}, built with "
                             f"{key}={cached}; pass --{key} {cached} or leave it out, or rebuild the cache")
    # keeps cfg.vae = the cache's VAE, so config.yaml tells sample.py which VAE decodes the samples
    return dataclasses.replace(cfg, **updates)


def is_none(path) -> bool:
    return str(path).lower() == "none"


class LatentImageFamily(ModelFamily):
    default_image_size = 16
    default_vae_scale = SD_VAE_SCALE
    vae_shift = 0.0  # latents are (z - shift) * scale (FLUX's autoencoder shifts)
    sampling_needs: tuple[str, ...] = ("image_size",)  # settings a checkpoint must tell (or a flag give)

    def patch_size(self, cfg) -> int:
        return self.models[cfg.model].arch["patch_size"]

    def dataset_spec(self, cfg):
        if cfg.dataset not in self.datasets:
            raise ValueError(f"unknown dataset {cfg.dataset!r} for {cfg.model}; "
                             f"valid names: {', '.join(self.datasets)}")
        return self.datasets[cfg.dataset]

    # ---- configuration and data ---------------------------------------------------------------------------
    def resolve_config(self, cfg):
        if self.dataset_spec(cfg).cache:
            cfg = settings_from_cache(cfg, ("image_size", "vae", "vae_scale") + self.cache_keys)
        return self.fill_defaults(cfg)

    def fill_defaults(self, cfg):
        """The family's defaults where a setting was left out (None)."""
        return dataclasses.replace(cfg, image_size=cfg.image_size or self.default_image_size,
                                   vae_scale=self.default_vae_scale if cfg.vae_scale is None else cfg.vae_scale)

    def load_encoders(self, cfg, device, training: bool) -> ImageEncoders:
        # training on cached latents skips the VAE (cfg.vae still names it, for sampling)
        skip = training and self.dataset_spec(cfg).cache
        return ImageEncoders(vae=None if skip else load_vae(cfg.vae, device))

    def load_data(self, cfg, encoders):
        spec = self.dataset_spec(cfg)
        options = self.dataset_options(cfg, encoders, spec)
        if cfg.digits is not None:
            if spec not in (DIGITS, CAPTIONED_DIGITS):
                raise ValueError(f"--digits {cfg.digits}: only the built-in digits and captioned_digits datasets "
                                 f"have digit classes, not --dataset {spec.name}; leave it out")
            options["digits"] = parse_digits(cfg.digits)
        dataset = spec(cfg.data_path, cfg.image_size, **options)
        return dataset, self.data_settings(cfg, dataset)

    def dataset_options(self, cfg, encoders, spec) -> dict:
        """Keyword arguments of the dataset class of `spec` while training (channels, seed, ...)."""
        return {"seed": cfg.global_seed} if spec.cache else {}

    def data_settings(self, cfg, dataset):
        """cfg with the settings the data decides filled in (e.g. the class count)."""
        return cfg

    def pixel_channels(self, cfg) -> int:
        """Channels of pixel-space data when nothing else says: the dataset's own (1 for the grey digits)."""
        spec = self.datasets.get(cfg.dataset)
        return spec.channels if spec is not None else 3

    def source_channels(self, cfg, encoders) -> int:
        """Channels a dataset should deliver: RGB for a VAE, else the data's own."""
        return 3 if encoders.vae is not None else self.pixel_channels(cfg)

    # ---- model ---------------------------------------------------------------------------------------------
    def latent_shape(self, cfg, encoders, dataset=None, data_channels=None) -> tuple[int, ...]:
        """(C, h, w): from a cached dataset, else from the image size, the VAE and the data's channels
        (dataset's; else data_channels; else the dataset spec's)."""
        patch = self.patch_size(cfg)
        cached = getattr(dataset, "latent_shape", None)
        if cached is not None:
            if cached[-1] % patch:
                raise ValueError(f"cached latents of size {cached[-1]} are not a multiple of {cfg.model}'s patch "
                                 f"size {patch}; pick a model with a smaller patch or cache larger images")
            return tuple(cached)
        channels = getattr(dataset, "channels", None) or data_channels or self.pixel_channels(cfg)
        size, in_channels = latent_geometry(cfg.image_size, encoders.vae, channels, patch)
        return in_channels, size, size

    # ---- sampling ------------------------------------------------------------------------------------------
    def sampling_config(self, cfg, given: set[str]):
        missing = [k for k in self.sampling_needs if getattr(cfg, k) is None]
        if missing:
            raise ValueError(f"cannot tell {missing} from the checkpoint; pass them as flags "
                             f"({' '.join('--' + k for k in missing)})")
        # a trained config is already resolved (a cache's settings included): defaults only, no data read
        return self.fill_defaults(cfg)

    def sampling_encoders(self, cfg, encoders, device):
        if encoders.vae is None and not is_none(cfg.vae):  # trained on a cache: load the VAE to decode
            return dataclasses.replace(encoders, vae=load_vae(cfg.vae, device))
        return encoders

    def sample_latents(self, loaded, sampler, indices: range, conditions: list, sample_cfg, device) -> torch.Tensor:
        """The sampler's output for global indices: float32 [n, *latent_shape] on device."""
        raise NotImplementedError

    def decode(self, loaded, latents: torch.Tensor) -> torch.Tensor:
        """Latents [n, C, h, w] -> images [n, C', H, W] in [-1, 1] (pixel space: clamped)."""
        vae = loaded.encoders.vae
        if vae is None:
            return latents.clamp(-1, 1)
        return decode(vae, latents, scale=loaded.cfg.vae_scale, shift=self.vae_shift)

    @torch.no_grad()
    def sample_batch(self, loaded, sampler, indices, conditions, sample_cfg, device) -> np.ndarray:
        """Samples for global indices -> uint8 with the channels last ([n, H, W, C]), decoded by the VAE if any."""
        return to_uint8(self.decode(loaded, self.sample_latents(loaded, sampler, indices, conditions, sample_cfg,
                                                                device)))

    def writer(self, out_dir, sample_cfg, cfg) -> ImageWriter:
        return ImageWriter(Path(out_dir), npz=sample_cfg.npz)

    # ---- caching -------------------------------------------------------------------------------------------
    def resolve_cache_config(self, cfg):
        if cfg.vae is None or is_none(cfg.vae):
            raise ValueError("--vae is required (a diffusers AutoencoderKL folder or hub id); caching encodes the "
                             "images with a VAE")
        return dataclasses.replace(cfg, vae_scale=self.default_vae_scale if cfg.vae_scale is None else cfg.vae_scale)

    def cache_encoders(self, cfg, device) -> ImageEncoders:
        return ImageEncoders(vae=load_vae(cfg.vae, device))

    def cache_source(self, cfg, encoders):
        """The items preprocess.py encodes: (x [3, ...] in [-1, 1], label[, caption]), no random flips."""
        factor, _ = vae_geometry(encoders.vae)
        if cfg.image_size % factor:
            raise ValueError(f"--image_size {cfg.image_size} must be a multiple of the VAE's downsampling {factor}")
        spec = self.dataset_spec(cfg)
        return spec(cfg.data_path, cfg.image_size, **self.cache_dataset_options(cfg, spec))

    def cache_dataset_options(self, cfg, spec) -> dict:
        """Keyword arguments of the dataset class of `spec` while caching: RGB for the VAE, no random flips."""
        return {}

    @torch.no_grad()
    def cache_encode(self, encoders, x: torch.Tensor, captions=None) -> dict:
        """x [B, 3, H, W] in [-1, 1] -> {"mean", "std"} float32 [B, C, h, w]: the VAE posterior, unscaled."""
        vae = encoders.vae
        param = next(vae.parameters())
        posterior = vae.encode(x.to(device=param.device, dtype=param.dtype)).latent_dist
        return {"mean": posterior.mean.float().cpu(), "std": posterior.std.float().cpu()}
