"""FLUX's rectified flow: the training objective and the Euler sampler, model-agnostic.

Convention (FLUX's, also SD3's and diffusers' FlowMatchEulerDiscreteScheduler's): t = 1 is pure noise, t = 0
is data.

    x_t = (1 - t) * x_0 + t * eps,      eps ~ N(0, I)
    v   = d x_t / d t = eps - x_0        (the model predicts v; FLUX embeds t in [0, 1], scaling it by 1000 itself)

Training (the FLUX objective builds the model call, packing and conditioning around this):

    flow = RectifiedFlow()                                   # logit-normal t, resolution-shifted
    t = flow.sample_t(B, x0.device, image_seq_len=L)         # [B] float32, from the global RNG
    noise = torch.randn_like(x0)                             # global RNG, after t
    pred = model(pack(flow.noisy(x0, t, noise)), ..., timesteps=t)
    loss = flow.loss_from(unpack(pred), x0=x0, noise=noise)  # fp32 MSE against eps - x0

or, with a model_fn(x_t, t) -> velocity of x0's shape, `flow.training_loss(model_fn, x0, image_seq_len=L)`.
All randomness comes from the global torch RNG on x0's device (as the Gaussian objective's), so a checkpointed
RNG state resumes the same t and noise.

Sampling (official FLUX `get_schedule` + `denoise`): schnell uses 4 steps unshifted, dev 50 steps shifted.

    timesteps = flux_schedule(50, image_seq_len=L)           # [1.0, ..., 0.0], 51 values
    x0 = euler_sample(velocity_fn, noise, timesteps)         # velocity_fn(x, t_vec) -> v, x's shape

The caller's velocity_fn owns the model, packing, FLUX's guidance embedding and any true classifier-free
guidance (`cfg_velocity`).
"""
import math

import torch
from tqdm.auto import tqdm

from .sampling import progress_interval, randn

FLOW_SAMPLERS = ("euler",)
TIMESTEP_SAMPLINGS = ("logit_normal", "uniform")


# ---- schedule ------------------------------------------------------------------------------------------------
def time_shift(mu: float, sigma: float, t):
    """FLUX's time shift exp(mu) / (exp(mu) + (1/t - 1)**sigma): maps [0, 1] onto [0, 1] (0 -> 0, 1 -> 1),
    pushing t towards 1 (noise) for mu > 0. t: a float or a tensor of any shape (computed in t's dtype)."""
    if torch.is_tensor(t):
        return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)
    if t <= 0:  # 1/t would raise for a Python float; the tensor formula gives exactly 0 there
        return 0.0
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)


def shift_times(t, shift: float):
    """The constant time shift of SD3 and Wan2.1, shift * t / (1 + (shift - 1) * t) (= time_shift(log(shift), 1,
    t)): 0 -> 0, 1 -> 1, towards noise for shift > 1. t: a float, a list or a tensor."""
    if shift <= 0:
        raise ValueError(f"shift {shift} must be > 0 (1: no shift; Wan2.1 samples with 5)")
    if isinstance(t, list):
        return [shift * v / (1 + (shift - 1) * v) for v in t]
    return shift * t / (1 + (shift - 1) * t)


def flux_mu(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5,
            max_shift: float = 1.15) -> float:
    """The shift mu for a packed image of image_seq_len tokens: the line through (base_seq_len, base_shift) and
    (max_seq_len, max_shift) (official `get_lin_function`; diffusers' `calculate_shift`). FLUX packs 2x2
    latent patches, so a 1024x1024 image (128x128 latents) has 4096 tokens."""
    if image_seq_len <= 0:
        raise ValueError(f"image_seq_len={image_seq_len}: must be the positive number of packed image tokens "
                         f"(latent H/2 * W/2 for FLUX)")
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def flux_schedule(num_steps: int, image_seq_len: int, shift: bool = True, base_shift: float = 0.5,
                  max_shift: float = 1.15) -> list[float]:
    """num_steps + 1 sampling timesteps from 1.0 (noise) down to 0.0 (data), as official FLUX `get_schedule`:
    linspace(1, 0, num_steps + 1) in float32, then, with shift, time_shift(flux_mu(image_seq_len), 1, .).
    schnell: shift=False (4 steps); dev: shift=True (50 steps)."""
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps}: need at least 1 sampling step")
    timesteps = torch.linspace(1, 0, num_steps + 1)
    if shift:
        timesteps = time_shift(flux_mu(image_seq_len, base_shift=base_shift, max_shift=max_shift), 1.0, timesteps)
    return timesteps.tolist()


