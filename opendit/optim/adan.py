"""Adan (Xie et al., 2022, "Adan: Adaptive Nesterov Momentum Algorithm"), Algorithm 1 on LeanOptimizer.

Betas follow the torch convention (weight of the old value), i.e. beta_i = 1 - beta_i(paper):

    d_k = g_k - g_{k-1}                          (0 at the first step)
    m_k = beta1 m + (1 - beta1) g_k
    v_k = beta2 v + (1 - beta2) d_k
    n_k = beta3 n + (1 - beta3) (g_k + beta2 d_k)^2
    u_k = (m_k / bc1 + beta2 v_k / bc2) / (sqrt(n_k / bc3) + eps)     bc_i = 1 - beta_i^k
    w  <- (w - lr u_k) / (1 + lr wd)       (the paper's proximal decay; no_prox=True: w (1 - lr wd) - lr u_k)

Bias correction as in the authors' implementation. States: exp_avg (m), exp_avg_diff (v), exp_avg_sq (n)
and prev_grad (g_{k-1}); all four are stored in the chosen state format.
"""
import math

from .adam import lean_defaults
from .base import LeanOptimizer


class Adan(LeanOptimizer):
    state_names = ("exp_avg", "exp_avg_diff", "exp_avg_sq", "prev_grad")

    def __init__(self, params, lr=1e-4, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.02, *,
                 no_prox=False, state_device="gpu", state_dtype="fp32", master_weights="fp32", u16_block=256,
                 u16_power=3.0, small_numel=4096, per_tensor_clip=None, seed=0):
        if len(betas) != 3:
            raise ValueError(f"Adan needs three betas (beta1, beta2, beta3), got {betas}")
        defaults = lean_defaults(lr, betas, eps, weight_decay, state_dtype, master_weights, u16_block,
                                 u16_power, small_numel, per_tensor_clip, no_prox=no_prox)
        super().__init__(params, defaults, state_device=state_device, seed=seed)

    def _update(self, w, g, s, group, step, st):
        lr, (b1, b2, b3), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
        m, v, n, prev = s["exp_avg"], s["exp_avg_diff"], s["exp_avg_sq"], s["prev_grad"]
        diff = g - prev if step > 1 else g.new_zeros(())
        m.lerp_(g, 1 - b1)
        v.mul_(b2).add_(diff, alpha=1 - b2)
        u = g + b2 * diff
        n.mul_(b3).addcmul_(u, u, value=1 - b3)
        denom = (n.sqrt() / math.sqrt(1 - b3 ** step)).add_(eps)
        update = (m / (1 - b1 ** step)).add_(v, alpha=b2 / (1 - b2 ** step)).div_(denom)
        if group["no_prox"]:
            w.mul_(1 - lr * wd).add_(update, alpha=-lr)
        else:
            w.add_(update, alpha=-lr).div_(1 + lr * wd)
        prev.copy_(g)
