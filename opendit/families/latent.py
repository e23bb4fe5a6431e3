"""What every family that trains on images through a frozen VAE (or in pixel space) shares, whatever its
objective: the latent geometry (image size, VAE downsampling, patch size), settings taken from a latent cache,
data built from the family's dataset specs, decoding samples to uint8 images, and the image half of
preprocess.py's cache (the VAE posterior's mean and std). The objective, the sampler and the conditioning are
the subclass's: Gaussian diffusion (opendit.families.gaussian) or FLUX's rectified flow (opendit.families.flux.family).
"""
import dataclasses
import os
import types
from dataclasses import dataclass

import numpy as np
import torch

from opendit.data import CAPTIONED_DIGITS, DIGITS, read_manifest
from opendit.data.buckets import Bucketable, parse_buckets
from opendit.data.digits import parse_digits
from opendit.encoders.vae import SD_VAE_SCALE, decode, load_vae, vae_geometry
from opendit.families.base import MemoryProbe, ModelFamily
from opendit.images import to_uint8


@dataclass
class ImageEncoders:
    vae: torch.nn.Module | None  # None: pixel space, or training on cached latents


def check_multiple(flag: str, value: int, step: int, what: str) -> int:
    """value, when it is a positive multiple of step; else a ValueError naming the flag and the valid values
    on either side of it."""
    if value > 0 and value % step == 0:
        return value
    low = value // step * step
    near = f"{low} or {low + step}" if low > 0 else f"{step}"
    raise ValueError(f"{flag} {value} must be a positive multiple of {what} = {step}; use {near}")


def latent_geometry(image_size: int, vae, data_channels: int, patch_size: int) -> tuple[int, int]:
    """(input_size, in_channels) of the model for images of image_size through `vae` (None: pixel space);
    a clear error when the sizes do not fit."""
    factor, latent_channels = vae_geometry(vae)
    need = "patch size" if vae is None else f"{factor} (the VAE's downsampling) x patch size"
    check_multiple("--image_size", image_size, factor * patch_size, need)
    return image_size // factor, (data_channels if vae is None else latent_channels)


