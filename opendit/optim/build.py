"""build_optimizer: one entry point for opendit's memory-lean optimizers and torch's own."""
import torch

from .adam import AdamW, NAdamW
from .adan import Adan
from .fused_backward import attach_fused_backward

LEAN = {"adamw": AdamW, "nadamw": NAdamW, "adan": Adan}
TORCH = ("torch_adamw", "adafactor")
OPTIMIZERS = tuple(LEAN) + TORCH
OPTIMIZER_NAMES = ("adamw", "nadamw", "adan", "adafactor")  # train.py's --optimizer (adamw: torch's or opendit's)


def build_optimizer(params, name: str = "adamw", lr: float = 1e-4, betas=None, eps=None,
                    weight_decay: float = 0.0, *, state_device: str = "gpu", state_dtype: str = "fp32",
                    master_weights: str = "fp32", fused_backward: bool = False, grad_accum_steps: int = 1,
                    per_tensor_clip=None, u16_block: int = 256, u16_power: float = 3.0,
                    small_numel: int = 4096, momentum_decay: float = 4e-3, no_prox: bool = False,
                    seed: int = 0):
    """An optimizer over `params` (tensors or param-group dicts).

    name: adamw | nadamw | adan (opendit's, with every option below) or torch_adamw | adafactor (torch's,
    default options only). betas/eps default per optimizer: (0.9, 0.999)/1e-8; Adan (0.98, 0.92, 0.99)/1e-8.
    state_device: gpu | cpu (offloaded, pinned, prefetched on a side stream).
    state_dtype: fp32 | bf16 | u16 | f24 (tensors of <= small_numel elements stay fp32).
    master_weights: fp32 | bf16_exact | bf16_stochastic | fp32_copy (all but fp32 need bf16 parameters).
    fused_backward: update in each parameter's post-accumulate-grad hook (needs grad_accum_steps == 1).
    per_tensor_clip: clip each gradient tensor to this norm before its update (None: off).
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")
    if name in TORCH:
        return _torch_optimizer(params, name, lr, betas, eps, weight_decay, state_device, state_dtype,
                                master_weights, fused_backward, per_tensor_clip)
    if betas is None:
        betas = (0.98, 0.92, 0.99) if name == "adan" else (0.9, 0.999)
    extra = {"momentum_decay": momentum_decay} if name == "nadamw" else {}
    if name == "adan":
        extra = {"no_prox": no_prox}
    opt = LEAN[name](params, lr=lr, betas=betas, eps=1e-8 if eps is None else eps, weight_decay=weight_decay,
                     state_device=state_device, state_dtype=state_dtype, master_weights=master_weights,
                     u16_block=u16_block, u16_power=u16_power, small_numel=small_numel,
                     per_tensor_clip=per_tensor_clip, seed=seed, **extra)
    if fused_backward:
        attach_fused_backward(opt, grad_accum_steps)
    return opt


def _torch_optimizer(params, name, lr, betas, eps, weight_decay, state_device, state_dtype, master_weights,
                     fused_backward, per_tensor_clip):
    asked = {"state_device": (state_device, "gpu"), "state_dtype": (state_dtype, "fp32"),
             "master_weights": (master_weights, "fp32"), "fused_backward": (fused_backward, False),
             "per_tensor_clip": (per_tensor_clip, None)}
    for option, (value, plain) in asked.items():
        if value != plain:
            raise ValueError(f"{option}={value!r} is an opendit optimizer option; torch's {name} supports only "
                             f"{option}={plain!r} (use name='adamw', 'nadamw' or 'adan')")
    if name == "torch_adamw":
        params = list(params)
        on_cuda = all(t.is_cuda for t in _tensors(params))
        return torch.optim.AdamW(params, lr=lr, betas=betas or (0.9, 0.999), eps=eps or 1e-8,
                                 weight_decay=weight_decay, fused=True if on_cuda else None)
    if not hasattr(torch.optim, "Adafactor"):
        raise RuntimeError("name='adafactor' needs torch >= 2.5 (torch.optim.Adafactor)")
    if betas is not None:
        raise ValueError(f"adafactor has no betas (its second-moment decay is t^-0.8), got betas={betas}; "
                         "leave betas unset")
    return torch.optim.Adafactor(params, lr=lr, eps=(None, 1e-3) if eps is None else (None, eps),
                                 weight_decay=weight_decay)


def _tensors(params):
    for p in params:
        if isinstance(p, dict):
            yield from p["params"]
        else:
            yield p
