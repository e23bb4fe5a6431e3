"""Gaussian diffusion (IDDPM) as a training objective: what a batch of images (or cached latents) and labels
means, and what one micro-batch costs. The image families use it; a new objective (rectified flow) is a
sibling with the same two methods (opendit.families.base.Objective)."""
import torch

from opendit.diffusion import create_diffusion
from opendit.encoders.vae import encode


class DiffusionObjective:
    """labels: pass the batch's labels to the model as y (class-conditional); False: unconditional."""

    def __init__(self, vae=None, vae_scale: float = 0.18215, learn_sigma: bool = True, labels: bool = True):
        self.diffusion = create_diffusion(timestep_respacing="", learn_sigma=learn_sigma)
        self.vae, self.vae_scale, self.labels = vae, vae_scale, labels

    def prepare(self, batch, device) -> tuple[torch.Tensor, dict]:
        """(images [B, C, H, W] in [-1, 1], labels [B]) -> (model input x, {"y": labels}) on device.

        A cached-latent batch ((mean, std) [B, C, h, w] each, labels) draws one posterior sample from the
        global RNG, as encode() does on the fly (same draw: mean + std * randn on the device)."""
        x, y = batch
        cond = {"y": y.to(device, non_blocking=True)} if self.labels else {}
        if isinstance(x, (list, tuple)):
            mean, std = (t.to(device, non_blocking=True) for t in x)
            return (mean + std * torch.randn(mean.shape, device=device, dtype=mean.dtype)) * self.vae_scale, cond
        x = x.to(device, non_blocking=True)
        if self.vae is not None:
            x = encode(self.vae, x, scale=self.vae_scale)
        return x, cond

    def loss(self, model, x, cond: dict) -> torch.Tensor:
        """Mean MSE + VLB loss over the micro-batch; t and noise come from the (checkpointed) global RNG."""
        t = self.diffusion.sample_timesteps(x.shape[0], x.device)

        def model_fn(x_t, t, **kw):
            return model(x_t, t, **kw).float()  # the loss is computed in fp32 whatever the compute dtype

        return self.diffusion.training_losses(model_fn, x, t, cond)["loss"].mean()
