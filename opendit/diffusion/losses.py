"""Log-likelihood helpers for the variational bound (IDDPM / ADM definitions)."""
import math

import torch


def mean_flat(x: torch.Tensor) -> torch.Tensor:
    """Mean over every dim but the batch: [B, ...] -> [B]."""
    return x.mean(dim=tuple(range(1, x.ndim)))


def normal_kl(mean1, logvar1, mean2, logvar2) -> torch.Tensor:
    """KL(N(mean1, exp(logvar1)) || N(mean2, exp(logvar2))) elementwise, in nats.

    Arguments broadcast; scalars may be floats as long as one argument is a tensor.
    """
    ref = next((x for x in (mean1, logvar1, mean2, logvar2) if isinstance(x, torch.Tensor)), None)
    if ref is None:
        raise TypeError("normal_kl needs at least one tensor argument")
    logvar1, logvar2 = (torch.as_tensor(v, dtype=ref.dtype, device=ref.device) for v in (logvar1, logvar2))
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2)
                  + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def approx_standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    """Fast tanh approximation of the standard normal CDF (the one IDDPM's reported NLLs use)."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def discretized_gaussian_log_likelihood(x, means, log_scales) -> torch.Tensor:
    """Log-likelihood (nats, elementwise) of 8-bit data x in [-1, 1] under a discretized Gaussian.

    Each value owns a bin of width 2/255; the two edge bins extend to -inf / +inf.
    x, means, log_scales: same shape.
    """
    if not (x.shape == means.shape == log_scales.shape):
        raise ValueError(f"x {tuple(x.shape)}, means {tuple(means.shape)} and log_scales "
                         f"{tuple(log_scales.shape)} must have the same shape")
    centered = x - means
    inv_std = torch.exp(-log_scales)
    cdf_plus = approx_standard_normal_cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = approx_standard_normal_cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    cdf_delta = cdf_plus - cdf_min
    return torch.where(
        x < -0.999, log_cdf_plus,
        torch.where(x > 0.999, log_one_minus_cdf_min, torch.log(cdf_delta.clamp(min=1e-12))),
    )
