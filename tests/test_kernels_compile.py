"""The Triton kernels are torch.library custom ops, so torch.compile traces through them.

Checks: every op passes torch.library.opcheck (schema, fake impl, autograd registration, AOT
dispatch with dynamic shapes); a DiT block with every kernel switched on compiles with
fullgraph=True (zero graph breaks) and gives the eager block's outputs and gradients.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest). Tolerances:
the compiled and eager runs call the very same kernels; aot_eager only reorders the surrounding
PyTorch ops, so results agree to fp32 rounding of the differing op order (atol = rtol = 1e-5 forward,
1e-4 for gradients that sum over B*N tokens), the same bounds tests/test_kernels.py uses.
"""
import os

import pytest
import torch

from opendit import kernels

if not torch.cuda.is_available():  # conftest does this too; kept for running this file on its own
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
from opendit.kernels import triton_norm, triton_pointwise  # noqa: E402
from opendit.models.blocks import AdaLNZeroBlock  # noqa: E402

from tests.test_kernels import DEVICE, FWD_TOL, GRAD_TOL  # noqa: E402  (the same device and bounds)


def _t(*shape, grad=True):
    return torch.randn(*shape, device=DEVICE).requires_grad_(grad)


@pytest.mark.parametrize("case", ["modulate", "layer_norm", "rms_norm"])
def test_norm_op_passes_opcheck(case):
    B, N, C = 2, 5, 24
    x2 = _t(B * N, C)
    args = {"modulate": (x2, None, None, _t(B, C), _t(B, C), 1e-6, False),
            "layer_norm": (x2, _t(C), _t(C), None, None, 1e-6, False),
            "rms_norm": (x2, _t(C), None, None, None, 1e-6, True)}[case]
    torch.library.opcheck(triton_norm.norm_fwd, args)


def test_pointwise_ops_pass_opcheck():
    B, N, C = 2, 5, 24
    torch.library.opcheck(triton_pointwise.gated_residual_fwd, (_t(B, N, C), _t(B, C), _t(B, N, C)))
    ang = torch.rand(N, 4, device=DEVICE) * 6.28
    torch.library.opcheck(triton_pointwise.rope, (_t(B, 3, N, 8), ang.cos(), ang.sin(), 1.0))


def _block(kernels_on: bool):
    torch.manual_seed(0)
    blk = AdaLNZeroBlock(64, 4).to(DEVICE)
    for p in blk.adaLN_modulation.parameters():  # adaLN-Zero starts at zero: give the modulation a signal
        torch.nn.init.normal_(p, std=0.1)
    for m in blk.modules():
        if hasattr(m, "use_modulate_kernel"):
            m.use_modulate_kernel = m.use_layernorm_kernel = kernels_on
    return blk


def _run(blk, x, c, fn=None):
    """Output and grads wrt x, c and every parameter of blk; fn (default blk) is blk or its compiled twin."""
    out = (blk if fn is None else fn)(x, c)
    dout = torch.randn(out.shape, generator=torch.Generator(DEVICE).manual_seed(1), device=DEVICE)
    grads = torch.autograd.grad(out, [x, c, *blk.parameters()], dout)
    return out, grads


def _assert_same(a, b):
    out_a, grads_a = a
    out_b, grads_b = b
    torch.testing.assert_close(out_a, out_b, **FWD_TOL)
    for i, (ga, gb) in enumerate(zip(grads_a, grads_b)):
        torch.testing.assert_close(ga, gb, **GRAD_TOL, msg=lambda m: f"grad {i}: {m}")


def test_dit_block_with_kernels_has_no_graph_breaks():
    blk = _block(kernels_on=True)
    x, c = _t(2, 16, 64), _t(2, 64)
    explained = torch._dynamo.explain(blk)(x, c)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_dit_block_fullgraph_aot_eager_matches_eager():
    torch._dynamo.reset()
    blk = _block(kernels_on=True)
    x, c = _t(2, 16, 64), _t(2, 64)
    compiled = torch.compile(blk, backend="aot_eager", fullgraph=True)
    _assert_same(_run(blk, x, c, compiled), _run(blk, x, c))
    # and the fused path equals the plain PyTorch block
    _assert_same(_run(blk, x, c), _run(_block(kernels_on=False), x, c))  # same seed, same weights


def test_flux_style_norm_rope_gate_fullgraph():
    """rms_norm + apply_rope (FLUX's q/k path) and the gate, in one graph, grads equal eager."""
    torch._dynamo.reset()

    def f(x, shift, scale, gate, w, cos, sin):
        h = kernels.layernorm_modulate(x, shift, scale, use_kernel=True)
        q = kernels.rms_norm(h.view(2, 7, 3, 8).transpose(1, 2), w, use_kernel=True)  # [B, H, N, D]
        q = kernels.apply_rope(q, cos, sin, use_kernel=True)
        return kernels.gated_residual(x, gate, q.transpose(1, 2).reshape(2, 7, 24), use_kernel=True)

    ang = torch.rand(7, 4, device=DEVICE) * 6.28
    args = [_t(2, 7, 24), _t(2, 24), _t(2, 24), _t(2, 24), _t(8), ang.cos(), ang.sin()]
    leaves = args[:5]
    eager = f(*args)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(*args)
    torch.testing.assert_close(compiled, eager, **FWD_TOL)
    dout = torch.randn_like(eager)
    for a, b in zip(torch.autograd.grad(compiled, leaves, dout), torch.autograd.grad(eager, leaves, dout)):
        torch.testing.assert_close(a, b, **GRAD_TOL)


@pytest.mark.slow
def test_dit_block_fullgraph_inductor_matches_eager():
    """Inductor generates code around the opaque kernel calls (C++ on CPU: ~20 s, hence slow)."""
    torch._dynamo.reset()
    blk = _block(kernels_on=True)
    x, c = _t(2, 16, 64), _t(2, 64)
    compiled = torch.compile(blk, backend="inductor", fullgraph=True)
    _assert_same(_run(blk, x, c, compiled), _run(blk, x, c))


@pytest.mark.parametrize("probe_first", [True, False])
def test_probing_before_compile_avoids_a_recompile(monkeypatch, probe_first):
    """Dynamo guards on the optional-import cache: a first probe inside the trace costs one recompile."""
    from torch._dynamo.testing import CompileCounter
    monkeypatch.setattr(kernels, "_probed", {})
    torch._dynamo.reset()
    if probe_first:
        kernels.probe_optional_imports()
    blk, counter = _block(kernels_on=True), CompileCounter()
    compiled = torch.compile(blk, backend=counter)
    x, c = _t(2, 16, 64), _t(2, 64)
    for _ in range(3):
        compiled(x, c)
    assert counter.frame_count == (1 if probe_first else 2)