# ---- training ------------------------------------------------------------------------------------------------
def _per_sample(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """t [B] (float32) -> [B, 1, ..., 1] broadcastable against x [B, ...]."""
    if t.ndim != 1 or t.shape[0] != x.shape[0]:
        raise ValueError(f"t shape {tuple(t.shape)} must be [B] = [{x.shape[0]}], one time per sample of x "
                         f"{tuple(x.shape)}")
    return t.float().view(-1, *([1] * (x.ndim - 1)))


class RectifiedFlow:
    """FLUX's rectified-flow training objective (velocity prediction, plain MSE).

    distribution: how training times are drawn: "logit_normal" = sigmoid(N(logit_mean, logit_std)) (SD3's
    default, mass around t = 0.5), or "uniform" = U(0, 1) (torchtitan's FLUX trainer).
    shift: then apply FLUX's resolution-dependent time_shift(flux_mu(image_seq_len, base_shift, max_shift), 1, t),
    as at sampling, so larger images train at noisier times.
    """

    def __init__(self, distribution: str = "logit_normal", shift: bool = True, logit_mean: float = 0.0,
                 logit_std: float = 1.0, base_shift: float = 0.5, max_shift: float = 1.15):
        _check_distribution(distribution)
        if logit_std < 0:
            raise ValueError(f"logit_std={logit_std}: must be >= 0 (the std of the normal passed to sigmoid)")
        self.distribution, self.shift = distribution, shift
        self.logit_mean, self.logit_std = logit_mean, logit_std
        self.base_shift, self.max_shift = base_shift, max_shift

    def sample_t(self, n: int, device=None, image_seq_len: int | None = None, *, distribution: str | None = None,
                 shift: bool | None = None, logit_mean: float | None = None, logit_std: float | None = None,
                 generator=None) -> torch.Tensor:
        """n training times in [0, 1], float32 [n] on device, drawn from the global RNG on device (or
        generator). Keyword arguments left None take this objective's settings. image_seq_len (packed image
        tokens) is required when shifting."""
        distribution = self.distribution if distribution is None else distribution
        shift = self.shift if shift is None else shift
        mean = self.logit_mean if logit_mean is None else logit_mean
        std = self.logit_std if logit_std is None else logit_std
        _check_distribution(distribution)
        if shift and image_seq_len is None:
            raise ValueError("sample_t with shift=True needs image_seq_len (the packed image tokens, latent "
                             "H/2 * W/2 for FLUX); pass it, or shift=False")
        draw_device = generator.device if generator is not None else device
        if distribution == "logit_normal":
            t = torch.sigmoid(torch.randn(n, generator=generator, device=draw_device) * std + mean)
        else:
            t = torch.rand(n, generator=generator, device=draw_device)
        t = t.to(device)
        if shift:
            mu = flux_mu(image_seq_len, base_shift=self.base_shift, max_shift=self.max_shift)
            t = time_shift(mu, 1.0, t)
        return t

    @staticmethod
    def noisy(x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x_t = (1 - t) x0 + t noise, computed in fp32 and returned in x0's dtype. x0, noise [B, ...]; t [B]."""
        if noise.shape != x0.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} must equal x0 shape {tuple(x0.shape)}")
        t = _per_sample(t, x0)
        return ((1 - t) * x0.float() + t * noise.float()).to(x0.dtype)

    @staticmethod
    def target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The velocity the model learns, noise - x0, in fp32 [B, ...]."""
        if noise.shape != x0.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} must equal x0 shape {tuple(x0.shape)}")
        return noise.float() - x0.float()

    @staticmethod
    def mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Scalar fp32 loss: the mean over the batch of mse_per_sample."""
        return RectifiedFlow.mse_per_sample(pred, target).mean()

    @staticmethod
    def mse_per_sample(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """fp32 [B]: squared error in fp32 (whatever pred's dtype), mean over all but the batch dim. pred and
        target [B, ...] of the same shape."""
        if pred.shape != target.shape:
            raise ValueError(f"prediction shape {tuple(pred.shape)} must equal target shape {tuple(target.shape)}"
                             f"; unpack the model's tokens to x0's layout (or pack x0 and noise) first")
        err = (pred.float() - target.float()) ** 2
        return err.flatten(1).mean(1)

    def loss_from(self, pred: torch.Tensor, *, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """mse(pred, noise - x0): the loss of a velocity prediction pred [B, ...] made at noisy(x0, t, noise).
        x0 and noise are keyword-only: swapping them would silently flip the target's sign."""
        return self.mse(pred, self.target(x0, noise))

    def losses(self, model_fn, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """Per-sample fp32 losses [B] of model_fn(x_t, t) -> velocity [B, ...] (x0's shape) at t [B]: the MSE against
        noise - x0. noise defaults to standard normal in x0's dtype from the global RNG on x0's device (the
        objectives of every flow family draw t first, their own way, then this)."""
        if noise is None:
            noise = randn(x0.shape, None, x0.device, x0.dtype)
        return self.mse_per_sample(model_fn(self.noisy(x0, t, noise), t).float(), self.target(x0, noise))

    def training_loss(self, model_fn, x0: torch.Tensor, t: torch.Tensor | None = None,
                      noise: torch.Tensor | None = None, image_seq_len: int | None = None,
                      **model_kwargs) -> torch.Tensor:
        """Scalar fp32 loss of model_fn(x_t, t, **model_kwargs) -> velocity [B, ...] (x0's shape) on x0 [B, ...].

        t [B] defaults to sample_t(B, x0.device, image_seq_len) and noise to standard normal in x0's dtype,
        drawn in that order from the global RNG on x0's device.
        """
        if t is None:
            t = self.sample_t(x0.shape[0], x0.device, image_seq_len)
        return self.losses(lambda x_t, t_: model_fn(x_t, t_, **model_kwargs), x0, t, noise).mean()


def _check_distribution(name):
    if name not in TIMESTEP_SAMPLINGS:
        raise ValueError(f"--timestep_sampling {name!r}: valid choices are {', '.join(TIMESTEP_SAMPLINGS)}")


# ---- sampling ------------------------------------------------------------------------------------------------
def cfg_velocity(cond_pred: torch.Tensor, uncond_pred: torch.Tensor, scale: float) -> torch.Tensor:
    """True classifier-free guidance on velocities, in fp32: uncond + scale * (cond - uncond). scale = 1 is the
    conditional prediction. (FLUX-dev's distilled guidance is instead an input of the model: velocity_fn's.)"""
    cond_pred, uncond_pred = cond_pred.float(), uncond_pred.float()
    return uncond_pred + scale * (cond_pred - uncond_pred)


def euler_sample(velocity_fn, x: torch.Tensor, timesteps, progress: bool = False) -> torch.Tensor:
    """Integrate dx/dt = velocity_fn(x, t) with Euler steps along timesteps (official FLUX `denoise`).

    velocity_fn(x, t_vec) -> velocity of x's shape, any dtype: x float32 [B, ...], t_vec float32 [B] (all equal
    to the current t; cast both to the model's dtype inside). x: the start, noise at timesteps[0] (= 1 for
    flux_schedule). timesteps: a list or 1-D tensor of >= 2 times, usually flux_schedule(...) from 1 down to 0
    (increasing times integrate towards noise instead, as in inversion).
    Each step is x <- x + (t_prev - t_curr) * v in float32 whatever the model dtype; runs under no_grad.
    Returns float32 [B, ...] at timesteps[-1].
    """
    timesteps = [float(s) for s in (timesteps.tolist() if torch.is_tensor(timesteps) else timesteps)]
    if len(timesteps) < 2:
        raise ValueError(f"timesteps has {len(timesteps)} value(s): need >= 2 (num_steps + 1, e.g. from "
                         f"flux_schedule(num_steps, image_seq_len))")
    x = x.float()
    with torch.no_grad():
        for t_curr, t_prev in tqdm(list(zip(timesteps[:-1], timesteps[1:])), desc="sampling", disable=not progress,
                                   mininterval=progress_interval()):
            t_vec = torch.full((x.shape[0],), t_curr, dtype=torch.float32, device=x.device)
            pred = velocity_fn(x, t_vec)
            if pred.shape != x.shape:
                raise ValueError(f"velocity_fn returned shape {tuple(pred.shape)} for x {tuple(x.shape)}: it must "
                                 f"return a velocity of x's shape (unpack the model's tokens)")
            x = x + (t_prev - t_curr) * pred.float()
    return x
