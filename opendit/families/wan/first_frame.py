"""Image-to-video for Wan2.2: a clip conditioned on its first frame, the two ways the releases take it.

- i2v (Wan2.2-I2V-A14B): the model's input is the noisy latent plus 4 mask channels (1 on the first latent frame,
  0 after) and the latent of the conditioning video (the first frame followed by black frames, encoded as one
  clip), 2 C + 4 channels in all; every frame is denoised, the first one from that condition.
- ti2v (Wan2.2-TI2V-5B): the first latent frame is the image's clean latent in place of noise, and its tokens get
  t = 0 (per-token timesteps); the other tokens the step's t. The first frame is given, never predicted.

Both are computed here for training (a clip's own first frame) and sampling (sample.py --image), so the two agree.
"""
from pathlib import Path

import numpy as np
import torch

MASK_CHANNELS = 4  # the official mask: the first pixel frame repeated 4 times, grouped by the VAE's 4x in time


def condition_kind(model_type: str) -> str | None:
    """"i2v" or "ti2v" for a model that takes a first frame, None for text-to-video only."""
    return model_type if model_type in ("i2v", "ti2v") else None


def condition_video(first: torch.Tensor, num_frames: int) -> torch.Tensor:
    """First frames [B, 3, H, W] -> the i2v conditioning clip [B, 3, num_frames, H, W]: the frame, then zeros (grey
    in [-1, 1]), which the VAE encodes as one clip (the official image2video.py's input)."""
    video = first.new_zeros(first.shape[0], first.shape[1], num_frames, *first.shape[2:])
    video[:, :, 0] = first
    return video


def i2v_inputs(first_latent: torch.Tensor, conditioned: torch.Tensor) -> torch.Tensor:
    """The i2v model's extra channels y [B, 4 + C, F', h, w]: the mask (1 on latent frame 0) and the conditioning
    clip's latent first_latent [B, C, F', h, w]; samples with conditioned False (the image dropped, as captions are)
    get zeros in both."""
    mask = torch.zeros(first_latent.shape[0], MASK_CHANNELS, *first_latent.shape[2:], device=first_latent.device,
                       dtype=first_latent.dtype)
    mask[:, :, 0] = 1
    keep = conditioned.to(first_latent.device, first_latent.dtype)[:, None, None, None, None]
    return torch.cat([mask, first_latent], 1) * keep


def ti2v_timesteps(t: torch.Tensor, conditioned: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """t [B] and the patch grid (f, h, w) -> per-token t [B, f*h*w]: 0 on the first latent frame's h*w tokens of
    conditioned samples (tokens run frame by frame), t elsewhere. The first latent frame must be one patch frame."""
    f, h, w = grid
    tokens = t[:, None].expand(t.shape[0], f * h * w).clone()
    first = torch.zeros(f * h * w, dtype=torch.bool, device=t.device)
    first[:h * w] = True
    return tokens.masked_fill(first[None] & conditioned.to(t.device)[:, None], 0.0)


def with_first_frame(x: torch.Tensor, first: torch.Tensor, conditioned: torch.Tensor) -> torch.Tensor:
    """x [B, C, F', h, w] with latent frame 0 replaced by first [B, C, 1, h, w] where conditioned [B] is True."""
    keep = conditioned.to(x.device)[:, None, None, None, None]
    return torch.cat([torch.where(keep, first.to(x.dtype), x[:, :, :1]), x[:, :, 1:]], 2)


def load_first_frame(path: Path, height: int, width: int, channels: int = 3) -> torch.Tensor:
    """An image -> [channels, height, width] in [-1, 1]: scaled to cover height x width, then centre-cropped (the
    official pipelines' resize); channels 1 for a grey pixel-space model."""
    from PIL import Image

    with Image.open(path) as img:
        img = img.convert("RGB" if channels == 3 else "L")
        scale = max(width / img.width, height / img.height)
        img = img.resize((max(width, round(img.width * scale)), max(height, round(img.height * scale))),
                         Image.LANCZOS)
        left, top = (img.width - width) // 2, (img.height - height) // 2
        img = img.crop((left, top, left + width, top + height))
    array = np.asarray(img, dtype=np.float32).reshape(height, width, -1)
    return torch.from_numpy(array).permute(2, 0, 1) / 127.5 - 1
