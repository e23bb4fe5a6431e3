"""Triton gated residual (x + gate[b] * y) and rotary embedding apply, forward and backward.

Math is fp32 in registers; inputs and outputs may be fp16 / bf16 / fp32.
"""
import torch
import triton
import triton.language as tl

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


class GatedResidualFn(torch.autograd.Function):
    """x, y [B, ..., C] (same shape); gate [B, C]."""

    @staticmethod
    def forward(ctx, x, gate, y):
        B, C = gate.shape
        x2, y2, g = x.contiguous(), y.contiguous(), gate.contiguous()
        N = x2.numel() // (B * C)
        out_dtype = torch.promote_types(torch.promote_types(x.dtype, gate.dtype), y.dtype)
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        _gate_fwd[_gate_grid(B, N, C)](x2, g, y2, out, N, C, ROWS=_GATE_ROWS, COLS=_GATE_COLS,
                                       num_warps=num_warps(_GATE_ROWS * _GATE_COLS))
        ctx.save_for_backward(g, y2)
        ctx.meta = (x.dtype, N)
        return out

    @staticmethod
    def backward(ctx, dout):
        g, y2 = ctx.saved_tensors
        x_dtype, N = ctx.meta
        B, C = g.shape
        dout = dout.contiguous()
        dy = torch.empty(y2.shape, dtype=y2.dtype, device=y2.device)
        grid = _gate_grid(B, N, C)
        parts = torch.empty((B, grid[1], C), dtype=torch.float32, device=y2.device)
        _gate_bwd[grid](dout, g, y2, dy, parts, N, C, ROWS=_GATE_ROWS, COLS=_GATE_COLS,
                        num_warps=num_warps(_GATE_ROWS * _GATE_COLS))
        return dout.to(x_dtype), parts.sum(1).to(g.dtype), dy


@torch.compiler.disable  # see triton_norm.norm: keep torch.compile out of Triton's launcher
def gated_residual(x, gate, y):
    return GatedResidualFn.apply(x, gate, y)


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


def _rope_launch(x, cos, sin, sign, out_dtype):
    B, H, N, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((B, H, N, D), dtype=out_dtype, device=x.device)
    P = D // 2
    sfb = N * P if cos.dim() == 3 else 0
    BLOCK_P = block_size(P)
    _rope[(B * H, triton.cdiv(N, _ROPE_ROWS))](
        x, cos, sin, out, H, N, P, x.stride(0), x.stride(1), x.stride(2), sfb,
        SIGN=sign, ROWS=_ROPE_ROWS, BLOCK_P=BLOCK_P, num_warps=num_warps(_ROPE_ROWS * BLOCK_P * 2))
    return out


class RopeFn(torch.autograd.Function):
    """The rotation is orthogonal: its backward is the same rotation by the opposite angle."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return _rope_launch(x, cos, sin, 1.0, x.dtype)

    @staticmethod
    def backward(ctx, dout):
        cos, sin = ctx.saved_tensors
        return _rope_launch(dout, cos, sin, -1.0, ctx.x_dtype), None, None


@torch.compiler.disable
def apply_rope(x, freqs_cos, freqs_sin):
    """x [B, H, N, D]; freqs [N, D/2] or [B, N, D/2] (validated by the caller); no grad for freqs."""
    return RopeFn.apply(x, freqs_cos.contiguous(), freqs_sin.contiguous())

