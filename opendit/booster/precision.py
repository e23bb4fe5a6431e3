"""Mixed precision: dtype names, FSDP2 policies, forward casts for bf16 parameters, and dynamic loss scaling
for fp16.

--mixed_precision names the compute dtype; the parameters keep the dtype the model has when it is boosted.
With fp32 parameters (the default, --master_weights fp32) bf16/fp16 only change the compute dtype: FSDP2's
MixedPrecisionPolicy casts the gathered parameters, DDP runs under torch.autocast. The other
--master_weights modes (bf16_exact, bf16_stochastic, fp32_copy) cast the trainable parameters to bf16 before
boosting (opendit/training/optimizer.py) and the optimizer holds what bf16 lacks: an int16 residual, an fp32
copy, or nothing with stochastic rounding (docs/memory_lean.md). DDP then casts the model's inputs and
outputs (`cast_forward_io`) instead of using autocast.

fp16's 5 exponent bits underflow small gradients, so the loss is multiplied by a scale before backward and
the gradients divided by it before the step; a step whose gradients hold inf/nan (on any rank) is skipped and
the scale halved.
"""
import logging

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._pytree import tree_map

from opendit.distributed import local_tensor

logger = logging.getLogger("opendit")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = tuple(DTYPES)  # the valid --mixed_precision names


def compute_dtype(mixed_precision: str) -> torch.dtype:
    if mixed_precision not in DTYPES:
        raise ValueError(f"unknown mixed precision {mixed_precision!r}; valid: {', '.join(PRECISIONS)}")
    return DTYPES[mixed_precision]


def fsdp_policy(mixed_precision: str, reduce_dtype: str = "fp32", root: bool = False) -> MixedPrecisionPolicy:
    """Params cast to the compute dtype for forward/backward; gradients reduced (and accumulated across
    no-sync micro-steps) in reduce_dtype. The root returns fp32 outputs so the loss is computed in fp32."""
    if mixed_precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype(mixed_precision), reduce_dtype=compute_dtype(reduce_dtype),
                                output_dtype=torch.float32 if root else None)


def params_in_dtype(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """True when every trainable parameter already is `dtype` (a bf16 --master_weights mode cast them)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return bool(params) and all(p.dtype == dtype for p in params)


def cast_forward_io(model: torch.nn.Module, dtype: torch.dtype):
    """For a model whose parameters are `dtype`: cast floating-point forward inputs to it and floating outputs
    to fp32, as FSDP2's MixedPrecisionPolicy does at the root. Autocast is then not needed (and would only
    re-run norms in fp32). Integer inputs (timesteps, labels) pass unchanged. Returns the hook handles."""
    def cast(to):
        return lambda t: t.to(to) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def cast_inputs(_, args, kwargs):
        return tree_map(cast(dtype), args), tree_map(cast(dtype), kwargs)

    def cast_outputs(_, args, out):
        return tree_map(cast(torch.float32), out)

    return (model.register_forward_pre_hook(cast_inputs, with_kwargs=True),
            model.register_forward_hook(cast_outputs))


class DynamicLossScaler:
    """GradScaler's policy, over plain or DTensor gradients and any set of ranks.

    scale: the loss multiplier; halved (backoff) on an overflow step, doubled after growth_interval clean
    steps. `unscale_` divides gradients once per step and records whether any rank saw inf/nan.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0, device: torch.device | None = None):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.device = device or torch.device("cpu")  # where the overflow flag is all-reduced (NCCL needs CUDA)
        self.clean_steps = 0
        self.skipped_steps = 0
        self._found_inf: bool | None = None  # None: gradients of this step not yet unscaled

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, params) -> bool:
        """Divide this step's gradients by the scale (once per step: later calls only return the verdict);
        return True if any rank's gradients overflowed."""
        if self._found_inf is not None:
            return self._found_inf
        grads = {}
        for p in params:
            if p.grad is not None:
                g = local_tensor(p.grad)
                grads.setdefault((g.device, g.dtype), []).append(g)
        found = torch.zeros(1, device=self.device)
        for (device, _), tensors in grads.items():
            flag = torch.zeros(1, device=device)
            inv = torch.full((1,), 1.0 / self.scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv)
            found += flag.to(self.device)
        if dist.is_initialized():  # shards differ per rank: every rank must take the same decision
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        self._found_inf = bool(found.item() > 0)
        return self._found_inf

    def forget_step(self) -> None:
        """The step's gradients were dropped without a step: the next unscale_ starts afresh."""
        self._found_inf = None

    def update(self) -> bool:
        """After the step: adjust the scale. Returns whether the step should have been taken."""
        found_inf = bool(self._found_inf)
        self._found_inf = None
        if found_inf:
            self.skipped_steps += 1
            self.clean_steps = 0
            old = self.scale
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            logger.warning("fp16 gradient overflow: skipped the step (%d skipped so far); loss scale %g -> %g",
                           self.skipped_steps, old, self.scale)
            return False
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def set_tf32(device: torch.device, enabled: bool = True) -> None:
    """TF32 matmuls and convolutions in fp32 compute on NVIDIA GPUs (what the published DiT recipe and its
    reference sampler run); a no-op elsewhere."""
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled
