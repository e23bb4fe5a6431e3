"""Gaussian diffusion as DiT trains it (IDDPM / ADM): forward process, posterior, losses.

Conventions: x tensors are [B, C, ...] (images [B, C, H, W], video [B, C, T, H, W]); t is a long
tensor [B] of step indices into *this* diffusion's schedule (a SpacedDiffusion maps them back to
the original 0..999 before calling the model). Schedule arrays are float64 numpy; each step's
coefficients are gathered in float64 and only then cast to the sample's dtype and device.
The samplers (DDPM ancestral, DDIM) live in sampling.py and are mixed in.
"""
import numpy as np
import torch

from .losses import discretized_gaussian_log_likelihood, mean_flat, normal_kl
from .sampling import SamplingMixin, randn
from .schedule import LossType, ModelMeanType, ModelVarType, extract as _extract


def _split_output(model_output):
    """Models may return (output, extra); DiT-style models return the output alone."""
    if isinstance(model_output, tuple):
        return model_output[0], model_output[1]
    return model_output, None


class GaussianDiffusion(SamplingMixin):
    """Forward process q(x_t | x_0), reverse process p(x_{t-1} | x_t) and IDDPM's training losses.

    betas: 1-D float64 array, each in (0, 1]. See schedule.py for the three enums.
    """

    def __init__(self, *, betas, model_mean_type: ModelMeanType, model_var_type: ModelVarType,
                 loss_type: LossType):
        betas = np.asarray(betas, dtype=np.float64)
        if betas.ndim != 1 or len(betas) == 0 or (betas <= 0).any() or (betas > 1).any():
            raise ValueError("betas must be a non-empty 1-D array with every value in (0, 1]; "
                             "build it with get_named_beta_schedule")
        self.model_mean_type, self.model_var_type, self.loss_type = model_mean_type, model_var_type, loss_type
        self.betas = betas
        self.num_timesteps = len(betas)

        alphas = 1.0 - betas
        self.alphas_cumprod = np.cumprod(alphas)
        self.alphas_cumprod_prev = np.append(1.0, self.alphas_cumprod[:-1])
        self.alphas_cumprod_next = np.append(self.alphas_cumprod[1:], 0.0)
        # q(x_t | x_0) = N(sqrt(acp) x_0, (1 - acp) I)
        self.sqrt_alphas_cumprod = np.sqrt(self.alphas_cumprod)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - self.alphas_cumprod)
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod - 1)
        # q(x_{t-1} | x_t, x_0) = N(coef1 x_0 + coef2 x_t, beta_tilde_t)
        self.posterior_variance = betas * (1.0 - self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        # beta_tilde_0 = 0, so its log is clipped to beta_tilde_1 (a 1-step chain falls back to beta).
        first = self.posterior_variance[1] if self.num_timesteps > 1 else betas[0]
        self.posterior_log_variance_clipped = np.log(np.append(first, self.posterior_variance[1:]))
        self.posterior_mean_coef1 = betas * np.sqrt(self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = (1.0 - self.alphas_cumprod_prev) * np.sqrt(alphas) / (1.0 - self.alphas_cumprod)

    # ---- forward process -------------------------------------------------------------------
    def q_sample(self, x_start, t, noise=None, generator=None):
        """Draw x_t ~ q(x_t | x_0): sqrt(acp_t) x_0 + sqrt(1 - acp_t) noise."""
        if noise is None:
            noise = randn(x_start.shape, generator, x_start.device, x_start.dtype)
        if noise.shape != x_start.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} must equal x_start shape {tuple(x_start.shape)}")
        return (_extract(self.sqrt_alphas_cumprod, t, x_start) * x_start
                + _extract(self.sqrt_one_minus_alphas_cumprod, t, x_start) * noise)

    def q_posterior_mean_variance(self, x_start, x_t, t):
        """Mean, variance and clipped log-variance of q(x_{t-1} | x_t, x_0)."""
        mean = (_extract(self.posterior_mean_coef1, t, x_t) * x_start
                + _extract(self.posterior_mean_coef2, t, x_t) * x_t)
        return (mean, _extract(self.posterior_variance, t, x_t),
                _extract(self.posterior_log_variance_clipped, t, x_t))

    def sample_timesteps(self, batch: int, device=None, generator=None) -> torch.Tensor:
        """Uniform training timesteps in [0, num_timesteps), long [batch]."""
        gen_device = generator.device if generator is not None else device
        t = torch.randint(0, self.num_timesteps, (batch,), generator=generator, device=gen_device)
        return t.to(device)

    # ---- reverse process -------------------------------------------------------------------
    def _predict_xstart_from_eps(self, x_t, t, eps):
        return (_extract(self.sqrt_recip_alphas_cumprod, t, x_t) * x_t
                - _extract(self.sqrt_recipm1_alphas_cumprod, t, x_t) * eps)

    def _predict_eps_from_xstart(self, x_t, t, pred_xstart):
        return ((_extract(self.sqrt_recip_alphas_cumprod, t, x_t) * x_t - pred_xstart)
                / _extract(self.sqrt_recipm1_alphas_cumprod, t, x_t))

    def _model_variance(self, model_var_values, x, t):
        """(variance, log_variance) of p(x_{t-1} | x_t), each broadcastable to x."""
        if self.model_var_type == ModelVarType.LEARNED_RANGE:
            # var_values in [-1, 1] interpolate log-variance between beta_tilde_t (-1) and beta_t (+1).
            min_log = _extract(self.posterior_log_variance_clipped, t, x)
            max_log = _extract(np.log(self.betas), t, x)
            frac = (model_var_values + 1) / 2
            log_variance = frac * max_log + (1 - frac) * min_log
            return torch.exp(log_variance), log_variance
        if self.model_var_type == ModelVarType.FIXED_LARGE:
            # beta_t, except step 0 uses beta_tilde_1 so the decoder's log-likelihood stays sane.
            variance = np.append(self.posterior_variance[1] if self.num_timesteps > 1 else self.betas[0],
                                 self.betas[1:])
            return _extract(variance, t, x), _extract(np.log(variance), t, x)
        return _extract(self.posterior_variance, t, x), _extract(self.posterior_log_variance_clipped, t, x)

    def p_mean_variance(self, model_fn, x, t, clip_denoised=False, denoised_fn=None, model_kwargs=None):
        """Run the model once and return p(x_{t-1} | x_t) and its x_0 estimate.

        model_fn(x [B, C, ...], t [B], **model_kwargs) -> [B, 2C, ...] (eps then variance values)
        for LEARNED_RANGE, else [B, C, ...]. Returns a dict of "mean", "variance", "log_variance",
        "pred_xstart" (all broadcastable to x) and "extra" (a model's second output, or None).
        """
        model_output, extra = _split_output(model_fn(x, t, **(model_kwargs or {})))
        model_output = model_output.to(x.dtype)
        channels = x.shape[1]
        if self.model_var_type == ModelVarType.LEARNED_RANGE:
            if model_output.shape[1] != 2 * channels:
                raise ValueError(f"model output has {model_output.shape[1]} channels but learn_sigma needs "
                                 f"2 * {channels} (eps/x0, then variance values); build the model with "
                                 "learn_sigma=True or the diffusion with learn_sigma=False")
            model_output, model_var_values = model_output.split(channels, dim=1)
        else:
            if model_output.shape[1] != channels:
                raise ValueError(f"model output has {model_output.shape[1]} channels but the sample has "
                                 f"{channels}; a learn_sigma model needs create_diffusion(learn_sigma=True)")
            model_var_values = None
        variance, log_variance = self._model_variance(model_var_values, x, t)

        if self.model_mean_type == ModelMeanType.START_X:
            pred_xstart = model_output
        else:
            pred_xstart = self._predict_xstart_from_eps(x, t, model_output)
        if denoised_fn is not None:
            pred_xstart = denoised_fn(pred_xstart)
        if clip_denoised:
            pred_xstart = pred_xstart.clamp(-1, 1)
        mean, _, _ = self.q_posterior_mean_variance(pred_xstart, x, t)
        return {"mean": mean, "variance": variance.expand_as(x), "log_variance": log_variance.expand_as(x),
                "pred_xstart": pred_xstart, "extra": extra}

    # ---- training objective ----------------------------------------------------------------
    def _vb_terms_bpd(self, model_fn, x_start, x_t, t, clip_denoised=False, model_kwargs=None):
        """One term of the variational bound, in bits per dim: [B].

        KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t)) for t > 0, the decoder NLL of x_0 at t == 0.
        """
        true_mean, _, true_log_variance = self.q_posterior_mean_variance(x_start, x_t, t)
        out = self.p_mean_variance(model_fn, x_t, t, clip_denoised=clip_denoised, model_kwargs=model_kwargs)
        kl = normal_kl(true_mean, true_log_variance, out["mean"], out["log_variance"])
        kl = mean_flat(kl) / np.log(2.0)
        decoder_nll = -discretized_gaussian_log_likelihood(
            x_start, means=out["mean"], log_scales=0.5 * out["log_variance"])
        decoder_nll = mean_flat(decoder_nll) / np.log(2.0)
        return {"output": torch.where(t == 0, decoder_nll, kl), "pred_xstart": out["pred_xstart"]}

    def training_losses(self, model_fn, x_start, t, model_kwargs=None, noise=None, generator=None):
        """Per-sample losses for one batch: dict of "loss", "mse", "vb", each [B].

        x_start: clean data (latents) [B, C, ...]; t: long [B] from sample_timesteps.
        MSE loss types (DiT's default): loss = mse + vb, where vb (the VLB term, scaled by
        num_timesteps / 1000 as IDDPM does) trains only the variance channels: it sees the
        eps/x0 channels through .detach(), so the mean is trained by the MSE alone. With a fixed
        variance there is nothing for vb to train and it is 0. KL loss types: loss is the VLB
        itself (times num_timesteps for RESCALED_KL) and mse is reported detached.
        """
        if noise is None:
            noise = randn(x_start.shape, generator, x_start.device, x_start.dtype)
        x_t = self.q_sample(x_start, t, noise=noise)
        model_output, _ = _split_output(model_fn(x_t, t, **(model_kwargs or {})))
        model_output = model_output.to(x_t.dtype)
        channels = x_start.shape[1]
        learned = self.model_var_type == ModelVarType.LEARNED_RANGE
        expected = 2 * channels if learned else channels
        if model_output.shape[:1] + model_output.shape[2:] != x_t.shape[:1] + x_t.shape[2:] \
                or model_output.shape[1] != expected:
            raise ValueError(f"model output shape {tuple(model_output.shape)} does not fit x_t "
                             f"{tuple(x_t.shape)}: expected {expected} channels "
                             f"({'eps/x0 then variance values' if learned else 'eps/x0'})")
        pred, var_values = model_output.split(channels, dim=1) if learned else (model_output, None)

        target = noise if self.model_mean_type == ModelMeanType.EPSILON else x_start
        mse = mean_flat((target - pred) ** 2)

        if self.loss_type.is_vb():
            vb = self._frozen_vb(model_output, x_start, x_t, t)
            scale = self.num_timesteps if self.loss_type == LossType.RESCALED_KL else 1.0
            return {"loss": vb * scale, "mse": mse.detach(), "vb": vb}
        if learned:
            frozen = torch.cat([pred.detach(), var_values], dim=1)
            # Divide by 1000 as IDDPM does: an unscaled VB term would swamp the MSE term.
            vb = self._frozen_vb(frozen, x_start, x_t, t) * (self.num_timesteps / 1000.0)
        else:
            vb = torch.zeros_like(mse)
        return {"loss": mse + vb, "mse": mse, "vb": vb}

    def _frozen_vb(self, model_output, x_start, x_t, t):
        """VLB term [B] for an already computed model output (the model is not called again)."""
        return self._vb_terms_bpd(lambda *args, **kwargs: model_output, x_start, x_t, t,
                                  clip_denoised=False)["output"]
