"""AdamW and NAdamW (Nesterov momentum, decoupled weight decay) on LeanOptimizer.

AdamW's update is torch's own fused kernel (the one torch.optim.AdamW(fused=True) runs) on CUDA and CPU, so
with fp32 states it equals torch.optim.AdamW(fused=True) bit for bit. When every state is fp32 and beside its
parameter (no offload, no fused backward, no per-tensor clip), `step` updates all parameters of a group that
share a device and a step count in a few multi-tensor kernel calls instead of one call per parameter; the
per-parameter path runs the same kernel, so both give identical bits. NAdamW is op-for-op
torch.optim.NAdam(decoupled_weight_decay=True), which the tests check.
"""
import math

import torch

from opendit.distributed import local_tensor

from .base import LeanOptimizer

FUSED_DEVICES = ("cuda", "cpu")  # where torch has the fused AdamW kernel
CHUNK_NUMEL = 1 << 26  # per multi-tensor call: bounds the transient fp32 grads / masters to 256 MiB each


def fused_adamw_(ws, gs, ms, vs, step: int, lr, beta1, beta2, eps, weight_decay) -> None:
    """One AdamW update, in place, of fp32 tensors on one device that share the step count `step`."""
    # The kernel walks each tensor as flat memory: a non-contiguous one (a decoded u16 state is a slice of its
    # padded blocks) would get the wrong elements updated (seen on CPU, torch 2.13), so it works on a copy.
    lists = [[t if t.is_contiguous() else t.contiguous() for t in ts] for ts in (ws, gs, ms, vs)]
    steps = [torch.full((), float(step), device=ws[0].device)] * len(ws)  # read, not advanced, by the kernel
    torch._fused_adamw_(*lists, [], steps, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                        eps=eps, amsgrad=False, maximize=False)
    for given, dense in zip((ws, ms, vs), (lists[0], lists[2], lists[3])):
        for t, d in zip(given, dense):
            if d is not t:
                t.copy_(d)
    # nor does it bump the tensors' version counters, which tell block swap that a weight changed
    for t, d in zip(ws, lists[0]):
        if d is t:  # (a copied-back one was bumped by its copy_)
            torch.autograd.graph.increment_version(t)


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
    multi_tensor = True  # False: always the per-parameter path (the tests compare the two)

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 state_device="gpu", state_dtype="fp32", master_weights="fp32", u16_block=256,
                 u16_power=3.0, small_numel=4096, per_tensor_clip=None, seed=0, **extra):
        defaults = lean_defaults(lr, betas, eps, weight_decay, state_dtype, master_weights, u16_block,
                                 u16_power, small_numel, per_tensor_clip, **extra)
        super().__init__(params, defaults, state_device=state_device, seed=seed)

    def _update(self, w, g, s, group, step, st):
        lr, (beta1, beta2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
        m, v = s["exp_avg"], s["exp_avg_sq"]
        if w.device.type in FUSED_DEVICES:
            fused_adamw_([w], [g], [m], [v], step, lr, beta1, beta2, eps, wd)
            return
        if wd:
            w.mul_(1 - lr * wd)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
        denom = (v.sqrt() / math.sqrt(bias2)).add_(eps)
        w.addcdiv_(m, denom, value=-lr / bias1)

    def multi_tensor_ready(self) -> bool:
        return (self.multi_tensor and type(self) is AdamW and not self.fused_backward and not self.placement.offload
                and all(g["state_dtype"] == "fp32" and not g.get("per_tensor_clip") for g in self.param_groups)
                and all(local_tensor(p).device.type in FUSED_DEVICES for g in self.param_groups for p in g["params"]))

    @torch.no_grad()
    def step(self, closure=None):
        if not self.multi_tensor_ready():
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            buckets = {}  # (device, step) -> params: one fused call needs one device and one step count
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state.get(p) or self._init_state(p, group)
                st["step"] += 1
                buckets.setdefault((local_tensor(p).device, int(st["step"])), []).append(p)
            for (_, step), params in buckets.items():
                chunk, numel = [], 0
                for p in params:
                    chunk.append(p)
                    numel += p.numel()
                    if numel >= CHUNK_NUMEL:
                        self._update_chunk(chunk, group, step)
                        chunk, numel = [], 0
                if chunk:
                    self._update_chunk(chunk, group, step)
        return loss

    def _update_chunk(self, params, group, step):
        """One fused AdamW call over `params` (states fp32, on their device), then masters back to params."""
        beta1, beta2 = group["betas"]
        locals_ = [local_tensor(p) for p in params]
        states = [self._host(self.state[p]) for p in params]
        masters = [self.master.gather(local, st) for local, st in zip(locals_, states)]
        grads = [local_tensor(p.grad).float() for p in params]  # no copy when already fp32
        fused_adamw_(masters, grads, [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states], step,
                     float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"])
        for p, local, st, w32 in zip(params, locals_, states, masters):
            self.master.scatter(w32, local, st, (self._param_index(p), step))


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
