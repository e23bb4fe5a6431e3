"""Low-rank adapters (LoRA) on a model's nn.Linear layers, in place.

`add_lora(model, rank, alpha, targets)` turns each Linear whose module name fully matches the regex `targets`
into a LoRALinear: the same module with its `weight` and `bias` (same keys, frozen) plus adapters
`lora_A.i` [r, in] and `lora_B.i` [out, r] and a scale s_i per adapter:

    y = x W^T + b + sum_i s_i (drop(x) A_i^T) B_i^T        s_i = alpha_i / r_i

Adapter 0 is the one a run trains (A Kaiming-uniform as PEFT initialises it, B zero, so training starts at the
base model); sampling may attach more (`attach_adapters`, each with its own scale) without merging, and
`merge_adapters` folds them into the weights. Every other parameter of the model is frozen, so the optimizer,
the EMA and the checkpoint hold the adapters only.

An adapter set in memory is {module name: Adapter(A, B, alpha)} with the official module names of the model
(opendit.lora.formats writes and reads it in the diffusers/PEFT and kohya/ComfyUI layouts).
"""
import math
import re
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from opendit.distributed import unwrap_model
from opendit.ema import clean_fqn


class Adapter(NamedTuple):
    """One module's adapter: A [r, in], B [out, r] and alpha (its scale is alpha / r)."""
    A: torch.Tensor
    B: torch.Tensor
    alpha: float

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def delta(self) -> torch.Tensor:
        """The weight change it makes, scale * B @ A [out, in], in fp32."""
        return (self.B.float() @ self.A.float()).mul_(self.scale)  # in place: one full-size fp32 tensor


FP8 = torch.float8_e4m3fn


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (float8_e4m3fn [out, in], fp32 scale [out]): each row scaled so its largest magnitude
    is e4m3's largest (448); a row of zeros gets scale 1."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / torch.finfo(FP8).max, torch.ones_like(amax))
    return (w / scale[:, None]).to(FP8), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T + b with W stored in fp8 (frozen): the weight is upcast for the matmul and again for the input
    gradient, so autograd keeps the fp8 weight for backward, never an upcast copy."""

    @staticmethod
    def forward(ctx, x, q, scale, bias):
        ctx.save_for_backward(q, scale)
        ctx.x_dtype = x.dtype
        return F.linear(x, dequantize_fp8(q, scale, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        q, scale = ctx.saved_tensors
        return (grad @ dequantize_fp8(q, scale, grad.dtype)).to(ctx.x_dtype), None, None, None


class LoRALinear(nn.Linear):
    """An nn.Linear with adapters (see the module docstring); made from a Linear by `add_lora`, never built.
    Its frozen weight may be stored in fp8 (`quantize_frozen_linears`), with `weight_scale` per output row."""
    lora_A: nn.ParameterList
    lora_B: nn.ParameterList
    lora_scale: list
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == FP8:
            y = _Fp8Linear.apply(x, self.weight, self.weight_scale, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        if len(self.lora_A):
            h = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
            for A, B, s in zip(self.lora_A, self.lora_B, self.lora_scale):
                y = y + F.linear(F.linear(h, A), B) * s
        return y

    def merged_weight(self) -> torch.Tensor:
        """W + sum_i s_i B_i A_i, differentiable in the adapters: for code that takes a Linear's weight rather
        than calling it (the sequence-parallel projections). Dropout does not apply there."""
        w = self.base_weight()
        for A, B, s in zip(self.lora_A, self.lora_B, self.lora_scale):
            w = w + (B @ A).to(w.dtype) * s
        return w

    def base_weight(self) -> torch.Tensor:
        """The frozen weight as the matmul sees it: an fp8 weight upcast to the dtype it was quantized from."""
        if self.weight.dtype == FP8:
            return dequantize_fp8(self.weight, self.weight_scale, self.fp8_from)
        return self.weight

    def extra_repr(self) -> str:
        ranks = [A.shape[0] for A in self.lora_A]
        return f"{super().extra_repr()}, lora ranks={ranks}, scales={self.lora_scale}"


def _attach(linear: nn.Linear, dropout: float = 0.0) -> LoRALinear:
    if not isinstance(linear, LoRALinear):
        linear.__class__ = LoRALinear
        linear.lora_A, linear.lora_B = nn.ParameterList(), nn.ParameterList()
        linear.lora_scale, linear.lora_dropout = [], dropout
    return linear


def _new_pair(linear: nn.Linear, A: torch.Tensor, B: torch.Tensor, scale: float, trainable: bool) -> None:
    linear.lora_A.append(nn.Parameter(A, requires_grad=trainable))
    linear.lora_B.append(nn.Parameter(B, requires_grad=trainable))
    linear.lora_scale.append(float(scale))


def linear_names(model: nn.Module) -> list[str]:
    """Official names of the model's nn.Linear modules (wrapper segments removed), in model order."""
    return [n for n, m in _modules(model).items() if isinstance(m, nn.Linear)]


