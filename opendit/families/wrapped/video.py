"""The diffusers-transformer kind for video models (HunyuanVideo-1.5): the clips of opendit's video families (the
moving digits demo, a CSV of captioned videos; --num_frames, --frame_interval, --fps, MP4 / GIF / strip output),
latents [C, T', h, w] through the model's video autoencoder (or pixel space), sampled through the model's own
video pipeline; latent caches of fixed clips (preprocess.py --num_frames, --frame_interval) with the prompts'
conditions. Everything else is the image kind's (opendit.families.wrapped.kind)."""
from dataclasses import dataclass

from opendit.data import CLIP_STREAMS, LATENTS, MOVING_DIGITS, VIDEO_CSV, dataset_map
from opendit.families.clips import ClipCacheOptions, ClipFamily, ClipSampleOptions, ClipTrainOptions
from opendit.families.wrapped.kind import (DiffusersFamily, WrappedCacheOptions, WrappedSampleOptions,
                                           WrappedTrainOptions)


@dataclass(frozen=True)
class WrappedVideoTrainOptions(ClipTrainOptions, WrappedTrainOptions):
    pass


@dataclass(frozen=True)
class WrappedVideoSampleOptions(ClipSampleOptions, WrappedSampleOptions):
    pass


@dataclass(frozen=True)
class WrappedVideoCacheOptions(ClipCacheOptions, WrappedCacheOptions):
    pass


class DiffusersVideoFamily(ClipFamily, DiffusersFamily):
    """A family of one video ModelGlue's models."""
    datasets = dataset_map(MOVING_DIGITS, VIDEO_CSV, LATENTS, *CLIP_STREAMS)
    train_options = WrappedVideoTrainOptions
    sample_options = WrappedVideoSampleOptions
    cache_options = WrappedVideoCacheOptions
    cache_keys = (*ClipFamily.cache_keys, *DiffusersFamily.cache_keys)

    def __init__(self, name: str, glue):
        super().__init__(name, glue)
        self.defaults_help = {**self.defaults_help, "fps": f"{name}: {glue.fps}"}

    def dataset_options(self, cfg: WrappedVideoTrainOptions, encoders, spec) -> dict:
        if spec.cache:
            return {"seed": cfg.global_seed}
        return self.source_options(cfg, spec, channels=self.source_channels(cfg, encoders), seed=cfg.global_seed)

    def cache_source(self, cfg: WrappedVideoCacheOptions, encoders):
        """(clip [3, T, H, W] in [-1, 1], label, caption) per item: one fixed clip per video."""
        self.latent_shape(cfg, encoders)  # the frame count and size fit the VAE and the patches, else a clear error
        spec = self.dataset_spec(cfg)
        dataset = spec(cfg.data_path, cfg.image_size, **self.source_options(cfg, spec, channels=3, seed=0))
        if cfg.buckets:
            self.use_buckets(dataset, cfg, encoders)
        return dataset

    def sample_defaults(self, sample_cfg: WrappedVideoSampleOptions, cfg: WrappedVideoTrainOptions) -> dict:
        return {**super().sample_defaults(sample_cfg, cfg), "fps": self.glue.fps}

    def latent_shape(self, cfg: WrappedVideoTrainOptions | WrappedVideoCacheOptions, encoders, dataset=None,
                     data_channels=None) -> tuple[int, ...]:
        vae = encoders.vae if encoders.vae is not None else self._vae(cfg, "cpu")
        return self._clip_latents(cfg, vae, cfg.num_frames, cfg.image_size, cfg.image_size)

    def _clip_latents(self, cfg, vae, frames: int, height: int, width: int) -> tuple[int, ...]:
        """(C, T', h, w) of clips of `frames` frames of height x width pixels."""
        temporal, (spatial, channels) = self.glue.temporal_downsampling(vae), self.glue.vae_geometry(vae)
        if (frames - 1) % temporal:
            near = 1 + temporal * round((frames - 1) / temporal)
            raise ValueError(f"--num_frames {frames}: {cfg.model}'s autoencoder keeps the first frame and packs every "
                             f"{temporal} after it: use 1 + {temporal}k frames (e.g. {near})")
        step = spatial * self.patch_size(cfg)
        for side in (height, width):
            if side % step:
                raise ValueError(f"--image_size {side} must be a multiple of {step} (the VAE's downsampling x "
                                 f"{cfg.model}'s patch)")
        return channels, (frames - 1) // temporal + 1, height // spatial, width // spatial

    def sample_shape(self, loaded, sample_cfg) -> tuple[int, ...]:
        """(C, T', h, w) of --num_frames clips of --height x --width pixels (defaults: the trained ones)."""
        height, width = self.sample_size(loaded, sample_cfg)
        frames = sample_cfg.num_frames or loaded.cfg.num_frames
        return self._clip_latents(loaded.cfg, loaded.encoders.vae, frames, height, width)

    def size_kwargs(self, loaded, shape) -> dict:
        return {"num_frames": (shape[2] - 1) * self.glue.temporal_downsampling(loaded.encoders.vae) + 1}
