"""Triton gated residual (x + gate[b] * y) and rotary embedding apply, forward and backward.

Math is fp32 in registers; inputs and outputs may be fp16 / bf16 / fp32.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from opendit.kernels._common import block_size, num_warps

# Gated residual tiles: ROWS tokens x COLS channels of one sample per program.
_GATE_ROWS, _GATE_COLS = 16, 256
# RoPE tiles: ROWS tokens of one (sample, head) per program, all D/2 pairs.
_ROPE_ROWS = 16


@triton.jit
def _gate_fwd(X, G, Y, Out, N, C, ROWS: tl.constexpr, COLS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(2) * COLS + tl.arange(0, COLS)
    m = (rows < N)[:, None] & (cols < C)[None, :]
    off = (b * N + rows)[:, None] * C + cols[None, :]
    g = tl.load(G + b * C + cols, mask=cols < C, other=0.0).to(tl.float32)
    x = tl.load(X + off, mask=m, other=0.0).to(tl.float32)
    y = tl.load(Y + off, mask=m, other=0.0).to(tl.float32)
    tl.store(Out + off, x + g[None, :] * y, mask=m)


@triton.jit
def _gate_bwd(DOut, G, Y, DY, DG, N, C, ROWS: tl.constexpr, COLS: tl.constexpr):
    """dy = dout * gate[b]; partial dgate[b, blk] = sum over this tile's rows of dout * y (fp32)."""
    b = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    rows = blk * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(2) * COLS + tl.arange(0, COLS)
    m = (rows < N)[:, None] & (cols < C)[None, :]
    off = (b * N + rows)[:, None] * C + cols[None, :]
    g = tl.load(G + b * C + cols, mask=cols < C, other=0.0).to(tl.float32)
    dout = tl.load(DOut + off, mask=m, other=0.0).to(tl.float32)
    y = tl.load(Y + off, mask=m, other=0.0).to(tl.float32)
    tl.store(DY + off, dout * g[None, :], mask=m)
    part = (b * tl.num_programs(1) + blk) * C + cols
    tl.store(DG + part, tl.sum(dout * y, axis=0), mask=cols < C)


def _gate_grid(B, N, C):
    return (B, triton.cdiv(N, _GATE_ROWS), triton.cdiv(C, _GATE_COLS))


@torch.library.custom_op("opendit::gated_residual_fwd", mutates_args=())
def gated_residual_fwd(x: Tensor, gate: Tensor, y: Tensor) -> Tensor:
    """x, y [B, ..., C] (same shape); gate [B, C] -> x + gate[b] * y in the promoted dtype."""
    out = _gate_fwd_fake(x, gate, y)
    B, C = gate.shape
    N = x.numel() // (B * C)
    _gate_fwd[_gate_grid(B, N, C)](x.contiguous(), gate.contiguous(), y.contiguous(), out, N, C,
                                   ROWS=_GATE_ROWS, COLS=_GATE_COLS, num_warps=num_warps(_GATE_ROWS * _GATE_COLS))
    return out


@gated_residual_fwd.register_fake
def _gate_fwd_fake(x, gate, y):
    out_dtype = torch.promote_types(torch.promote_types(x.dtype, gate.dtype), y.dtype)
    return torch.empty(x.shape, dtype=out_dtype, device=x.device)


