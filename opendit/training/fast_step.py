"""A fast single-device DiT training step: bf16 weights + fp32 master, fused AdamW, per-block compile.

Three precisions, all optimizing the same fp32 values:
  "fp32":          fp32 weights, fp32 math (TF32 matmuls when the caller enables them): the published DiT recipe.
  "autocast_bf16": fp32 weights; matmuls run in bf16 under torch.autocast, which re-casts every weight to
                   bf16 in every forward, and keeps norms and the residual stream in fp32.
  "bf16_master":   the model's parameters ARE bf16 (what forward and backward read, no per-step casts,
                   bf16 activations end to end, as FSDP2's param_dtype=bf16 does); BF16MasterAdamW keeps
                   an fp32 master of each, updates it with fused AdamW and writes the rounded value back.
Compile: None, "model" (torch.compile the whole model) or "blocks" (each repeated block and the final
layer separately; blocks share one graph, and the Triton kernels are custom ops inside it, so a block
with kernels on stays one graph).
"""
import torch
import torch.nn as nn

from opendit.booster.parallelize import iter_blocks
from opendit.kernels import probe_optional_imports

PRECISIONS = ("fp32", "autocast_bf16", "bf16_master")
COMPILE_TARGETS = (None, "model", "blocks")


class BF16MasterAdamW:
    """AdamW on fp32 master copies of bf16 parameters.

    Per step: fp32 grads = bf16 grads (transient: freed right after the update, when activations are
    already gone, so they do not raise the step's peak memory), optional global-norm clipping on them,
    torch AdamW (fused=True by default: one multi-tensor kernel) on the masters, then params <- masters
    rounded to nearest bf16. Memory: 2 (param) + 2 (grad) + 4 (master) + 8 (moments) bytes per parameter.
    `optimizer` is the inner torch AdamW, for LR schedulers.
    """

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, fused: bool = True):
        self.params = [p for p in params if p.requires_grad]
        for p in self.params:
            if p.dtype != torch.bfloat16:
                raise ValueError(f"BF16MasterAdamW got a {p.dtype} parameter of shape {tuple(p.shape)}; cast the "
                                 f"model with model.to(torch.bfloat16) first")
        self.master = [p.detach().float() for p in self.params]  # fresh fp32 copies [same shapes]
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                           fused=fused)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self, grad_clip: float = 0.0):
        """Update the masters from the params' grads; returns the grad norm when clipping, else None."""
        for m, p in zip(self.master, self.params):
            m.grad = None if p.grad is None else p.grad.float()
        norm = None
        if grad_clip > 0:
            norm = nn.utils.clip_grad_norm_(self.master, grad_clip, foreach=True)
        self.optimizer.step()
        for m in self.master:
            m.grad = None
        torch._foreach_copy_(self.params, self.master)  # fp32 -> bf16, round to nearest even
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "master": [m.detach().clone() for m in self.master]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if len(state["master"]) != len(self.master):
            raise ValueError(f"state has {len(state['master'])} master tensors, this optimizer {len(self.master)}; "
                             f"it was saved for another model")
        torch._foreach_copy_(self.master, state["master"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch._foreach_copy_(self.params, self.master)


def compile_model(model: nn.Module, target: str | None, backend: str = "inductor", mode: str | None = None):
    """Compile in place (state_dict keys unchanged): the whole model, or each block and the final layer."""
    if target not in COMPILE_TARGETS:
        raise ValueError(f"compile target {target!r} is unknown; choose one of {COMPILE_TARGETS}")
    if target is not None:
        probe_optional_imports()  # else the first compiled call fills the probe cache and recompiles
    if target == "model":
        model.compile(backend=backend, mode=mode)
    elif target == "blocks":
        for block in iter_blocks(model):
            block.compile(backend=backend, mode=mode)
        final = getattr(model, "final_layer", None)
        if final is not None:
            final.compile(backend=backend, mode=mode)


class TrainStep:
    """loss -> backward -> (clip) -> optimizer step, for one batch on one device.

    loss_fn(model_fn, x, y) -> scalar loss, e.g. DiffusionObjective().loss; model_fn takes the objective's
    fp32 inputs (in "bf16_master" they are cast to bf16 on the way in). The model is converted in place
    (dtype, compile). Call: step(x, y) -> the detached loss (no host sync).
    """

    def __init__(self, model: nn.Module, loss_fn, precision: str = "bf16_master", lr: float = 1e-4,
                 weight_decay: float = 0.0, fused_adamw: bool = True, compile: str | None = None,
                 compile_backend: str = "inductor", compile_mode: str | None = None, grad_clip: float = 0.0):
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} is unknown; choose one of {PRECISIONS}")
        self.model, self.loss_fn, self.precision, self.grad_clip = model, loss_fn, precision, grad_clip
        self.device_type = next(model.parameters()).device.type
        params = [p for p in model.parameters() if p.requires_grad]
        if precision == "bf16_master":
            model.to(torch.bfloat16)
            self.optimizer = BF16MasterAdamW(params, lr=lr, weight_decay=weight_decay, fused=fused_adamw)
        else:
            # fused=None lets torch pick its default (foreach on CUDA): the published recipe's optimizer
            self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay,
                                               fused=True if fused_adamw else None)
        compile_model(model, compile, compile_backend, compile_mode)

    def model_fn(self, x_t, t, y):
        if self.precision == "bf16_master":
            x_t = x_t.to(torch.bfloat16)
        return self.model(x_t, t, y)

    def __call__(self, x, y) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.precision == "autocast_bf16"):
            loss = self.loss_fn(self.model_fn, x, y)
        loss.backward()
        if isinstance(self.optimizer, BF16MasterAdamW):
            self.optimizer.step(self.grad_clip)
        else:
            if self.grad_clip > 0:
                nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip, foreach=True)
            self.optimizer.step()
        return loss.detach()
