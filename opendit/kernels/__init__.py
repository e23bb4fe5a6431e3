"""Fused kernels behind switches.

Each public function has a PyTorch twin with the same signature in `opendit.kernels.reference`.
The Triton kernel runs when `use_kernel` is True AND triton imports AND (x is on CUDA OR
TRITON_INTERPRET=1, the CPU interpreter used by the tests) AND the dtypes are fp16 / bf16 / fp32;
otherwise the reference runs (logged once per function). `kernel_status()` says which path runs.
`layer_norm` prefers apex's FusedLayerNorm when apex imports and x is on CUDA.
The Triton forward and backward passes are torch.library custom ops ("opendit::norm_fwd", ...,
with fake impls and registered autograd), so torch.compile keeps a block that calls them in one
graph (tests/test_kernels_compile.py) instead of breaking the graph at every kernel.

Shapes: x [B, N, C] (or [B, *, C]: every token of sample b uses row b); shift / scale / gate
[B, C] (or [B, 1, C]); weight / bias [C]; RoPE: x [B, H, N, D], freqs [N, D/2] or [B, N, D/2].
"""
import logging
import os

import torch

from opendit.kernels import reference

logger = logging.getLogger(__name__)

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_FUSED_COLS = 16384  # a norm kernel keeps one row in registers; wider rows use the reference


# Optional imports, probed once. A dict rather than functools.lru_cache: torch.compile traces
# these lookups and warns on lru_cache wrappers.
_probed = {}


def _triton_version():
    """Triton's version string, or None with the reason logged (it is an optional dependency)."""
    if "triton" not in _probed:
        try:
            import triton
            _probed["triton"] = triton.__version__
        except Exception as e:  # ImportError, or a broken install raising something else
            logger.info("triton not importable (%s): kernels fall back to PyTorch", e)
            _probed["triton"] = None
    return _probed["triton"]


def _apex_layer_norm():
    """(fused_layer_norm, fused_layer_norm_affine) from apex, or None when apex is absent."""
    if "apex" not in _probed:
        try:
            from apex.normalization.fused_layer_norm import fused_layer_norm, fused_layer_norm_affine
            _probed["apex"] = (fused_layer_norm, fused_layer_norm_affine)
        except Exception:
            _probed["apex"] = None
    return _probed["apex"]


def probe_optional_imports() -> None:
    """Probe triton, apex and flash-attn now. torch.compile guards on the probe cache, so a first probe
    inside a compiled block would make it recompile once the cache fills: call this before compiling."""
    _triton_version()
    _apex_layer_norm()
    from opendit.kernels.attention import _flash_fn
    _flash_fn()


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _why_not_kernel(x, *others):
    """None when the Triton kernel can run on these tensors, else the reason it cannot."""
    if _triton_version() is None:
        return "triton is not importable"
    if not (x.is_cuda or _interpret()):
        return f"x is on {x.device.type} and TRITON_INTERPRET is not 1"
    for t in (x, *others):
        if t is not None and t.dtype not in _KERNEL_DTYPES:
            return f"dtype {t.dtype} is not fp16/bf16/fp32"
        if t is not None and t.device != x.device:
            return "tensors are on different devices"
    if x.numel() == 0:
        return "x is empty"
    if x.shape[-1] > _MAX_FUSED_COLS:
        return f"last dim {x.shape[-1]} > {_MAX_FUSED_COLS}"
    return None


_warned = set()


def _use_kernel(name, use_kernel, x, *others) -> bool:
    if not use_kernel:
        return False
    why = _why_not_kernel(x, *others)
    if why is not None and name not in _warned:
        _warned.add(name)
        logger.warning("%s: use_kernel=True but %s; running the PyTorch reference", name, why)
    return why is None


def kernel_status(use_kernel: bool = True, device="cuda") -> str:
    """One line naming the path the kernels take for tensors on `device`; also logged at INFO."""
    device = torch.device(device)
    if not use_kernel:
        msg = "kernels: PyTorch reference (use_kernel=False)"
    elif _triton_version() is None:
        msg = "kernels: PyTorch reference (triton is not importable)"
    elif device.type == "cuda":
        msg = f"kernels: triton {_triton_version()} on CUDA"
    elif _interpret():
        msg = f"kernels: triton {_triton_version()} in the CPU interpreter (TRITON_INTERPRET=1, slow)"
    else:
        msg = f"kernels: PyTorch reference (device {device.type}, TRITON_INTERPRET is not 1)"
    if use_kernel:
        apex = _apex_layer_norm() is not None and device.type == "cuda"
        msg += "; layer_norm: " + ("apex FusedLayerNorm" if apex else "same as above")
    logger.info(msg)
    return msg


def _modulation_rows(name, v, x):
    """Accept [B, C] or [B, 1, C] for a per-sample vector of x [B, ..., C] (returned as [B, C]), or x's own shape
    for a per-token one (returned as it is)."""
    if x.dim() < 2:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [B, N, C]")
    B, C = x.shape[0], x.shape[-1]
    if v.shape == x.shape and x.dim() > 2:
        return v
    if v.dim() == 3 and v.shape[1] == 1:
        v = v.squeeze(1)
    if tuple(v.shape) != (B, C):
        raise ValueError(f"{name} has shape {tuple(v.shape)}; expected [B, C] = [{B}, {C}] (one row per sample of "
                         f"x {tuple(x.shape)}) or x's shape (one per token)")
    return v