def settings_from_cache(cfg, keys=("image_size", "vae", "vae_scale"), folders=("vae",)):
    """--dataset latents: image size, VAE and scale (and the family's cache_keys) come from the cache's manifest
    (the class count from the dataset, later). A flag left out is taken from it; one given that disagrees is
    an error. `folders`: the keys that name folders (encoders), where "none" means the cache's and the same
    folder may be spelt anew."""
    manifest = read_manifest(cfg.data_path)
    updates = {}
    for key in keys:
        given, cached = getattr(cfg, key), manifest.get(key)  # .get: caches from before buckets have none
        path = key in folders
        if given is None or given == cached or (path and given.lower() == "none") or not (given or cached):
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
    encoder_folders: tuple[str, ...] = ("vae",)  # options naming encoder folders (a cache records them)
    # where a checkpoint that names no encoder folders (an official release) keeps them; set: sample.py asks for
    # every one of encoder_folders the checkpoint did not name
    encoder_folders_hint: str = ""
    # the family's usual VAE, for planning memory without loading it: SD's AutoencoderKL (4 latent channels, 8x
    # down; 83,653,863 parameters in diffusers' layout), fp32 as load_vae loads it
    vae_channels, vae_params = 4, 83_653_863
    vae_downsampling = 8  # pixels per latent side of the usual VAE (the memory planner's stand-in)
    vae_temporal = 1  # a video model's usual VAE: frames per latent frame after the first (the planner's stand-in)
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
            cfg = settings_from_cache(cfg, ("image_size", "vae", "vae_scale", "buckets", "bucket_area", "bucket_frames")
                                      + self.cache_keys, self.encoder_folders)
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
        options = {**self.dataset_options(cfg, encoders, spec),
                   **{name: getattr(cfg, name) for name in spec.settings if hasattr(cfg, name)}}
        if cfg.digits is not None:
            if spec not in (DIGITS, CAPTIONED_DIGITS):
                raise ValueError(f"--digits {cfg.digits}: only the built-in digits and captioned_digits datasets "
                                 f"have digit classes, not --dataset {spec.name}; leave it out")
            options["digits"] = parse_digits(cfg.digits)
        dataset = spec(cfg.data_path, cfg.image_size, **options)
        if cfg.buckets and not spec.cache:  # a cache comes with the buckets it was written with
            self.use_buckets(dataset, cfg, encoders)
        return dataset, self.data_settings(cfg, dataset)

    def use_buckets(self, dataset, cfg, encoders) -> None:
        """--buckets: every item assigned to its aspect-ratio bucket (reads each file's header)."""
        if not isinstance(dataset, Bucketable):
            raise ValueError(f"--buckets: --dataset {cfg.dataset} has no per-item sizes to bucket (its items are all "
                             f"one size, or a latent cache keeps the buckets it was written with); leave --buckets out")
        if cfg.model is None:
            raise ValueError("--buckets needs --model: bucket sides are multiples of its patch size")
        step = self.size_step(cfg, encoders)
        check_multiple("--image_size", cfg.image_size, step, "the VAE's downsampling x the patch size")
        area = cfg.bucket_area or cfg.image_size ** 2
        frames = self.bucket_frames(cfg, encoders)
        assignment = dataset.use_buckets(parse_buckets(cfg.buckets, area, step, frames))
        if len(assignment.ids) and (assignment.ids < 0).all():
            raise ValueError(f"--buckets {cfg.buckets}: none of the {len(assignment.ids)} items of {cfg.data_path} "
                             "fits a bucket (unreadable files" + (f", or clips shorter than every --bucket_frames "
                             f"{' '.join(map(str, frames))}; list a frame count the clips have" if frames else "")
                             + ")")

    def size_step(self, cfg, encoders) -> int:
        """Pixels a side of a training size must be a multiple of: the VAE's downsampling x the patch size."""
        return vae_geometry(encoders.vae)[0] * self.patch_size(cfg)

    def bucket_frames(self, cfg, encoders) -> tuple[int, ...]:
        """The frame counts of video buckets (each checked like --num_frames); () for images."""
        return ()

    def dataset_options(self, cfg, encoders, spec) -> dict:
        """Keyword arguments of the dataset class of `spec` while training (channels, seed, ...)."""
        return {"seed": cfg.global_seed} if spec.cache else {}

    def data_settings(self, cfg, dataset):
        """cfg with the settings the data decides filled in (e.g. the class count)."""
        return cfg

    def pixel_channels(self, cfg) -> int:
        """Channels of pixel-space data when nothing else says: the dataset's own (1 for the grey digits)."""
        spec = self.datasets.get(cfg.dataset)
        return spec.data_channels(cfg.data_path, cfg) if spec is not None else 3

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

    # ---- memory planning ------------------------------------------------------------------------------------
    def memory_probe(self, cfg, device) -> MemoryProbe:
        """The latent shape as with the family's usual VAE (only its geometry is read: vae_downsampling,
        vae_temporal, vae_channels), its fp32 bytes and the text encoders' (text_encoder_bytes)."""
        levels = self.vae_downsampling.bit_length()  # 2 ** (levels - 1) down, as a diffusers VAE's block_out_channels
        vae = None if is_none(cfg.vae) else types.SimpleNamespace(
            temporal_compression_ratio=self.vae_temporal,
            config=types.SimpleNamespace(block_out_channels=(0,) * levels, latent_channels=self.vae_channels))
        encoders = {} if vae is None else {"VAE": 4 * self.vae_params}
        encoders.update(self.text_encoder_bytes(cfg, device))
        return MemoryProbe(self.latent_shape(cfg, ImageEncoders(vae)), encoders)

    def text_encoder_bytes(self, cfg, device) -> dict:
        """{name: bytes} of the frozen text encoders this run loads."""
        return {}

    # ---- sampling ------------------------------------------------------------------------------------------
    def sampling_config(self, cfg, given: set[str]):
        unnamed = [k for k in self.encoder_folders if k not in given] if self.encoder_folders_hint else []
        if unnamed:
            raise ValueError(f"the checkpoint does not name its encoders: pass {' '.join('--' + k for k in unnamed)} "
                             f"(local folders; {self.encoder_folders_hint})")
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

    def downsampling(self, loaded) -> int:
        """The VAE's spatial downsampling (1: pixel space): size_step over the patch size."""
        return self.size_step(loaded.cfg, loaded.encoders) // self.patch_size(loaded.cfg)

    def sample_size(self, loaded, sample_cfg) -> tuple[int, int]:
        """(height, width) in pixels to sample: --height / --width, default the trained --image_size; each a
        positive multiple of size_step (whole tokens, as a training bucket's sides), else a ValueError naming the
        flag and valid sizes next to it."""
        factor, step = self.downsampling(loaded), self.size_step(loaded.cfg, loaded.encoders)
        what = "patch size" if factor == 1 else f"{factor} (the VAE's downsampling) x patch size"
        return tuple(check_multiple(f"--{name}", getattr(sample_cfg, name) or loaded.cfg.image_size, step, what)
                     for name in ("height", "width"))

    def sample_shape(self, loaded, sample_cfg) -> tuple[int, ...]:
        """The per-sample latent shape sample.py draws: (C, h, w) of --height x --width pixels (the model takes
        any grid of whole patches; default: the shape it was trained at)."""
        factor = self.downsampling(loaded)
        return (loaded.latent_shape[0], *(side // factor for side in self.sample_size(loaded, sample_cfg)))

    def sample_latents(self, loaded, sampler, indices: range, conditions: list, sample_cfg, device) -> torch.Tensor:
        """The sampler's output for global indices: float32 [n, *latent_shape] on device."""
        raise NotImplementedError

    def decode(self, loaded, latents: torch.Tensor) -> torch.Tensor:
        """Latents [n, C, h, w] -> images [n, C', H, W] in [-1, 1] (pixel space: clamped)."""
        vae = loaded.encoders.vae
        if vae is None:
            return latents.clamp(-1, 1)
        return decode(vae, latents, scale=loaded.cfg.vae_scale, shift=self.vae_shift, options=loaded.vae_decode)

    @torch.no_grad()
    def sample_batch(self, loaded, sampler, indices, conditions, sample_cfg, device) -> np.ndarray:
        """Samples for global indices -> uint8 with the channels last ([n, H, W, C]), decoded by the VAE if any."""
        return to_uint8(self.decode(loaded, self.sample_latents(loaded, sampler, indices, conditions, sample_cfg,
                                                                device)))

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
        dataset = spec(cfg.data_path, cfg.image_size, **self.cache_dataset_options(cfg, spec))
        if cfg.buckets:
            self.use_buckets(dataset, cfg, encoders)
        return dataset

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