@torch.library.custom_op("opendit::gated_residual_bwd", mutates_args=())
def gated_residual_bwd(dout: Tensor, gate: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """-> dy = dout * gate[b] (y's shape and dtype), fp32 partial sums [B, n_blk, C] of dgate."""
    dy, parts = _gate_bwd_fake(dout, gate, y)
    B, C = gate.shape
    N = y.numel() // (B * C)
    _gate_bwd[_gate_grid(B, N, C)](dout.contiguous(), gate.contiguous(), y.contiguous(), dy, parts, N, C,
                                   ROWS=_GATE_ROWS, COLS=_GATE_COLS, num_warps=num_warps(_GATE_ROWS * _GATE_COLS))
    return dy, parts


@gated_residual_bwd.register_fake
def _gate_bwd_fake(dout, gate, y):
    B, C = gate.shape
    n_blk = _gate_grid(B, y.numel() // (B * C), C)[1]
    dy = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    return dy, torch.empty((B, n_blk, C), dtype=torch.float32, device=y.device)


def _gate_setup_context(ctx, inputs, output):
    x, gate, y = inputs
    ctx.save_for_backward(gate, y)
    ctx.x_dtype = x.dtype


def _gate_backward(ctx, dout):
    gate, y = ctx.saved_tensors
    dy, parts = gated_residual_bwd(dout, gate, y)
    return dout.to(ctx.x_dtype), parts.sum(1).to(gate.dtype), dy


gated_residual_fwd.register_autograd(_gate_backward, setup_context=_gate_setup_context)


def gated_residual(x, gate, y):
    """Entry point used by opendit.kernels (inputs validated there); gate [B, C]."""
    return gated_residual_fwd(x, gate, y)


@triton.jit
def _rope(X, Cos, Sin, Out, H, N, P, sxb, sxh, sxn, sfb,
          SIGN: tl.constexpr, ROWS: tl.constexpr, BLOCK_P: tl.constexpr):
    """Rotate interleaved pairs (x[2p], x[2p+1]) of tokens of one (b, h) by angle * SIGN.

    X is [B, H, N, D] with any strides for B, H, N and unit stride for D; Out is contiguous.
    Cos / Sin are [N, P] (sfb = 0) or [B, N, P] (sfb = N * P), P = D / 2.
    """
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    n = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    p = tl.arange(0, BLOCK_P)
    m = (n < N)[:, None] & (p < P)[None, :]
    src = X + b * sxb + h * sxh + n[:, None] * sxn + 2 * p[None, :]
    x0 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(src + 1, mask=m, other=0.0).to(tl.float32)
    f = b * sfb + n[:, None] * P + p[None, :]
    c = tl.load(Cos + f, mask=m, other=0.0).to(tl.float32)
    s = tl.load(Sin + f, mask=m, other=0.0).to(tl.float32) * SIGN
    dst = Out + (bh * N + n[:, None]) * (2 * P) + 2 * p[None, :]
    tl.store(dst, x0 * c - x1 * s, mask=m)
    tl.store(dst + 1, x0 * s + x1 * c, mask=m)


@torch.library.custom_op("opendit::rope", mutates_args=())
def rope(x: Tensor, cos: Tensor, sin: Tensor, sign: float) -> Tensor:
    """x [B, H, N, D] (any strides but a unit last one) rotated by sign * angle -> contiguous, x's dtype."""
    out = _rope_fake(x, cos, sin, sign)
    B, H, N, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    P = D // 2
    sfb = N * P if cos.dim() == 3 else 0
    BLOCK_P = block_size(P)
    _rope[(B * H, triton.cdiv(N, _ROPE_ROWS))](
        x, cos, sin, out, H, N, P, x.stride(0), x.stride(1), x.stride(2), sfb,
        SIGN=sign, ROWS=_ROPE_ROWS, BLOCK_P=BLOCK_P, num_warps=num_warps(_ROPE_ROWS * BLOCK_P * 2))
    return out


@rope.register_fake
def _rope_fake(x, cos, sin, sign):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _rope_setup_context(ctx, inputs, output):
    _, cos, sin, sign = inputs
    ctx.save_for_backward(cos, sin)
    ctx.sign = sign


def _rope_backward(ctx, dout):
    """The rotation is orthogonal: its backward is the same rotation by the opposite angle."""
    cos, sin = ctx.saved_tensors
    return rope(dout, cos, sin, -ctx.sign), None, None, None


rope.register_autograd(_rope_backward, setup_context=_rope_setup_context)


def apply_rope(x, freqs_cos, freqs_sin):
    """x [B, H, N, D]; freqs [N, D/2] or [B, N, D/2] (validated by the caller); no grad for freqs."""
    return rope(x, freqs_cos, freqs_sin, 1.0)