def layernorm_modulate(x, shift, scale, weight=None, bias=None, eps=1e-6, use_kernel=False):
    """adaLN: LN(x) * (1 + scale) + shift; x [B, N, C], shift / scale [B, C] (per sample; the fused kernel) or
    [B, N, C] (per token: the PyTorch path)."""
    shift, scale = _modulation_rows("shift", shift, x), _modulation_rows("scale", scale, x)
    per_sample = shift.dim() == 2 and scale.dim() == 2
    if per_sample and _use_kernel("layernorm_modulate", use_kernel, x, shift, scale, weight, bias):
        from opendit.kernels import triton_norm
        return triton_norm.norm(x, weight, bias, shift, scale, eps)
    return reference.layernorm_modulate(x, shift, scale, weight, bias, eps)


def gated_residual(x, gate, y, use_kernel=False):
    """x + gate * y; x, y [B, N, C], gate [B, C] (per sample; the fused kernel) or [B, N, C] (per token: the
    PyTorch path)."""
    gate = _modulation_rows("gate", gate, x)
    if x.shape != y.shape:
        raise ValueError(f"gated_residual: x {tuple(x.shape)} and y {tuple(y.shape)} must have the same shape")
    if gate.dim() == 2 and _use_kernel("gated_residual", use_kernel, x, gate, y):
        from opendit.kernels import triton_pointwise
        return triton_pointwise.gated_residual(x, gate, y)
    return reference.gated_residual(x, gate, y)


def layer_norm(x, weight=None, bias=None, eps=1e-6, use_kernel=False):
    """LayerNorm over the last dim (the --enable_layernorm_kernel switch); apex first when present."""
    if use_kernel and x.is_cuda and _apex_layer_norm() is not None:
        plain, affine = _apex_layer_norm()
        if weight is None and bias is None:
            return plain(x, x.shape[-1:], eps)
        if weight is not None and bias is not None and weight.dtype == x.dtype == bias.dtype:
            return affine(x, weight, bias, x.shape[-1:], eps)
    if _use_kernel("layer_norm", use_kernel, x, weight, bias):
        from opendit.kernels import triton_norm
        return triton_norm.norm(x, weight, bias, eps=eps)
    return reference.layer_norm(x, weight, bias, eps)


def rms_norm(x, weight=None, eps=1e-6, use_kernel=False):
    """RMSNorm over the last dim (FLUX q/k norm), fp32 math, returned in x's dtype."""
    if _use_kernel("rms_norm", use_kernel, x, weight):
        from opendit.kernels import triton_norm
        return triton_norm.norm(x, weight, eps=eps, rms=True)
    return reference.rms_norm(x, weight, eps)


def apply_rope(x, freqs_cos, freqs_sin, use_kernel=False):
    """Rotary embedding on interleaved pairs (x[..., 0::2], x[..., 1::2]), FLUX's layout.

    x [B, H, N, D]; freqs_cos / freqs_sin [N, D/2] or [B, N, D/2]: pair i of token n is rotated by
    the angle with that cosine / sine (see reference.apply_rope). The kernel gives no grad to freqs;
    freqs that require grad take the reference path.
    """
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"apply_rope: x has shape {tuple(x.shape)}; expected [B, H, N, D] with even D")
    B, _, N, D = x.shape
    ok = ((N, D // 2), (B, N, D // 2))
    for name, f in (("freqs_cos", freqs_cos), ("freqs_sin", freqs_sin)):
        if tuple(f.shape) not in ok:
            raise ValueError(f"apply_rope: {name} has shape {tuple(f.shape)}; expected [N, D/2] = "
                             f"[{N}, {D // 2}] or [B, N, D/2] for x {tuple(x.shape)}")
    trainable_freqs = freqs_cos.requires_grad or freqs_sin.requires_grad
    if not trainable_freqs and _use_kernel("apply_rope", use_kernel, x, freqs_cos, freqs_sin):
        from opendit.kernels import triton_pointwise
        return triton_pointwise.apply_rope(x, freqs_cos, freqs_sin)
    return reference.apply_rope(x, freqs_cos, freqs_sin)


ATTENTION_BACKEND = "attn_backend"  # a kernel_switches source: the attention backend's name, not a flag


def set_kernels(model, modulate: bool = False, layernorm: bool = False, attn_backend: str = "sdpa") -> None:
    """Switch the fused paths of every layer of `model`; the math stays the same (tests compare both).

    A layer class declares what it switches in `kernel_switches`, {attribute: source}: a tuple of flag names
    ("modulate", "layernorm"; the attribute is True when any of them is on) or ATTENTION_BACKEND (the attribute
    takes the backend's name: "sdpa", "flash", "math"). E.g. AdaLNNorm: {"use_modulate_kernel": ("modulate",),
    "use_layernorm_kernel": ("layernorm",)}; an attention layer: {"attn_backend": ATTENTION_BACKEND}."""
    flags = {"modulate": modulate, "layernorm": layernorm}
    for m in model.modules():
        for attr, source in getattr(type(m), "kernel_switches", {}).items():
            setattr(m, attr, attn_backend if source == ATTENTION_BACKEND else any(flags[s] for s in source))


def configure_kernels(model, modulate: bool = False, layernorm: bool = False, flashattn: bool = False,
                      device=None) -> None:
    """Apply the --enable_*_kernel / --enable_flashattn flags to a model (set_kernels), logging the paths
    that will run on `device` (entry scripts call this once at start-up)."""
    from opendit.kernels.attention import resolve_attention_backend

    backend = resolve_attention_backend(flashattn, device)
    if modulate or layernorm:
        kernel_status(use_kernel=True, device=device or "cuda")
    set_kernels(model, modulate=modulate, layernorm=layernorm, attn_backend=backend)
