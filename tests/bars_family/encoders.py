"""The family's own frozen encoders; nothing to download, no weights.

PoolVAE: a VAE-like encoder. A clip [B, 1, T, H, W] -> the posterior (mean, std) [B, 1, T, H/2, W/2]: mean the
2x2 average of each frame, std a constant; decode upsamples by repetition. It describes itself: 2x down in space,
1x in time, not causal in time (frames are encoded alone).
LetterEncoder: a text encoder. captions -> [B, width]: a fixed random vector per letter, averaged over a
caption's letters (the empty caption: zeros)."""
import torch
import torch.nn.functional as F


class PoolVAE:
    spatial_downsampling, temporal_downsampling, causal_time = 2, 1, False
    latent_channels = 1
    std = 0.05

    def posterior(self, clips: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, c, t, h, w = clips.shape
        frames = clips.float().transpose(1, 2).reshape(b * t, c, h, w)
        mean = F.avg_pool2d(frames, self.spatial_downsampling).view(b, t, c, h // 2, w // 2).transpose(1, 2)
        return mean.contiguous(), torch.full_like(mean, self.std)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        s = self.spatial_downsampling
        return latents.float().repeat_interleave(s, -2).repeat_interleave(s, -1).clamp(-1, 1)


class LetterEncoder:
    def __init__(self, width: int):
        self.width = width

    def vector(self, letter: str) -> torch.Tensor:
        return torch.randn(self.width, generator=torch.Generator().manual_seed(ord(letter)))

    def __call__(self, captions: list[str]) -> torch.Tensor:
        return torch.stack([torch.stack([self.vector(ch) for ch in c if ch != " "]).mean(0) if c.strip()
                            else torch.zeros(self.width) for c in captions])
