"""Diffusion objectives and samplers.

`create_diffusion` builds DiT's Gaussian diffusion (IDDPM: linear betas, eps prediction, learned
variance, hybrid MSE + VLB loss). Typical use:

    train = create_diffusion()                          # 1000 steps
    t = train.sample_timesteps(x.shape[0], x.device)
    loss = train.training_losses(model, x, t, dict(y=y))["loss"].mean()
    sampler = create_diffusion("250")                   # or "ddim50" + ddim_sample_loop
    z = sampler.p_sample_loop(model.forward_with_cfg, z.shape, z, dict(y=y, cfg_scale=4.0))
"""
import torch

from .gaussian import GaussianDiffusion
from .losses import discretized_gaussian_log_likelihood, mean_flat, normal_kl
from .respace import SpacedDiffusion, space_timesteps
from .sampling import randn
from .schedule import LossType, ModelMeanType, ModelVarType, get_named_beta_schedule


def create_diffusion(timestep_respacing="", *, noise_schedule="linear", learn_sigma=True, diffusion_steps=1000,
                     sigma_small=False, predict_xstart=False, rescale_learned_sigmas=False,
                     use_kl=False) -> SpacedDiffusion:
    """DiT's diffusion factory (same defaults as facebookresearch/DiT's create_diffusion).

    timestep_respacing: "" or None for all diffusion_steps; "250" (evenly spaced), "ddim50"
    (fixed stride), "10,20,30" (per-section counts), an int or a list of ints.
    learn_sigma: the model outputs 2C channels (eps, then variance values in [-1, 1]);
    otherwise the variance is fixed: beta_t ("fixedlarge") or, with sigma_small, beta_tilde_t.
    """
    betas = get_named_beta_schedule(noise_schedule, diffusion_steps)
    if use_kl:
        loss_type = LossType.RESCALED_KL
    elif rescale_learned_sigmas:
        loss_type = LossType.RESCALED_MSE
    else:
        loss_type = LossType.MSE
    if timestep_respacing is None or timestep_respacing == "":
        timestep_respacing = [diffusion_steps]
    if learn_sigma:
        var_type = ModelVarType.LEARNED_RANGE
    else:
        var_type = ModelVarType.FIXED_SMALL if sigma_small else ModelVarType.FIXED_LARGE
    return SpacedDiffusion(
        space_timesteps(diffusion_steps, timestep_respacing), betas=betas,
        model_mean_type=ModelMeanType.START_X if predict_xstart else ModelMeanType.EPSILON,
        model_var_type=var_type, loss_type=loss_type)


SAMPLERS = ("ddpm", "ddim")  # ancestral DDPM (the default) and DDIM


class GaussianSampler:
    """DDPM or DDIM sampling, in `steps` respaced steps, of a model trained with create_diffusion().

    Call: sampler(model_fn, z, model_kwargs, device, generator) -> x_0 of z's shape, starting from z = x_T.
    clip_denoised: clamp each step's x_0 prediction to [-1, 1], right for data known to lie there (pixels; ADM
    does it), wrong for VAE latents (DiT does not).
    """

    def __init__(self, name: str = "ddpm", steps: int = 250, learn_sigma: bool = True, eta: float = 0.0,
                 clip_denoised: bool = False):
        if name not in SAMPLERS:
            raise ValueError(f"--sampler {name!r}: valid choices are {', '.join(SAMPLERS)}")
        self.name, self.steps, self.eta, self.clip_denoised = name, steps, eta, clip_denoised
        self.progress = False  # the default of __call__'s progress bar (sample.py sets it on rank 0)
        self.diffusion = create_diffusion(f"ddim{steps}" if name == "ddim" else str(steps), learn_sigma=learn_sigma)

    def __call__(self, model_fn, z, model_kwargs, device=None, generator=None, progress=None) -> torch.Tensor:
        progress = self.progress if progress is None else progress
        if self.name == "ddpm":
            return self.diffusion.p_sample_loop(model_fn, z.shape, z, model_kwargs, device=device,
                                                generator=generator, progress=progress,
                                                clip_denoised=self.clip_denoised)
        return self.diffusion.ddim_sample_loop(model_fn, z.shape, z, model_kwargs, device=device, generator=generator,
                                               eta=self.eta, progress=progress, clip_denoised=self.clip_denoised)


__all__ = [
    "SAMPLERS", "GaussianSampler", "create_diffusion", "GaussianDiffusion", "SpacedDiffusion", "space_timesteps",
    "get_named_beta_schedule",
    "ModelMeanType", "ModelVarType", "LossType", "normal_kl", "discretized_gaussian_log_likelihood",
    "mean_flat", "randn",
]

# FLUX's rectified flow (opendit.diffusion.flow): training objective, schedule and Euler sampler.
from .flow import (FLOW_SAMPLERS, TIMESTEP_SAMPLINGS, RectifiedFlow, cfg_velocity, euler_sample,  # noqa: E402
                   flux_mu, flux_schedule, time_shift)

__all__ += ["FLOW_SAMPLERS", "TIMESTEP_SAMPLINGS", "RectifiedFlow", "cfg_velocity", "euler_sample", "flux_mu",
            "flux_schedule", "time_shift"]
