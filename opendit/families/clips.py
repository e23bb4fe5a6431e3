"""What every video family shares, whatever its model and objective (the video DiTs, Wan): the clip options
(--num_frames, --frame_interval, --fps), their defaults, the frame counts of video buckets, and the writer of
sampled clips. A video family lists `ClipFamily` before its base family and the clip option dataclasses among
its options' bases."""
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from opendit.data import MOVING_DIGITS
from opendit.families.writers import VideoWriter
from opendit.options import opt


@dataclass(frozen=True)
class ClipTrainOptions:
    num_frames: int | None = opt(None, "frames per clip; default: a latent cache's, else 16", check="positive")
    frame_interval: int | None = opt(None, "take every k-th frame of the source video; default: a cache's, else 1",
                                     check="positive")


@dataclass(frozen=True)
class ClipSampleOptions:
    fps: int | None = opt(None, "frames per second of the MP4s and the GIF; default: the family's", check="positive")
    num_frames: int | None = opt(None, "frames per clip to sample (a multiple of the model's temporal patch; 1 + 4k "
                                       "with a VAE that keeps the first frame alone); default: the trained "
                                       "--num_frames", check="positive")


@dataclass(frozen=True)
class ClipCacheOptions:
    num_frames: int = opt(16, "frames per clip", check="positive")
    frame_interval: int = opt(1, "take every k-th frame of the source video", check="positive")


class ClipFamily:
    """The clip parts of a video family (a mixin before a LatentImageFamily): --num_frames and --frame_interval
    filled in, the bucket frame counts checked as --num_frames is, the clips written as MP4s, strips and GIFs.
    The family's sample_defaults gives "fps"."""
    default_num_frames, default_frame_interval = 16, 1
    cache_keys = ("num_frames", "frame_interval")

    def fill_defaults(self, cfg):
        return dataclasses.replace(super().fill_defaults(cfg), num_frames=cfg.num_frames or self.default_num_frames,
                                   frame_interval=cfg.frame_interval or self.default_frame_interval)

    def bucket_frames(self, cfg, encoders) -> tuple[int, ...]:
        frames = tuple(cfg.bucket_frames) or (cfg.num_frames,)
        for count in frames:  # the same errors as a --num_frames the model cannot take
            self.latent_shape(dataclasses.replace(cfg, num_frames=count), encoders)
        return frames

    def source_options(self, cfg, spec, channels: int, seed: int) -> dict:
        """The clip dataset's options: the moving digits at half the frame, clear of the walls (every frame moves as
        its caption says), with a border where the walls are."""
        options = dict(num_frames=cfg.num_frames, frame_interval=cfg.frame_interval, seed=seed, channels=channels)
        if spec is MOVING_DIGITS:
            options.update(digit_size=cfg.image_size // 2, bounce=False, border=True)
        return options

    def writer(self, out_dir, sample_cfg: ClipSampleOptions, cfg: ClipTrainOptions) -> VideoWriter:
        return VideoWriter(Path(out_dir), npz=sample_cfg.npz, fps=sample_cfg.fps,
                           frames=sample_cfg.num_frames or cfg.num_frames)
