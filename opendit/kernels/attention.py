"""Attention dispatch. q [B, H, Nq, D], k / v [B, H, Nk, D] -> [B, H, Nq, D].

Backends, fastest first:
  "flash": flash-attn (FA3 `flash_attn_interface` on Hopper when importable, else FA2
           `flash_attn.flash_attn_func`); CUDA, fp16 / bf16, head dim <= 256 and a multiple of 8,
           no mask. Calls it cannot take run on "sdpa" instead (logged once).
  "sdpa":  F.scaled_dot_product_attention; PyTorch picks flash / cuDNN / efficient / math itself.
  "math":  softmax(q k^T * scale + mask) v with fp32 scores and accumulation; the reference.
Masks follow SDPA: bool (True = attend) or additive float, broadcastable to [B, H, Nq, Nk].
`resolve_attention_backend` picks the backend once at start-up and logs why.
"""
import logging
import math

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

BACKENDS = ("flash", "sdpa", "math")
_warned = set()


_probed = {}  # a dict, not functools.lru_cache: torch.compile traces this and warns on lru_cache


def _flash_fn():
    """(flash_attn_func, "FA3" | "FA2"), or (None, reason). FA3 needs a Hopper GPU (sm_90)."""
    if "flash" not in _probed:
        _probed["flash"] = _import_flash()
    return _probed["flash"]


def _import_flash():
    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    if torch.cuda.get_device_capability()[0] == 9:
        try:
            from flash_attn_interface import flash_attn_func
            return flash_attn_func, "FA3"
        except Exception as e:
            logger.info("flash_attn_interface (FA3) not importable (%s); trying flash_attn (FA2)", e)
    try:
        from flash_attn import flash_attn_func
    except Exception as e:
        return None, f"flash_attn is not importable ({type(e).__name__}: {e})"
    return flash_attn_func, "FA2"


def resolve_attention_backend(enable_flashattn: bool, device=None) -> str:
    """"flash" when asked for and flash-attn works on `device` (default: CUDA if present), else "sdpa".

    Logs one line naming the backend and, on a fallback, the reason.
    """
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if enable_flashattn:
        fn, detail = _flash_fn()
        if fn is not None and device.type == "cuda":
            logger.info("attention backend: flash (%s)", detail)
            return "flash"
        reason = detail if fn is None else f"device is {device.type}"
        logger.warning("attention backend: sdpa (flash attention requested but %s)", reason)
        return "sdpa"
    logger.info("attention backend: sdpa (F.scaled_dot_product_attention)")
    return "sdpa"


def _warn_once(key, msg, *args):
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


def _check(q, k, v, attn_mask, backend):
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is unknown; choose one of {BACKENDS}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention takes q, k, v as [B, H, N, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}; need q [B, H, Nq, D] and k = v [B, H, Nk, D]")
    if attn_mask is not None and attn_mask.dim() > 4:
        raise ValueError(f"attn_mask has shape {tuple(attn_mask.shape)}; it must broadcast to [B, H, Nq, Nk]")


def math_attention(q, k, v, attn_mask=None, scale=None):
    """The reference: fp32 scores, softmax and accumulation; output in q's dtype."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale  # [B, H, Nq, Nk]
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    return torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)


def _flash_unsupported(q, attn_mask):
    if attn_mask is not None:
        return "an attention mask"
    if not q.is_cuda:
        return f"tensors on {q.device.type}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (flash-attn takes fp16 / bf16)"
    if q.shape[-1] > 256 or q.shape[-1] % 8:
        return f"head dim {q.shape[-1]} (flash-attn takes multiples of 8 up to 256)"
    return None


def _flash_attention(q, k, v, scale):
    fn, _ = _flash_fn()
    # flash-attn wants [B, N, H, D] with a unit last stride; transposing back gives [B, H, N, D].
    out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale)
    if isinstance(out, tuple):  # some FA3 releases return (out, softmax_lse)
        out = out[0]
    return out.transpose(1, 2)


def attention(q, k, v, attn_mask=None, backend="sdpa", scale=None):
    """Scaled dot-product attention through `backend` ("flash", "sdpa" or "math").

    q [B, H, Nq, D], k / v [B, H, Nk, D] (Nq may differ from Nk: cross-attention); attn_mask bool
    (True = attend) or additive, broadcastable to [B, H, Nq, Nk]; scale defaults to 1/sqrt(D).
    """
    _check(q, k, v, attn_mask, backend)
    if backend == "flash":
        why = _flash_unsupported(q, attn_mask) or (_flash_fn()[1] if _flash_fn()[0] is None else None)
        if why is None:
            return _flash_attention(q, k, v, scale)
        _warn_once(("flash", why), "flash attention cannot take %s; using sdpa for these calls", why)
        backend = "sdpa"
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        attn_mask = attn_mask.to(q.dtype)  # SDPA wants an additive mask in q's dtype
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    return math_attention(q, k, v, attn_mask, scale)