def match_targets(model: nn.Module, targets: str) -> list[str]:
    """The Linear module names fully matching the regex `targets`; a ValueError naming some Linear names when
    none does (or the regex is invalid)."""
    try:
        pattern = re.compile(targets)
    except re.error as e:
        raise ValueError(f"--lora_targets {targets!r} is not a regular expression ({e})") from None
    names = linear_names(model)
    found = [n for n in names if pattern.fullmatch(n)]
    if not found:
        kinds = list(dict.fromkeys(re.sub(r"\.\d+\.", r".\\d+.", n) for n in names))  # blocks.3.x -> blocks.\d+.x
        raise ValueError(f"--lora_targets {targets!r} matches none of the model's {len(names)} Linear layers (the "
                         f"regex must match a whole module name; the layers: {', '.join(kinds)}); leave it out for "
                         "the model family's default")
    return found


def _modules(model: nn.Module) -> dict[str, nn.Module]:
    return {clean_fqn(n): m for n, m in unwrap_model(model).named_modules()}


def add_lora(model: nn.Module, rank: int, alpha: float | None, targets: str, dropout: float = 0.0) -> list[str]:
    """Freeze every parameter of `model` and give the Linear layers matching `targets` a trainable adapter of
    `rank` (scale alpha / rank; alpha None: rank, scale 1). Uses the global RNG for A. Returns the names."""
    if rank < 1:
        raise ValueError(f"--lora_rank {rank}: must be >= 1 to add adapters (0 trains all weights)")
    names = match_targets(model, targets)
    model.requires_grad_(False)
    modules = _modules(model)
    for name in names:
        linear = _attach(modules[name], dropout)
        if len(linear.lora_A):
            raise ValueError(f"{name} already has adapters; add the trained adapter first")
        A = torch.empty(rank, linear.in_features, device=linear.weight.device)  # meta stays meta (to be loaded)
        nn.init.kaiming_uniform_(A, a=math.sqrt(5))  # PEFT's (and nn.Linear's) initialisation
        B = torch.zeros(linear.out_features, rank, device=linear.weight.device)
        _new_pair(linear, A, B, (alpha if alpha is not None else rank) / rank, trainable=True)
    return names


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """{official name: module} of every Linear with adapters."""
    return {n: m for n, m in _modules(model).items() if isinstance(m, LoRALinear) and len(m.lora_A)}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def trained_adapters(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, Adapter]:
    """The trained adapter (index 0) of every LoRA module as full CPU fp32 tensors. state: {param name:
    tensor} to read A and B from instead of the model (e.g. the EMA's full_state_dict). A collective under
    FSDP (DTensors are gathered): call it on every rank."""
    out = {}
    for name, m in lora_modules(model).items():
        A = state[f"{name}.lora_A.0"] if state is not None else _full(m.lora_A[0])
        B = state[f"{name}.lora_B.0"] if state is not None else _full(m.lora_B[0])
        out[name] = Adapter(A.float().cpu(), B.float().cpu(), m.lora_scale[0] * A.shape[0])
    return out


