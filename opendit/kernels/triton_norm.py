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


class NormFn(torch.autograd.Function):
    """x [B, ..., C]; shift / scale [B, C] contiguous or None (then B is taken as 1)."""

    @staticmethod
    def forward(ctx, x, weight, bias, shift, scale, eps, rms):
        modulate = scale is not None
        C = x.shape[-1]
        x2 = x.contiguous().view(-1, C)
        B = scale.shape[0] if modulate else 1
        N = x2.shape[0] // B
        out_dtype = torch.promote_types(x.dtype, scale.dtype) if modulate else x.dtype
        if modulate:
            out_dtype = torch.promote_types(out_dtype, shift.dtype)
        y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        mean = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        BLOCK_C = block_size(C)
        _norm_fwd[(x2.shape[0],)](
            x2, y, _ptr(weight, x2), _ptr(bias, x2), _ptr(shift, x2), _ptr(scale, x2), mean, rstd,
            N, C, eps, HAS_W=weight is not None, HAS_B=bias is not None, MODULATE=modulate,
            RMS=rms, BLOCK_C=BLOCK_C, num_warps=num_warps(BLOCK_C))
        ctx.save_for_backward(x2, weight, bias, scale, mean, rstd)
        ctx.meta = (x.shape, x.dtype, shift.dtype if modulate else None, B, N, rms)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, bias, scale, mean, rstd = ctx.saved_tensors
        x_shape, x_dtype, shift_dtype, B, N, rms = ctx.meta
        modulate = scale is not None
        C = x2.shape[1]
        dy2 = dy.contiguous().view(-1, C)
        dx = torch.empty(x2.shape, dtype=x_dtype, device=x2.device)
        ROWS = rows_per_program(x2.shape[0], N, x2.device)
        n_blk = triton.cdiv(N, ROWS)
        # Partial sums, one [C] row per program; only the ones the flags ask for get written.
        parts = torch.empty((4, B * n_blk, C), dtype=torch.float32, device=x2.device)
        BLOCK_C = block_size(C)
        _norm_bwd[(B, n_blk)](
            x2, dy2, dx, _ptr(weight, x2), _ptr(bias, x2), _ptr(scale, x2), mean, rstd,
            parts[0], parts[1], parts[2], parts[3], N, C,
            HAS_W=weight is not None, HAS_B=bias is not None, MODULATE=modulate, RMS=rms,
            ROWS=ROWS, BLOCK_C=BLOCK_C, num_warps=num_warps(BLOCK_C))
        dw = parts[0].sum(0).to(weight.dtype) if weight is not None else None
        db = parts[1].sum(0).to(bias.dtype) if bias is not None else None
        dscale = dshift = None
        if modulate:
            dscale = parts[2].view(B, n_blk, C).sum(1).to(scale.dtype)
            dshift = parts[3].view(B, n_blk, C).sum(1).to(shift_dtype)
        return dx.view(x_shape), dw, db, dshift, dscale, None, None


def _ptr(t, fallback):
    """Kernels take a pointer for every optional tensor; a constexpr flag keeps unused ones unread."""
    return fallback if t is None else t.contiguous()


# torch.compile must not trace into Triton's launcher (it fails on the CPU interpreter and is
# untested on GPU): under compile the kernel runs eagerly between two graphs.
@torch.compiler.disable
def norm(x, weight=None, bias=None, shift=None, scale=None, eps=1e-6, rms=False):
    """Entry point used by opendit.kernels; arguments are already validated there."""
    return NormFn.apply(x, weight, bias, shift, scale, float(eps), rms)
