"""PyTorch reference twins of the fused kernels. Same signatures as the Triton versions.

Shapes: x [B, N, C] (any middle dims, see `_per_sample`); shift / scale / gate per sample [B, C] or per token (x's
shape, Wan2.2's per-token timesteps); weight / bias [C]. These run everywhere (CPU, any dtype) and define what the
kernels must compute.
"""
import torch
import torch.nn.functional as F


def _per_sample(v, x):
    """[B, C] -> [B, 1, ..., 1, C] so one row of `v` applies to every token of sample b of x; a per-token v (x's
    shape) as it is."""
    if v.shape == x.shape:
        return v
    return v.reshape(v.shape[0], *([1] * (x.dim() - 2)), v.shape[-1])


def layernorm_modulate(x, shift, scale, weight=None, bias=None, eps=1e-6):
    """adaLN: LN(x) * (1 + scale[b]) + shift[b]."""
    y = F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return y * (1 + _per_sample(scale, x)) + _per_sample(shift, x)


def gated_residual(x, gate, y):
    """x + gate[b] * y."""
    return x + _per_sample(gate, x) * y


def layer_norm(x, weight=None, bias=None, eps=1e-6):
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def rms_norm(x, weight=None, eps=1e-6):
    """RMSNorm over the last dim, computed in fp32, returned in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def apply_rope(x, freqs_cos, freqs_sin):
    """Rotary embedding on interleaved pairs (FLUX / Llama layout), computed in fp32.

    x [B, H, N, D]; freqs_cos / freqs_sin [N, D/2] (shared by the batch) or [B, N, D/2] (per sample).
    Pair i of a token is (x[..., 2i], x[..., 2i+1]); it is rotated by the angle whose cosine and sine
    are freqs_cos[n, i] and freqs_sin[n, i]:
        out[2i]   = x[2i] * cos - x[2i+1] * sin
        out[2i+1] = x[2i] * sin + x[2i+1] * cos
    Returned in x's dtype.
    """
    cos, sin = freqs_cos.float(), freqs_sin.float()
    if cos.dim() == 3:  # per-sample [B, N, D/2] -> [B, 1, N, D/2], broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    xf = x.float().unflatten(-1, (-1, 2))  # [B, H, N, D/2, 2]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)
