"""Gaussian diffusion (IDDPM) as a training objective: what a batch of images (or cached latents) and labels
means, and what one micro-batch costs. The Gaussian-diffusion families use it; another objective (FLUX's
rectified flow) is a sibling with the same two methods (the contract: opendit.families.base.Objective)."""
import torch

from opendit.diffusion import create_diffusion
from opendit.encoders.vae import encode, posterior_sample


class DiffusionObjective:
    """labels: pass the batch's labels to the model as y (class-conditional); False: unconditional."""

    def __init__(self, vae=None, vae_scale: float = 0.18215, learn_sigma: bool = True, labels: bool = True):
        self.diffusion = create_diffusion(timestep_respacing="", learn_sigma=learn_sigma)
        self.vae, self.vae_scale, self.labels = vae, vae_scale, labels

    def prepare(self, batch, device, train: bool = True) -> tuple[torch.Tensor, dict]:
        """(images [B, C, H, W] in [-1, 1], labels [B]) -> (model input x, {"y": labels}) on device.

        A cached-latent batch ((mean, std) [B, C, h, w] each, labels) draws one posterior sample from the
        global RNG, as encode() does on the fly (same draw: mean + std * randn on the device). Labels are dropped
        for guidance by the model itself in train mode, so `train` changes nothing here."""
        x, y = batch
        cond = {"y": y.to(device, non_blocking=True)} if self.labels else {}
        if isinstance(x, (list, tuple)):
            mean, std = (t.to(device, non_blocking=True) for t in x)
            return posterior_sample(mean, std) * self.vae_scale, cond
        x = x.to(device, non_blocking=True)
        if self.vae is not None:
            x = encode(self.vae, x, scale=self.vae_scale)
        return x, cond

    def losses(self, model, x, cond: dict, t_frac: torch.Tensor | None = None,
               noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-sample loss [B] in fp32, each sample's t / T [B] in [0, 1)). t_frac and noise None: drawn from
        the global RNG (training); given: t = floor(t_frac * T) and that noise (validation)."""
        steps = self.diffusion.num_timesteps
        if t_frac is None:
            t = self.diffusion.sample_timesteps(x.shape[0], x.device)
        else:
            t = (t_frac.to(x.device) * steps).long().clamp(0, steps - 1)

        def model_fn(x_t, t, **kw):
            return model(x_t, t, **kw).float()  # the loss is computed in fp32 whatever the compute dtype

        per_sample = self.diffusion.training_losses(model_fn, x, t, cond, noise=noise)["loss"]
        return per_sample, t.float() / steps