def load_trained_adapters(model: nn.Module, adapters: dict[str, Adapter], source: str) -> None:
    """Set adapter 0 of each LoRA module from `adapters` (--init_lora): same modules and ranks, or a ValueError
    naming what differs. The run keeps its own scale (--lora_alpha / rank): B is rescaled so that each adapter
    changes the weights exactly as the file's alpha says."""
    modules = lora_modules(model)
    extra = sorted(set(adapters) - set(modules))
    if extra:
        raise ValueError(f"{source} adapts {len(extra)} layers this run does not (e.g. {extra[0]}); widen "
                         f"--lora_targets to include them")
    for name, a in adapters.items():
        m = modules[name]
        if tuple(a.A.shape) != tuple(m.lora_A[0].shape) or tuple(a.B.shape) != tuple(m.lora_B[0].shape):
            raise ValueError(f"{source}: {name} has rank {a.rank} ({list(a.A.shape)}, {list(a.B.shape)}); this run "
                             f"has rank {m.lora_A[0].shape[0]}: pass --lora_rank {a.rank}")
        ratio = a.scale / m.lora_scale[0]
        with torch.no_grad():
            m.lora_A[0].copy_(a.A)
            m.lora_B[0].copy_(a.B if ratio == 1 else a.B.float() * ratio)


def attach_adapters(model: nn.Module, adapters: dict[str, Adapter], strength: float = 1.0,
                    source: str = "adapter") -> int:
    """Add a frozen adapter set to the model, applied at `strength` (its own scale times this), without
    merging. Modules must be Linear layers of the model; returns how many it adapts."""
    modules = _modules(model)
    bad = sorted(n for n in adapters if not isinstance(modules.get(n), nn.Linear))
    if bad:
        raise ValueError(f"{source} adapts {len(bad)} layers that are not Linear layers of this model (e.g. "
                         f"{bad[0]}); is it an adapter for another model?")
    for name, a in adapters.items():
        linear = modules[name]
        if a.A.shape[1] != linear.in_features or a.B.shape[0] != linear.out_features:
            raise ValueError(f"{source}: {name} is {linear.out_features}x{linear.in_features} here, the adapter "
                             f"makes {a.B.shape[0]}x{a.A.shape[1]}; it is for another model size")
        _attach(linear)
        like = linear.weight
        _new_pair(linear, a.A.to(like.device, like.dtype), a.B.to(like.device, like.dtype), a.scale * strength,
                  trainable=False)
    return len(adapters)


@torch.no_grad()
def merge_adapters(model: nn.Module) -> int:
    """Fold every adapter into its Linear's weight (in fp32, then the weight's dtype) and make it a plain Linear
    again: the model's state_dict is then the official layout. Returns the layers merged."""
    merged = 0
    for m in lora_modules(model).values():
        w = m.base_weight().float()
        for A, B, s in zip(m.lora_A, m.lora_B, m.lora_scale):
            w += B.float() @ A.float() * s
        if m.weight.dtype == FP8:  # merged weights are trained ones: back in the dtype they were quantized from
            m.weight = nn.Parameter(w.to(m.fp8_from), requires_grad=False)
            del m.weight_scale, m.fp8_from
        else:
            m.weight.copy_(w.to(m.weight.dtype))
        del m.lora_A, m.lora_B, m.lora_scale, m.lora_dropout
        m.__class__ = nn.Linear
        merged += 1
    return merged


def cast_frozen_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Store the frozen Linear weights and biases (the base model under LoRA) in `dtype`, e.g. bf16: half the
    memory of fp32 for the bulk of the parameters. Returns the tensors cast."""
    count = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            for p in (m.weight, m.bias):
                if p is not None and not p.requires_grad and p.dtype not in (dtype, FP8) and p.is_floating_point():
                    p.data = p.data.to(dtype)
                    count += 1
    return count


@torch.no_grad()
def quantize_frozen_linears(modules) -> int:
    """Store the frozen weight of every Linear among `modules` (e.g. a model's blocks) in fp8 (float8_e4m3fn, a
    scale per output row: 1 byte a weight), upcast layer by layer for its matmul to the dtype it had. A Linear
    without adapters becomes a LoRALinear without any (the same keys and outputs). Returns the layers quantized."""
    count = 0
    for module in modules:
        for m in module.modules():
            if isinstance(m, nn.Linear) and not m.weight.requires_grad and m.weight.dtype != FP8:
                m = _attach(m)
                q, scale = quantize_fp8(m.weight)
                m.fp8_from = m.weight.dtype
                m.weight = nn.Parameter(q, requires_grad=False)
                m.register_buffer("weight_scale", scale, persistent=False)
                count += 1
    return count
