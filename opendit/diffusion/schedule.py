"""Beta schedules and the enums that configure a GaussianDiffusion.

All schedule math is float64 numpy: alphas_cumprod at t=999 is ~4e-5, and float32 cumulative
products drift by ~1e-6 relative over 1000 steps, which shows up in the VLB term.
"""
import enum
import math

import numpy as np
import torch


class ModelMeanType(enum.Enum):
    """What the network's first C output channels predict."""

    EPSILON = "epsilon"  # the noise added to x_start (DiT's default)
    START_X = "start_x"  # x_start itself


class ModelVarType(enum.Enum):
    """How the reverse-process variance Sigma_t is chosen."""

    FIXED_SMALL = "fixed_small"  # posterior variance beta_tilde_t (DDPM's lower bound)
    FIXED_LARGE = "fixed_large"  # beta_t (DDPM's upper bound)
    LEARNED_RANGE = "learned_range"  # network interpolates log-variance between the two (IDDPM)


class LossType(enum.Enum):
    MSE = "mse"  # eps MSE (+ VLB/1000 for the variance when it is learned): IDDPM's hybrid loss
    RESCALED_MSE = "rescaled_mse"  # same as MSE here; kept for flag parity with DiT/IDDPM
    KL = "kl"  # the variational bound alone
    RESCALED_KL = "rescaled_kl"  # VLB times num_timesteps, to approximate the full bound

    def is_vb(self) -> bool:
        return self in (LossType.KL, LossType.RESCALED_KL)


def betas_for_alpha_bar(num_steps: int, alpha_bar, max_beta: float = 0.999) -> np.ndarray:
    """Discretize a continuous alpha_bar(t in [0, 1]) into num_steps betas (float64, [num_steps])."""
    betas = []
    for i in range(num_steps):
        t1, t2 = i / num_steps, (i + 1) / num_steps
        betas.append(min(1 - alpha_bar(t2) / alpha_bar(t1), max_beta))
    return np.array(betas, dtype=np.float64)


def get_named_beta_schedule(name: str, num_steps: int) -> np.ndarray:
    """Betas of a named schedule, float64 [num_steps].

    "linear" is DDPM's schedule, rescaled so any num_steps spans the same noise range as 1000 steps
    (beta 1e-4 .. 0.02 at 1000 steps). "squaredcos_cap_v2" / "cosine" is IDDPM's cosine schedule.
    """
    if num_steps < 1:
        raise ValueError(f"diffusion_steps must be >= 1, got {num_steps}")
    if name == "linear":
        scale = 1000 / num_steps
        return np.linspace(scale * 1e-4, scale * 0.02, num_steps, dtype=np.float64)
    if name in ("squaredcos_cap_v2", "cosine"):
        return betas_for_alpha_bar(num_steps, lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2)
    raise ValueError(f"unknown noise_schedule {name!r}; use 'linear' or 'squaredcos_cap_v2'")


def extract(arr: np.ndarray, t: torch.Tensor, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """arr[t] as a [B, 1, ..., 1] tensor broadcastable to `like`, on like's device.

    The gather happens in float64; only the per-step values are cast, to `dtype` (default like's).
    """
    coef = torch.from_numpy(arr).to(like.device)[t.to(like.device)]  # float64 [B]
    return coef.to(dtype or like.dtype).view(-1, *([1] * (like.ndim - 1)))
