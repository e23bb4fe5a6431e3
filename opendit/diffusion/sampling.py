"""Samplers for GaussianDiffusion: DDPM ancestral sampling and DDIM.

All randomness comes from an optional torch.Generator, so a seed fixes the samples. A CPU
generator may drive sampling on a GPU: noise is drawn on the generator's device and moved, so a
seed gives the same numbers whatever device the model runs on.

Classifier-free guidance is the model's business, not the sampler's: pass a model_fn such as
DiT's forward_with_cfg, run on a doubled batch [cond; uncond] with model_kwargs carrying the
labels and cfg_scale. With learn_sigma it mixes only the eps channels
(eps = uncond + s * (cond - uncond), written to both halves) and keeps each half's own variance
channels; take the first (conditional) half of the final samples, whose variance is the
conditional prediction's.
"""
import sys
from collections import deque

import torch

from tqdm.auto import tqdm

from .schedule import extract as _extract


def progress_interval() -> float:
    """Seconds between progress-bar updates: live on a terminal, every 30 s into a log file."""
    return 1.0 if sys.stderr.isatty() else 30.0


def randn(shape, generator=None, device=None, dtype=torch.float32) -> torch.Tensor:
    """Standard normal noise of `shape` from `generator`, returned on `device` in `dtype`."""
    draw_device = generator.device if generator is not None else device
    return torch.randn(tuple(shape), generator=generator, device=draw_device, dtype=dtype).to(device)


def _nonzero_mask(t, x):
    """1 where t != 0 else 0, as [B, 1, ..., 1]: the last step adds no noise."""
    return (t != 0).to(x.dtype).view(-1, *([1] * (x.ndim - 1)))


class SamplingMixin:
    """Needs p_mean_variance, _predict_eps_from_xstart, alphas_cumprod(_prev) and num_timesteps."""

    def p_sample(self, model_fn, x, t, clip_denoised=False, denoised_fn=None, model_kwargs=None,
                 generator=None, noise=None):
        """One ancestral step x_t -> x_{t-1}. Returns {"sample", "pred_xstart"}.

        noise (same shape as x) overrides drawing from generator.
        """
        out = self.p_mean_variance(model_fn, x, t, clip_denoised=clip_denoised, denoised_fn=denoised_fn,
                                   model_kwargs=model_kwargs)
        if noise is None:
            noise = randn(x.shape, generator, x.device, x.dtype)
        sample = out["mean"] + _nonzero_mask(t, x) * torch.exp(0.5 * out["log_variance"]) * noise
        return {"sample": sample, "pred_xstart": out["pred_xstart"]}

    def ddim_sample(self, model_fn, x, t, clip_denoised=False, denoised_fn=None, model_kwargs=None,
                    eta=0.0, generator=None, noise=None):
        """One DDIM step x_t -> x_{t-1} (Song et al. eq. 12). Returns {"sample", "pred_xstart"}.

        eta = 0 is deterministic; eta = 1 matches DDPM's posterior variance. With a learned
        variance the variance channels are ignored, as in DiT.
        """
        out = self.p_mean_variance(model_fn, x, t, clip_denoised=clip_denoised, denoised_fn=denoised_fn,
                                   model_kwargs=model_kwargs)
        # Re-derive eps from the (possibly clipped) x0 estimate so the two stay consistent.
        eps = self._predict_eps_from_xstart(x, t, out["pred_xstart"])
        # Per-step coefficients in float64, cast once: [B, 1, ..., 1].
        acp = _extract(self.alphas_cumprod, t, x, torch.float64)
        acp_prev = _extract(self.alphas_cumprod_prev, t, x, torch.float64)
        sigma = eta * torch.sqrt((1 - acp_prev) / (1 - acp)) * torch.sqrt(1 - acp / acp_prev)
        coef_x0 = torch.sqrt(acp_prev).to(x.dtype)
        coef_eps = torch.sqrt((1 - acp_prev - sigma ** 2).clamp(min=0)).to(x.dtype)
        sample = coef_x0 * out["pred_xstart"] + coef_eps * eps
        if eta != 0:
            if noise is None:
                noise = randn(x.shape, generator, x.device, x.dtype)
            sample = sample + _nonzero_mask(t, x) * sigma.to(x.dtype) * noise
        return {"sample": sample, "pred_xstart": out["pred_xstart"]}

    def _sample_loop_progressive(self, step, shape, noise, device, progress, generator):
        """Run `step(x, t)` from t = T-1 down to 0, yielding each step's output dict."""
        if noise is not None:
            if tuple(noise.shape) != tuple(shape):
                raise ValueError(f"noise shape {tuple(noise.shape)} must equal shape {tuple(shape)}")
            x = noise.to(device) if device is not None else noise
        else:
            x = randn(shape, generator, device)
        indices = range(self.num_timesteps - 1, -1, -1)
        for i in tqdm(indices, desc="sampling", disable=not progress, mininterval=progress_interval()):
            t = torch.full((x.shape[0],), i, device=x.device, dtype=torch.long)
            with torch.no_grad():
                out = step(x, t)
            yield out
            x = out["sample"]

    def p_sample_loop_progressive(self, model_fn, shape, noise=None, model_kwargs=None, device=None,
                                  progress=False, generator=None, clip_denoised=False, denoised_fn=None):
        """Yields p_sample's dict at every step (for previews or saving trajectories)."""
        def step(x, t):
            return self.p_sample(model_fn, x, t, clip_denoised=clip_denoised, denoised_fn=denoised_fn,
                                 model_kwargs=model_kwargs, generator=generator)
        yield from self._sample_loop_progressive(step, shape, noise, device, progress, generator)

    def p_sample_loop(self, model_fn, shape, noise=None, model_kwargs=None, device=None, progress=False,
                      generator=None, clip_denoised=False, denoised_fn=None) -> torch.Tensor:
        """DDPM ancestral sampling over all of this diffusion's steps; returns x_0 [shape].

        noise: the starting x_T (else drawn from generator, float32, on device).
        clip_denoised defaults to False because DiT samples VAE latents, which are not in [-1, 1].
        """
        steps = self.p_sample_loop_progressive(model_fn, shape, noise, model_kwargs, device, progress, generator,
                                               clip_denoised, denoised_fn)
        return deque(steps, maxlen=1)[0]["sample"]  # the last step's; the others are dropped as they come

    def ddim_sample_loop_progressive(self, model_fn, shape, noise=None, model_kwargs=None, device=None,
                                     progress=False, generator=None, clip_denoised=False, denoised_fn=None,
                                     eta=0.0):
        """Yields ddim_sample's dict at every step."""
        def step(x, t):
            return self.ddim_sample(model_fn, x, t, clip_denoised=clip_denoised, denoised_fn=denoised_fn,
                                    model_kwargs=model_kwargs, eta=eta, generator=generator)
        yield from self._sample_loop_progressive(step, shape, noise, device, progress, generator)

    def ddim_sample_loop(self, model_fn, shape, noise=None, model_kwargs=None, device=None, progress=False,
                         generator=None, clip_denoised=False, denoised_fn=None, eta=0.0) -> torch.Tensor:
        """DDIM sampling over all of this diffusion's steps (respace it, e.g. "ddim50", to go fast)."""
        steps = self.ddim_sample_loop_progressive(model_fn, shape, noise, model_kwargs, device, progress, generator,
                                                  clip_denoised, denoised_fn, eta)
        return deque(steps, maxlen=1)[0]["sample"]
