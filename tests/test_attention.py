"""Attention dispatch: math == sdpa on CPU (fp32), masks, cross-attention, backend fallback.

Tolerance: both compute softmax(q k^T / sqrt(d)) v in fp32 with different reduction orders over
Nk <= 23 keys and D = 40 channels: a few fp32 ulps on O(1) outputs -> atol = rtol = 1e-5.
"""
import logging
import math

import pytest
import torch
import torch.nn.functional as F

from opendit.kernels import attention as attn

TOL = dict(atol=1e-5, rtol=1e-5)


def _qkv(B=2, H=3, Nq=17, Nk=17, D=40, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, Nq, D, generator=g, dtype=dtype)
    k = torch.randn(B, H, Nk, D, generator=g, dtype=dtype)
    v = torch.randn(B, H, Nk, D, generator=g, dtype=dtype)
    return q, k, v


def _naive(q, k, v, mask=None):
    """Loop-free textbook formula, independent of both backends."""
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v.double()).float()


@pytest.mark.parametrize("Nq,Nk", [(17, 17), (5, 23), (23, 1)])
def test_math_equals_sdpa_and_textbook(Nq, Nk):
    q, k, v = _qkv(Nq=Nq, Nk=Nk)
    out_math = attn.attention(q, k, v, backend="math")
    out_sdpa = attn.attention(q, k, v, backend="sdpa")
    assert out_math.shape == (2, 3, Nq, 40)
    torch.testing.assert_close(out_math, out_sdpa, **TOL)
    torch.testing.assert_close(out_math, _naive(q, k, v), **TOL)


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 11), (1, 1, 7, 11), (2, 3, 7, 11)])
def test_masks_match_between_backends(kind, mask_shape):
    q, k, v = _qkv(Nq=7, Nk=11)
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(mask_shape, generator=g) > 0.4
    keep[..., 0] = True  # no query may lose every key (softmax of all -inf is NaN by definition)
    mask = keep if kind == "bool" else torch.where(keep, 0.0, -1e4) + torch.randn(mask_shape, generator=g)
    out_math = attn.attention(q, k, v, attn_mask=mask, backend="math")
    torch.testing.assert_close(out_math, attn.attention(q, k, v, attn_mask=mask, backend="sdpa"), **TOL)
    torch.testing.assert_close(out_math, _naive(q, k, v, mask), **TOL)
    assert (out_math - attn.attention(q, k, v, backend="math")).abs().amax() > 1e-2  # the mask mattered


def test_math_backward_matches_sdpa():
    q, k, v = (t.requires_grad_() for t in _qkv(Nq=9, Nk=13))
    dout = torch.randn(2, 3, 9, 40)
    grads = [torch.autograd.grad(attn.attention(q, k, v, backend=b), (q, k, v), dout) for b in ("math", "sdpa")]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # grads sum over 13 keys / 9 queries


def test_bf16_math_returns_bf16_and_accumulates_in_fp32():
    q, k, v = _qkv(dtype=torch.bfloat16)
    out = attn.attention(q, k, v, backend="math")
    assert out.dtype == torch.bfloat16
    exact = _naive(q.float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), exact.bfloat16().float(), atol=1e-6, rtol=2 ** -7)  # one rounding


def test_custom_scale():
    q, k, v = _qkv()
    torch.testing.assert_close(attn.attention(q, k, v, backend="math", scale=0.3),
                               F.scaled_dot_product_attention(q, k, v, scale=0.3), **TOL)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_resolve_flash_falls_back_on_cpu_with_a_reason(caplog):
    with caplog.at_level(logging.INFO, logger="opendit.kernels.attention"):
        assert attn.resolve_attention_backend(True) == "sdpa"
    assert "attention backend: sdpa" in caplog.text and "flash attention requested but" in caplog.text
    with caplog.at_level(logging.INFO, logger="opendit.kernels.attention"):
        assert attn.resolve_attention_backend(False, device="cpu") == "sdpa"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_flash_backend_on_cpu_runs_sdpa():
    q, k, v = _qkv()
    torch.testing.assert_close(attn.attention(q, k, v, backend="flash"),
                               attn.attention(q, k, v, backend="sdpa"), **TOL)


def test_bad_inputs_name_the_problem():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backend 'flash2' is unknown"):
        attn.attention(q, k, v, backend="flash2")
    with pytest.raises(ValueError, match=r"\[B, H, N, D\]"):
        attn.attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="shapes disagree"):
        attn.attention(q, k[:, :2], v[:, :2])


@pytest.mark.gpu
@pytest.mark.parametrize("enable_flash", [True, False])
def test_cuda_bf16_backend_matches_math(enable_flash):
    """Whatever backend resolves on this GPU (flash-attn when installed) agrees with the fp32 math path."""
    backend = attn.resolve_attention_backend(enable_flash)
    q, k, v = (t.cuda() for t in _qkv(B=2, H=4, Nq=257, Nk=257, D=72, dtype=torch.bfloat16))
    exact = attn.attention(q.float(), k.float(), v.float(), backend="math")
    out = attn.attention(q, k, v, backend=backend)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.float(), exact, atol=2e-2, rtol=2e-2)  # bf16 inputs / output
