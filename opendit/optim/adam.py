"""AdamW and NAdamW (Nesterov momentum, decoupled weight decay) on LeanOptimizer.

With fp32 states and fp32 parameters the math is op-for-op torch.optim.AdamW /
torch.optim.NAdam(decoupled_weight_decay=True), which the tests check.
"""
import math

import torch

from .base import LeanOptimizer


def lean_defaults(lr, betas, eps, weight_decay, state_dtype, master_weights, u16_block, u16_power,
                  small_numel, per_tensor_clip, **extra):
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(f"lr, eps and weight_decay must be >= 0, got lr={lr}, eps={eps}, "
                         f"weight_decay={weight_decay}")
    if any(not 0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"every beta must be in [0, 1), got betas={betas}")
    return dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, state_dtype=state_dtype,
                master_weights=master_weights, u16_block=u16_block, u16_power=u16_power,
                small_numel=small_numel, per_tensor_clip=per_tensor_clip, **extra)


class AdamW(LeanOptimizer):
    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 state_device="gpu", state_dtype="fp32", master_weights="fp32", u16_block=256,
                 u16_power=3.0, small_numel=4096, per_tensor_clip=None, seed=0, **extra):
        defaults = lean_defaults(lr, betas, eps, weight_decay, state_dtype, master_weights, u16_block,
                                 u16_power, small_numel, per_tensor_clip, **extra)
        super().__init__(params, defaults, state_device=state_device, seed=seed)

    def _update(self, w, g, s, group, step, st):
        lr, (beta1, beta2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
        m, v = s["exp_avg"], s["exp_avg_sq"]
        if wd:
            w.mul_(1 - lr * wd)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
        denom = (v.sqrt() / math.sqrt(bias2)).add_(eps)
        w.addcdiv_(m, denom, value=-lr / bias1)


class NAdamW(AdamW):
    """NAdam with decoupled weight decay; the momentum schedule mu_t = beta1 (1 - 0.5 * 0.96^(t psi))
    of Dozat (2016) with psi = momentum_decay, as in torch.optim.NAdam."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 momentum_decay=4e-3, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, momentum_decay=momentum_decay, **kwargs)

    def _init_scalars(self):
        # The product of mu_1..mu_t, kept in fp64 on the host (one number per parameter).
        return {"mu_product": torch.ones((), dtype=torch.float64)}

    def _update(self, w, g, s, group, step, st):
        lr, (beta1, beta2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
        psi = group["momentum_decay"]
        m, v = s["exp_avg"], s["exp_avg_sq"]
        if wd:
            w.mul_(1 - lr * wd)
        mu = beta1 * (1.0 - 0.5 * 0.96 ** (step * psi))
        mu_next = beta1 * (1.0 - 0.5 * 0.96 ** ((step + 1) * psi))
        st["mu_product"].mul_(mu)
        mu_product = float(st["mu_product"])
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = v.div(1 - beta2 ** step).sqrt().add_(eps)
        # Nesterov: the current gradient's share (1 - mu) plus the look-ahead momentum's share mu_next.
        w.addcdiv_(g, denom, value=-lr * (1.0 - mu) / (1.0 - mu_product))
        w.addcdiv_(m, denom, value=-lr * mu_next / (1.0 - mu_product * mu_next))
