"""Round-trip error bounds of the optimizer-state formats (opendit/optim/formats.py)."""
import math

import pytest
import torch

from opendit.optim.formats import (BF16_MAX, Bf16Format, F24Format, Fp32Format, U16Format, detect_format,
                                   make_format)

FP32_MAX = torch.finfo(torch.float32).max


def nasty(rows=37, cols=300, seed=0):
    """Wide dynamic range plus zeros, +-0, denormals, negatives and values near the fp32 limit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-30, 30, cols).float()
    x[0, :8] = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 3e-39, FP32_MAX, -FP32_MAX, 3.39e38])
    x[1] = 0.0
    x[2, :50] = -x[2, :50].abs()
    return x


def roundtrip(fmt, x):
    parts = fmt.empty(x.shape, "cpu")
    fmt.encode(x, parts)
    return fmt.decode(parts), parts


def test_fp32_is_exact():
    x = nasty()
    d, _ = roundtrip(Fp32Format(), x)
    assert torch.equal(d, x)


def test_bf16_bound():
    x = nasty()
    d, _ = roundtrip(Bf16Format(), x)
    assert torch.isfinite(d).all()
    # nearest rounding to 8 significant bits: half an ulp is 2^-8 relative; 2^-134 is half the smallest denormal
    assert ((d.double() - x.double()).abs() <= 2 ** -8 * x.double().abs() + 2 ** -134).all()
    assert d[0, 5] == BF16_MAX and d[0, 6] == -BF16_MAX  # saturates instead of overflowing to inf


def test_f24_bound():
    x = nasty()
    d, parts = roundtrip(F24Format(), x)
    assert parts["f24hi"].dtype == torch.int16 and parts["f24lo"].dtype == torch.uint8
    assert torch.isfinite(d).all()
    # 16 significant bits, nearest: 2^-16 relative; denormals keep multiples of 2^-141, half of that absolute
    assert ((d.double() - x.double()).abs() <= 2 ** -16 * x.double().abs() + 2 ** -142).all()
    assert (d.view(torch.int32) & 0xFF == 0).all()
    assert torch.equal(torch.signbit(d[2, :50]), torch.ones(50, dtype=torch.bool))


def test_f24_is_idempotent():
    x = nasty()
    d, _ = roundtrip(F24Format(), x)
    d2, _ = roundtrip(F24Format(), d)
    assert torch.equal(d, d2)


def companded(x, p):
    return x.double().abs().pow(1 / p).copysign(x.double())


@pytest.mark.parametrize("block,power,cols", [(256, 3.0, 300), (64, 2.0, 300), (300, 1.0, 300), (100, 3.0, 1)])
def test_u16_bound_in_companded_space(block, power, cols):
    x = nasty(cols=cols) if cols > 1 else torch.randn(50, 1)
    if power == 1.0:
        x = x.clamp(-1e38, 1e38)  # power 1 keeps max - min finite only below half the fp32 range
    d, parts = roundtrip(U16Format(block, power), x)
    assert parts["u16"].shape == x.shape and parts["u16"].dtype == torch.int16
    assert parts["u16range"].shape == (x.shape[0], math.ceil(x.shape[1] / block), 2)
    assert torch.isfinite(d).all()
    y, yd = companded(x, power), companded(d, power)
    # expected quantization step per element, from the block's min/max computed here independently
    rows, cols = x.shape
    nblk = math.ceil(cols / block)
    step = torch.empty_like(y)
    for b in range(nblk):
        sl = slice(b * block, min((b + 1) * block, cols))
        lo, hi = y[:, sl].amin(1, keepdim=True), y[:, sl].amax(1, keepdim=True)
        step[:, sl] = ((hi - lo) / 65535).expand(-1, sl.stop - sl.start)
        scale = torch.maximum(lo.abs(), hi.abs()).expand(-1, sl.stop - sl.start)
        err = (yd[:, sl] - y[:, sl]).abs()
        # half a step, plus fp32 arithmetic on the block's magnitude (1e-5 of it, far below a step)
        assert (err <= 0.5 * step[:, sl] + 1e-5 * scale).all()


def test_zeros_and_constants_are_exact():
    z = torch.zeros(8, 600)
    for fmt in (Bf16Format(), F24Format(), U16Format(256, 3.0)):
        assert torch.equal(roundtrip(fmt, z)[0], z)
    c = torch.full((4, 512), 0.25)  # a constant block: max == min, a power of two survives pow exactly
    assert torch.equal(roundtrip(U16Format(256, 2.0), c)[0], c)


def test_blockwise_u16_beats_per_tensor_and_bf16():
    # Adam-like second moments: rows on very different scales (per-output-channel gradient sizes).
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 1024, generator=g) * torch.logspace(-6, 0, 64).unsqueeze(1)).square()
    err = {}
    for name, fmt in [("bf16", Bf16Format()), ("block", U16Format(256, 3.0)), ("tensor", U16Format(1 << 20, 3.0))]:
        err[name] = ((roundtrip(fmt, x)[0] - x).abs().sum() / x.abs().sum()).item()
    assert err["block"] < err["tensor"]
    assert err["block"] < 0.5 * err["bf16"]


def test_format_choice():
    assert make_format("u16", global_numel=4096, ndim=2).name == "fp32"  # small stays fp32
    assert make_format("u16", global_numel=4097, ndim=2).name == "u16"
    assert make_format("u16", global_numel=10000, ndim=1).name == "f24"  # 1-D has no rows to block
    assert make_format("bf16", global_numel=10000, ndim=1).name == "bf16"
    assert detect_format({"f24hi", "f24lo"}).name == "f24"
    with pytest.raises(ValueError, match="state format"):
        make_format("int8", global_numel=10, ndim=1)
    with pytest.raises(ValueError, match="match no known format"):
        detect_format({"q8"})


@pytest.mark.parametrize("fmt", [Fp32Format(), Bf16Format(), F24Format(), U16Format(256, 3.0)])
def test_nbytes_matches_parts(fmt):
    shape = (33, 700)
    parts = fmt.empty(shape, "cpu")
    assert fmt.nbytes(shape) == sum(t.numel() * t.element_size() for t in parts.values())
