"""Fused backward pass: each parameter is updated inside its post-accumulate-grad hook and its gradient
is freed at once, so a full set of gradients never exists (peak: the gradients of one block in flight).

Consequences the caller must accept:
- Gradient accumulation is impossible (the update fires on every backward): grad_accum_steps > 1 errors.
- Global gradient-norm clipping needs every gradient before the first update, i.e. a second backward
  pass (one to measure the norm, one to update); instead each tensor may be clipped to its own norm
  with the optimizer's `per_tensor_clip` option.
- optimizer.step() becomes a no-op (the loop may still call it; lr schedulers keep working, since hooks
  read group["lr"] when they fire) and zero_grad() finds no gradients.

States are prefetched one parameter ahead in the order the hooks fired during the previous backward.
"""
import torch

from .base import LeanOptimizer


class FusedBackward:
    def __init__(self, optimizer: LeanOptimizer):
        self.optimizer = optimizer
        self.order = []  # parameter ids in hook order during the last backward
        self._position = {}
        self._current, self._seen = [], set()
        self._group = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self._params = {id(p): p for g in optimizer.param_groups for p in g["params"]}
        self.handles = [p.register_post_accumulate_grad_hook(self._hook)
                        for g in optimizer.param_groups for p in g["params"] if p.requires_grad]

    def _hook(self, p):
        key = id(p)
        if key in self._seen:  # each hook fires once per backward: a repeat means a new backward began
            self._finish_backward()
        self._current.append(key)
        self._seen.add(key)
        nxt = self._position.get(key)
        if nxt is not None and nxt + 1 < len(self.order):
            self.optimizer.prefetch(self._params[self.order[nxt + 1]])
        self.optimizer.update_param(p, self._group[key])
        p.grad = None  # free the gradient now: this is the memory the fused pass saves

    def _finish_backward(self):
        self.order, self._current, self._seen = self._current, [], set()
        self._position = {k: i for i, k in enumerate(self.order)}

    def remove(self):
        for h in self.handles:
            h.remove()
        self.optimizer.fused_backward = False


def attach_fused_backward(optimizer, grad_accum_steps: int = 1) -> FusedBackward:
    """Switch `optimizer` (a LeanOptimizer) to updating in post-accumulate-grad hooks."""
    if not isinstance(optimizer, LeanOptimizer):
        raise ValueError(f"fused_backward needs one of opendit's optimizers (adamw, nadamw, adan), got "
                         f"{type(optimizer).__name__}; build it with build_optimizer(name='adamw', ...)")
    if grad_accum_steps != 1:
        raise ValueError(f"fused_backward updates parameters during every backward pass, so gradient "
                         f"accumulation cannot work (grad_accum_steps={grad_accum_steps}); use "
                         "grad_accum_steps=1 or turn fused_backward off")
    if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
        raise RuntimeError("fused_backward needs torch >= 2.1 (Tensor.register_post_accumulate_grad_hook)")
    optimizer.fused_backward = True
    fused = FusedBackward(optimizer)
    optimizer._fused = fused
    return fused
