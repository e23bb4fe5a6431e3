"""--base_dtype fp8: a LoRA run's frozen Linear weights in float8_e4m3fn with a scale per output row, upcast layer
by layer. The fp8 layer computes exactly what a layer holding the upcast weight computes (forward and every
gradient), autograd keeps the 1-byte weight for backward (no upcast copy), the model's outputs stay within a
stated error of the bf16 base's, and runs train, resume exactly and refuse what they cannot do."""
import re

import numpy as np
import pytest
import torch
import torch.nn as nn

from opendit.lora.layer import FP8, add_lora, dequantize_fp8, quantize_fp8, quantize_frozen_linears
from tests.test_lora_train import build_trainer, checkpoint_of, lora_cfg, run_trainer
from tests.test_train import _run
from tests.test_lora_train import base  # noqa: F401  (the module fixture: a trained DiT-debug's weights)


def _adapted(seed=0, out=48, inp=32, dtype=torch.float32):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(inp, out), nn.GELU(), nn.Linear(out, 16)).to(dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    add_lora(model, rank=4, alpha=4.0, targets=r"\d")
    for m in model.modules():
        if hasattr(m, "lora_B"):
            nn.init.normal_(m.lora_B[0], std=0.1)
    for p in model.parameters():
        p.data = p.data.to(dtype)  # the adapters too
    return model


def test_rows_round_to_e4m3_with_their_own_scale():
    w = torch.randn(64, 40) * torch.logspace(-3, 2, 64)[:, None]  # rows of very different magnitudes
    w[5] = 0
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8 and scale.shape == (64,) and scale[5] == 1
    back = dequantize_fp8(q, scale, torch.float32)
    rel = ((back - w).abs() / w.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)).amax()
    assert rel <= 2 ** -4  # e4m3 keeps 3 mantissa bits: half a unit of the last place, relative to the row's max
    assert torch.equal(back[5], torch.zeros(40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_layer_equals_the_layer_holding_its_upcast_weight_in_forward_and_backward(dtype):
    fp8, plain = _adapted(dtype=dtype), _adapted(dtype=dtype)
    assert quantize_frozen_linears([fp8]) == 2 and fp8[0].weight.dtype == FP8
    for a, b in zip(fp8, plain):
        if hasattr(a, "lora_A"):
            b.weight.data = dequantize_fp8(a.weight, a.weight_scale, dtype)
    x = torch.randn(8, 32, dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = fp8(xa), plain(xb)
    assert torch.equal(ya, yb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    for (name, pa), pb in zip(fp8.named_parameters(), plain.parameters()):
        if pa.requires_grad:
            assert torch.equal(pa.grad, pb.grad), name


@pytest.mark.gpu
def test_on_cuda_the_fp8_layer_equals_its_upcast_weight_and_compiles():
    fp8, plain = _adapted(dtype=torch.bfloat16, out=1024, inp=512), _adapted(dtype=torch.bfloat16, out=1024, inp=512)
    quantize_frozen_linears([fp8])
    for a, b in zip(fp8, plain):
        if hasattr(a, "lora_A"):
            b.weight.data = dequantize_fp8(a.weight, a.weight_scale, torch.bfloat16)
    fp8.cuda(), plain.cuda()
    assert fp8[0].weight.dtype == FP8 and fp8[0].weight.is_cuda
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    eager = fp8(x)
    assert torch.equal(eager, plain(x))
    torch.testing.assert_close(torch.compile(fp8)(x), eager, atol=1e-2, rtol=1e-2)


def test_autograd_keeps_the_one_byte_weight_not_an_upcast_copy():
    model = _adapted(out=256, inp=256)
    quantize_frozen_linears([model])
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        model(torch.randn(4, 256, requires_grad=True)).sum().backward()
    weights = [t for t in kept if t.numel() in (256 * 256, 16 * 256)]
    assert len(weights) == 2 and all(t.dtype == FP8 for t in weights)


def test_outputs_stay_close_to_the_bf16_base(tmp_path, base, capsys):  # noqa: F811
    """The trained DiT-debug with zero adapters: its output with the fp8 base against the bf16 base (reported)."""
    bf16 = build_trainer(lora_cfg(tmp_path / "a", base[0], mixed_precision="bf16"))
    fp8 = build_trainer(lora_cfg(tmp_path / "b", base[0], mixed_precision="bf16", base_dtype="fp8"))
    ma, mb = (t.booster.unwrap(t.model).eval() for t in (bf16, fp8))
    assert {p.dtype for p in mb.parameters() if not p.requires_grad} >= {FP8}
    torch.manual_seed(0)
    x, t, y = torch.randn(8, *ma.x_embedder.proj.weight.shape[1:2], 8, 8), torch.rand(8) * 999, torch.arange(8)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        a, b = ma(x, t, y).float(), mb(x, t, y).float()
    rel = ((a - b).norm() / a.norm()).item()
    with capsys.disabled():
        print(f"\nfp8 base against bf16 base, DiT-debug output: relative L2 error {rel:.4f}")
    assert 0 < rel < 0.05


def test_an_fp8_lora_run_trains_and_resumes_exactly(tmp_path, base):  # noqa: F811
    _, full = run_trainer(lora_cfg(tmp_path / "a", base[0], base_dtype="fp8", max_steps=6, ckpt_every=3))
    trainer, _ = run_trainer(lora_cfg(tmp_path / "b", base[0], base_dtype="fp8", max_steps=3, ckpt_every=3))
    _, resumed = run_trainer(lora_cfg(tmp_path / "b", base[0], base_dtype="fp8", max_steps=6, ckpt_every=3,
                                      load="latest"))
    assert resumed == full[3:] and all(np.isfinite(full))
    model = trainer.booster.unwrap(trainer.model)
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)  # adapters
    ckpt = checkpoint_of(tmp_path / "b", 3)
    assert (ckpt / "lora.safetensors").is_file()  # the adapters export as from any LoRA run


@pytest.mark.slow
def test_two_ranks_train_on_an_fp8_base_under_ddp(tmp_path, base):  # noqa: F811
    """DDP broadcasts no float8 tensor (no collective takes one): every rank quantizes the same file."""
    out = _run(["train.py", "--model", "DiT-debug", "--image_size", "8", "--batch_size", "8", "--max_steps", "2",
                "--num_workers", "0", "--init_weights", base[0], "--lora_rank", "4", "--base_dtype", "fp8",
                "--outputs", str(tmp_path / "out")], nproc=2)
    assert "stored in fp8" in out.stderr
    assert (checkpoint_of(tmp_path / "out", 2) / "lora.safetensors").is_file()


@pytest.mark.parametrize("overrides, match", [
    (dict(base_dtype="fp8"), "--base_dtype fp8 stores frozen base weights, never trained ones: add --lora_rank"),
    (dict(base_dtype="fp8", lora_rank=4, init_weights="x", plugin="zero2"),
     "--base_dtype fp8 with --plugin zero2: the sharding plugins keep one dtype per sharded group; use --plugin ddp"),
])
def test_fp8_is_refused_where_it_cannot_work(tmp_path, overrides, match):
    from tests.test_train import tiny_cfg

    with pytest.raises(ValueError, match=re.escape(match)):
        run_trainer(tiny_cfg(tmp_path, **overrides))
    assert not any(tmp_path.iterdir())
