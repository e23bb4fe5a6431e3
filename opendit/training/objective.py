"""The training objective of class-conditional DiT: Gaussian diffusion on (VAE latents of) images.

A new model family overrides the objective (what a batch means and how its loss is computed), not the loop.
"""
import torch

from opendit.diffusion import create_diffusion
from opendit.encoders.vae import encode, vae_geometry


def latent_geometry(image_size: int, vae, data_channels: int, patch_size: int) -> tuple[int, int]:
    """(input_size, in_channels) of the model for images of image_size through `vae` (None: pixel space);
    a clear error when the sizes do not fit."""
    factor, latent_channels = vae_geometry(vae)
    if image_size <= 0 or image_size % (factor * patch_size):
        need = "patch size" if vae is None else f"{factor} (the VAE's downsampling) x patch size"
        raise ValueError(f"--image_size {image_size} must be a positive multiple of {need} = "
                         f"{factor * patch_size}; e.g. {max(1, image_size // (factor * patch_size)) * factor * patch_size}")
    return image_size // factor, (data_channels if vae is None else latent_channels)


class DiffusionObjective:
    def __init__(self, vae=None, vae_scale: float = 0.18215, learn_sigma: bool = True):
        self.diffusion = create_diffusion(timestep_respacing="", learn_sigma=learn_sigma)
        self.vae, self.vae_scale = vae, vae_scale

    def prepare(self, batch, device):
        """(images [B, C, H, W] in [-1, 1], labels [B]) -> (model input x, labels) on device.

        A cached-latent batch ((mean, std) [B, C, h, w] each, labels) draws one posterior sample from the
        global RNG, as encode() does on the fly (same draw: mean + std * randn on the device)."""
        x, y = batch
        y = y.to(device, non_blocking=True)
        if isinstance(x, (list, tuple)):
            mean, std = (t.to(device, non_blocking=True) for t in x)
            return (mean + std * torch.randn(mean.shape, device=device, dtype=mean.dtype)) * self.vae_scale, y
        x = x.to(device, non_blocking=True)
        if self.vae is not None:
            x = encode(self.vae, x, scale=self.vae_scale)
        return x, y

    def loss(self, model, x, y) -> torch.Tensor:
        """Mean MSE + VLB loss over the micro-batch; t and noise come from the (checkpointed) global RNG."""
        t = self.diffusion.sample_timesteps(x.shape[0], x.device)

        def model_fn(x_t, t, y):
            return model(x_t, t, y).float()  # the loss is computed in fp32 whatever the compute dtype

        return self.diffusion.training_losses(model_fn, x, t, dict(y=y))["loss"].mean()
