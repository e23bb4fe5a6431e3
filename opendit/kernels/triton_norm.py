"""Triton LayerNorm / RMSNorm with an optional fused adaLN modulation, forward and backward.

One kernel family covers three public functions:
  layernorm_modulate: LN(x) * (1 + scale[b]) + shift[b]       (MODULATE)
  layer_norm:         LN(x) * weight + bias
  rms_norm:           x / rms(x) * weight                      (RMS: no centring, no bias)
Rows are the flattened tokens of x [B, N, C] -> [B*N, C]; row r belongs to sample b = r // N, so
every sample reads its own scale / shift row (never sample 0's). Math is fp32 in registers;
inputs and outputs may be fp16 / bf16 / fp32.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from opendit.kernels._common import block_size, num_warps, rows_per_program


@triton.jit
def _norm_fwd(X, Y, W, Bias, Shift, Scale, Mean, Rstd, N, C, eps,
              HAS_W: tl.constexpr, HAS_B: tl.constexpr, MODULATE: tl.constexpr, RMS: tl.constexpr,
              BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    x = tl.load(X + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        mean = 0.0  # not stored
        xc = x
    else:
        mean = tl.sum(x, axis=0) / C
        xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / C + eps)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(Bias + cols, mask=mask, other=0.0).to(tl.float32)
    if MODULATE:
        b = row // N
        scale = tl.load(Scale + b * C + cols, mask=mask, other=0.0).to(tl.float32)
        shift = tl.load(Shift + b * C + cols, mask=mask, other=0.0).to(tl.float32)
        y = y * (1.0 + scale) + shift
    tl.store(Y + row * C + cols, y, mask=mask)  # store casts to Y's dtype
    if not RMS:
        tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


@triton.jit
def _norm_bwd(X, DY, DX, W, Bias, Scale, Mean, Rstd, DW, DB, DScale, DShift, N, C,
              HAS_W: tl.constexpr, HAS_B: tl.constexpr, MODULATE: tl.constexpr, RMS: tl.constexpr,
              ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (b, blk) handles rows blk*ROWS .. blk*ROWS+ROWS-1 of sample b.

    Writes dx for those rows, and per-program partial sums (fp32, [B * n_blk, C]) of the weight,
    bias, scale and shift grads; the caller sums the partials with torch.
    """
    b = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    n_blk = tl.num_programs(1)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) if HAS_W else 1.0
    bias = tl.load(Bias + cols, mask=mask, other=0.0).to(tl.float32) if HAS_B else 0.0
    mod = 1.0
    if MODULATE:
        mod = 1.0 + tl.load(Scale + b * C + cols, mask=mask, other=0.0).to(tl.float32)
    acc_dw = tl.zeros([BLOCK_C], dtype=tl.float32)
    acc_db = tl.zeros([BLOCK_C], dtype=tl.float32)
    acc_dscale = tl.zeros([BLOCK_C], dtype=tl.float32)
    acc_dshift = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i in range(ROWS):
        n = blk * ROWS + i
        # The last block of a sample may run past N: those rows load zeros and add nothing.
        m = mask & (cols * 0 + n < N)
        row = b * N + n
        x = tl.load(X + row * C + cols, mask=m, other=0.0).to(tl.float32)
        dout = tl.load(DY + row * C + cols, mask=m, other=0.0).to(tl.float32)
        safe_row = b * N + tl.minimum(n, N - 1)
        rstd = tl.load(Rstd + safe_row)
        if RMS:
            mean = 0.0  # RMSNorm does not centre; Mean was never written
        else:
            mean = tl.load(Mean + safe_row)
        xhat = tl.where(m, (x - mean) * rstd, 0.0)
        dy = dout
        if MODULATE:
            acc_dscale += dout * (xhat * w + bias)
            acc_dshift += dout
            dy = dout * mod
        if HAS_W:
            acc_dw += dy * xhat
        if HAS_B:
            acc_db += dy
        dxhat = tl.where(m, dy * w, 0.0)
        c1 = tl.sum(xhat * dxhat, axis=0) / C
        if RMS:
            dx = (dxhat - xhat * c1) * rstd
        else:
            c2 = tl.sum(dxhat, axis=0) / C
            dx = (dxhat - (xhat * c1 + c2)) * rstd
        tl.store(DX + row * C + cols, dx, mask=m)
    part = (b * n_blk + blk) * C + cols
    if HAS_W:
        tl.store(DW + part, acc_dw, mask=mask)
    if HAS_B:
        tl.store(DB + part, acc_db, mask=mask)
    if MODULATE:
        tl.store(DScale + part, acc_dscale, mask=mask)
        tl.store(DShift + part, acc_dshift, mask=mask)


# ---- torch.library custom ops -------------------------------------------------------------------------------
# Registered as ops (not autograd.Functions) so torch.compile keeps them in its graph as opaque calls
# (shapes from the fake impls below) instead of splitting the graph around Triton's launcher.
# Inputs are the flattened rows x2 [R, C] (contiguous), optional weight / bias [C] and shift / scale
# [B, C]; R = B * N. Outputs are fresh tensors (custom ops may not return views of their inputs).

