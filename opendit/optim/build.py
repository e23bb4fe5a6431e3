"""build_optimizer: one entry point for opendit's memory-lean optimizers and torch's own, shaped by one typed
OptimizerSettings."""
import dataclasses
from dataclasses import dataclass

import torch

from .adam import AdamW, NAdamW
from .adan import Adan
from .fused_backward import attach_fused_backward

LEAN = {"adamw": AdamW, "nadamw": NAdamW, "adan": Adan}
TORCH = ("torch_adamw", "adafactor")
OPTIMIZERS = tuple(LEAN) + TORCH
OPTIMIZER_NAMES = ("adamw", "nadamw", "adan", "adafactor")  # train.py's --optimizer (adamw: torch's or opendit's)


@dataclass(frozen=True)
class OptimizerSettings:
    """Everything that shapes an optimizer, typed. name: adamw | nadamw | adan (opendit's, with every option
    below) or torch_adamw | adafactor (torch's, default options only). betas / eps: None takes each optimizer's
    (0.9, 0.999) / 1e-8; Adan (0.98, 0.92, 0.99) / 1e-8. state_device: gpu | cpu (offloaded, streamed per
    parameter). state_dtype: fp32 | bf16 | u16 | f24 (tensors of <= small_numel elements stay fp32; u16_block and
    u16_power shape the u16 format). master_weights: fp32 | bf16_exact | bf16_stochastic | fp32_copy (all but
    fp32 need bf16 parameters; seed drives the stochastic rounding). fused_backward: update in each parameter's
    post-accumulate-grad hook (needs grad_accum_steps == 1). per_tensor_clip: clip each gradient tensor to this
    norm before its update (None: off). momentum_decay: NAdamW's; no_prox: Adan's. fused_kernel: torch AdamW's
    single-kernel step (None: when every parameter is on CUDA)."""
    name: str = "adamw"
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, ...] | None = None
    eps: float | None = None
    state_device: str = "gpu"
    state_dtype: str = "fp32"
    master_weights: str = "fp32"
    fused_backward: bool = False
    grad_accum_steps: int = 1
    per_tensor_clip: float | None = None
    u16_block: int = 256
    u16_power: float = 3.0
    small_numel: int = 4096
    momentum_decay: float = 4e-3
    no_prox: bool = False
    seed: int = 0
    fused_kernel: bool | None = None

    @property
    def lean(self) -> bool:
        """Whether it takes opendit's optimizer (torch's AdamW has none of these options)."""
        return self.name in ("nadamw", "adan") or self.state_device != "gpu" or self.state_dtype != "fp32" or \
            self.master_weights != "fp32" or self.fused_backward


def build_optimizer(params, settings: OptimizerSettings | str = "adamw", *, hooks: bool = True, **changes):
    """An optimizer over `params` (tensors or param-group dicts) as `settings` says (or an optimizer's name),
    with `changes` to any of its fields (build_optimizer(params, "adan", lr=1e-3)). hooks=False leaves the
    fused-backward hooks to the caller (training attaches them to the boosted parameters)."""
    s = OptimizerSettings(name=settings) if isinstance(settings, str) else settings
    s = dataclasses.replace(s, **changes)
    if s.name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {s.name!r}; choose one of {OPTIMIZERS}")
    if s.name in TORCH:
        return _torch_optimizer(params, s)
    betas = s.betas or ((0.98, 0.92, 0.99) if s.name == "adan" else (0.9, 0.999))
    extra = {"momentum_decay": s.momentum_decay} if s.name == "nadamw" else {}
    if s.name == "adan":
        extra = {"no_prox": s.no_prox}
    opt = LEAN[s.name](params, lr=s.lr, betas=betas, eps=1e-8 if s.eps is None else s.eps,
                       weight_decay=s.weight_decay, state_device=s.state_device, state_dtype=s.state_dtype,
                       master_weights=s.master_weights, u16_block=s.u16_block, u16_power=s.u16_power,
                       small_numel=s.small_numel, per_tensor_clip=s.per_tensor_clip, seed=s.seed, **extra)
    if s.fused_backward and hooks:
        attach_fused_backward(opt, s.grad_accum_steps)
    return opt


def _torch_optimizer(params, s: OptimizerSettings):
    plain = OptimizerSettings(s.name)
    for option in ("state_device", "state_dtype", "master_weights", "fused_backward", "per_tensor_clip"):
        if getattr(s, option) != getattr(plain, option):
            raise ValueError(f"{option}={getattr(s, option)!r} is an opendit optimizer option; torch's {s.name} "
                             f"supports only {option}={getattr(plain, option)!r} (use name='adamw', 'nadamw' or "
                             f"'adan')")
    if s.name == "torch_adamw":
        params = list(params)
        fused = all(t.is_cuda for t in _tensors(params)) if s.fused_kernel is None else s.fused_kernel
        return torch.optim.AdamW(params, lr=s.lr, betas=s.betas or (0.9, 0.999), eps=s.eps or 1e-8,
                                 weight_decay=s.weight_decay, fused=True if fused else None)
    if not hasattr(torch.optim, "Adafactor"):
        raise RuntimeError("name='adafactor' needs torch >= 2.5 (torch.optim.Adafactor)")
    if s.betas is not None:
        raise ValueError(f"adafactor has no betas (its second-moment decay is t^-0.8), got betas={s.betas}; "
                         "leave betas unset")
    return torch.optim.Adafactor(params, lr=s.lr, eps=(None, 1e-3) if s.eps is None else (None, s.eps),
                                 weight_decay=s.weight_decay)


def _tensors(params):
    for p in params:
        if isinstance(p, dict):
            yield from p["params"]
        else:
            yield p
