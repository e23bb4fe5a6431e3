"""A fast single-device training step: bf16 weights + fp32 master, fused AdamW, per-block compile.

Three precisions, all optimizing the same fp32 values:
  "fp32":          fp32 weights, fp32 math (TF32 matmuls when the caller enables them): the published DiT recipe.
  "autocast_bf16": fp32 weights; matmuls run in bf16 under torch.autocast, which re-casts every weight to
                   bf16 in every forward, and keeps norms and the residual stream in fp32.
  "bf16_master":   the model's parameters ARE bf16 (what forward and backward read, no per-step casts,
                   bf16 activations end to end, as FSDP2's param_dtype=bf16 does); the optimizer is train.py's
                   `--master_weights fp32_copy`: opendit's AdamW keeps an fp32 master of each parameter,
                   updates all of them with torch's fused multi-tensor AdamW kernel and writes the rounded
                   values back. Inputs are cast to bf16 and outputs to fp32 by the ddp plugin's hooks.
Compile: None, "model" (torch.compile the whole model) or "blocks" (each repeated block separately, as
train.py's --compile does; blocks share one graph, and the Triton kernels are custom ops inside it, so a
block with kernels on stays one graph). "bf16_master" + "blocks" + the kernel flags is what
`train.py --plugin ddp --mixed_precision bf16 --master_weights fp32_copy --compile --enable_*` runs.
"""
import torch
import torch.nn as nn

from opendit.booster.parallelize import apply_compile
from opendit.booster.precision import cast_forward_io
from opendit.kernels import probe_optional_imports
from opendit.optim import build_optimizer
from opendit.training.optimizer import cast_for_master_weights

PRECISIONS = ("fp32", "autocast_bf16", "bf16_master")
COMPILE_TARGETS = (None, "model", "blocks")


def compile_model(model: nn.Module, target: str | None, backend: str = "inductor", mode: str | None = None):
    """Compile in place (state_dict keys unchanged): the whole model, or each block as train.py's --compile."""
    if target not in COMPILE_TARGETS:
        raise ValueError(f"compile target {target!r} is unknown; choose one of {COMPILE_TARGETS}")
    if target == "model":
        probe_optional_imports()  # else the first compiled call fills the probe cache and recompiles
        model.compile(backend=backend, mode=mode)
    elif target == "blocks":
        apply_compile(model, backend, mode)


class TrainStep:
    """loss -> backward -> (clip) -> optimizer step, for one batch on one device.

    objective: its losses(model, x, cond) give the per-sample losses whose mean is minimised, e.g.
    opendit.diffusion.objective.DiffusionObjective() (cond: the model's keyword inputs, {"y": labels} for DiT).
    The model is converted in place (dtype, input/output casts, compile).
    Call: step(x, cond) -> the detached loss (no host sync).
    """

    def __init__(self, model: nn.Module, objective, precision: str = "bf16_master", lr: float = 1e-4,
                 weight_decay: float = 0.0, fused_adamw: bool = True, compile: str | None = None,
                 compile_backend: str = "inductor", compile_mode: str | None = None, grad_clip: float = 0.0):
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} is unknown; choose one of {PRECISIONS}")
        self.model, self.objective, self.precision, self.grad_clip = model, objective, precision, grad_clip
        self.device_type = next(model.parameters()).device.type
        params = [p for p in model.parameters() if p.requires_grad]
        if precision == "bf16_master":
            cast_for_master_weights(model, "fp32_copy")
            cast_forward_io(model, torch.bfloat16)
            self.optimizer = build_optimizer(params, "adamw", master_weights="fp32_copy", lr=lr,
                                             weight_decay=weight_decay)
            self.optimizer.multi_tensor = fused_adamw
        else:
            # fused=None lets torch pick its default (foreach on CUDA): the published recipe's optimizer
            self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay,
                                               fused=True if fused_adamw else None)
        compile_model(model, compile, compile_backend, compile_mode)
        self.cuda_graphs = compile is not None and compile_mode is not None and "reduce-overhead" in compile_mode

    def __call__(self, x, cond: dict) -> torch.Tensor:
        if self.cuda_graphs:  # a new iteration: graph outputs of the last one may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.precision == "autocast_bf16"):
            loss = self.objective.losses(self.model, x, cond)[0].mean()
        loss.backward()
        if self.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip, foreach=True)
        self.optimizer.step()
        return loss.detach()