@torch.library.custom_op("opendit::norm_fwd", mutates_args=())
def norm_fwd(x2: Tensor, weight: Tensor | None, bias: Tensor | None, shift: Tensor | None,
             scale: Tensor | None, eps: float, rms: bool) -> tuple[Tensor, Tensor, Tensor]:
    """-> y [R, C] (x's dtype promoted with shift / scale), mean [R] fp32 ([0] for RMS), rstd [R] fp32."""
    y, mean, rstd = _norm_fwd_fake(x2, weight, bias, shift, scale, eps, rms)
    x2 = x2.contiguous()
    R, C = x2.shape
    modulate = scale is not None
    N = R // (scale.shape[0] if modulate else 1)
    BLOCK_C = block_size(C)
    _norm_fwd[(R,)](
        x2, y, _ptr(weight, x2), _ptr(bias, x2), _ptr(shift, x2), _ptr(scale, x2), mean if not rms else rstd,
        rstd, N, C, eps, HAS_W=weight is not None, HAS_B=bias is not None, MODULATE=modulate, RMS=rms,
        BLOCK_C=BLOCK_C, num_warps=num_warps(BLOCK_C))
    return y, mean, rstd


@norm_fwd.register_fake
def _norm_fwd_fake(x2, weight, bias, shift, scale, eps, rms):
    out_dtype = x2.dtype
    if scale is not None:
        out_dtype = torch.promote_types(torch.promote_types(out_dtype, scale.dtype), shift.dtype)
    R = x2.shape[0]
    y = torch.empty(x2.shape, dtype=out_dtype, device=x2.device)
    mean = torch.empty(0 if rms else R, dtype=torch.float32, device=x2.device)  # RMSNorm has no mean
    return y, mean, torch.empty(R, dtype=torch.float32, device=x2.device)


@torch.library.custom_op("opendit::norm_bwd", mutates_args=())
def norm_bwd(x2: Tensor, dy2: Tensor, weight: Tensor | None, bias: Tensor | None, scale: Tensor | None,
             mean: Tensor, rstd: Tensor, rows: int, rms: bool) -> tuple[Tensor, Tensor]:
    """-> dx [R, C] in x's dtype, and fp32 partial sums [4, B * n_blk, C] of the grads of weight, bias,
    scale, shift (n_blk = ceil(N / rows); only the slices the flags ask for are written)."""
    dx, parts = _norm_bwd_fake(x2, dy2, weight, bias, scale, mean, rstd, rows, rms)
    x2, dy2 = x2.contiguous(), dy2.contiguous()
    C = x2.shape[1]
    B = scale.shape[0] if scale is not None else 1
    N = x2.shape[0] // B
    BLOCK_C = block_size(C)
    _norm_bwd[(B, parts.shape[1] // B)](
        x2, dy2, dx, _ptr(weight, x2), _ptr(bias, x2), _ptr(scale, x2), mean if not rms else rstd, rstd,
        parts[0], parts[1], parts[2], parts[3], N, C,
        HAS_W=weight is not None, HAS_B=bias is not None, MODULATE=scale is not None, RMS=rms,
        ROWS=rows, BLOCK_C=BLOCK_C, num_warps=num_warps(BLOCK_C))
    return dx, parts


@norm_bwd.register_fake
def _norm_bwd_fake(x2, dy2, weight, bias, scale, mean, rstd, rows, rms):
    B = scale.shape[0] if scale is not None else 1
    n_blk = triton.cdiv(x2.shape[0] // B, rows)
    dx = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
    return dx, torch.empty((4, B * n_blk, x2.shape[1]), dtype=torch.float32, device=x2.device)


def _norm_setup_context(ctx, inputs, output):
    x2, weight, bias, shift, scale, eps, rms = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x2, weight, bias, scale, mean, rstd)
    ctx.rms = rms
    ctx.shift_dtype = shift.dtype if shift is not None else None


def _norm_backward(ctx, dy, _dmean, _drstd):
    x2, weight, bias, scale, mean, rstd = ctx.saved_tensors
    B = scale.shape[0] if scale is not None else 1
    rows = rows_per_program(x2.shape[0], x2.shape[0] // B, x2.device)
    dx, parts = norm_bwd(x2, dy.contiguous(), weight, bias, scale, mean, rstd, rows, ctx.rms)
    C = x2.shape[1]
    dw = parts[0].sum(0).to(weight.dtype) if weight is not None else None
    db = parts[1].sum(0).to(bias.dtype) if bias is not None else None
    dscale = dshift = None
    if scale is not None:  # per-sample grads: sum each sample's partials
        dscale = parts[2].view(B, -1, C).sum(1).to(scale.dtype)
        dshift = parts[3].view(B, -1, C).sum(1).to(ctx.shift_dtype)
    return dx, dw, db, dshift, dscale, None, None


norm_fwd.register_autograd(_norm_backward, setup_context=_norm_setup_context)


def _ptr(t, fallback):
    """Kernels take a pointer for every optional tensor; a constexpr flag keeps unused ones unread."""
    return fallback if t is None else t.contiguous()


def norm(x, weight=None, bias=None, shift=None, scale=None, eps=1e-6, rms=False):
    """Entry point used by opendit.kernels; arguments are already validated there.

    x [B, ..., C]; shift / scale [B, C] or None (then the rows are not grouped by sample)."""
    C = x.shape[-1]
    y, _, _ = norm_fwd(x.contiguous().view(-1, C), weight, bias, shift, scale, float(eps), bool(rms))
    return y.view(x.shape)
