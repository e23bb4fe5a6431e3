"""LoRA adapters on Linear layers (opendit.lora.layer): the math, each family's default targets, merging, and the
memory / step benchmarks' plumbing."""
import re

import pytest
import torch
import torch.nn as nn

from opendit.families import FAMILIES
from opendit.lora import (Adapter, LoRALinear, add_lora, attach_adapters, cast_frozen_linears, linear_names,
                          lora_modules, merge_adapters, trained_adapters)
from opendit.models.layers import linear_weight
from tests.run_each import cli
from tests.test_flux_model import flux_inputs, tiny_flux


def _randomize_adapters(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            for B in m.lora_B:
                B.copy_(0.1 * torch.randn(B.shape, generator=g))


@torch.no_grad()
def test_fresh_adapters_leave_the_output_and_only_adapters_train():
    model, inp = tiny_flux(), flux_inputs()
    before = model(**inp)
    names = add_lora(model, 4, 8.0, FAMILIES["flux"].lora_targets)
    # 4 per stream per double block (qkv, proj, mlp.0, mlp.2) x 2 streams, 2 per single block
    assert len(names) == 8 * 1 + 2 * 1 and all(isinstance(m, LoRALinear) for m in lora_modules(model).values())
    # B = 0: the base model (to rounding: two calls of the same matmul may round differently with 2 threads,
    # as MKL does not promise bitwise reproducibility across buffer alignments)
    torch.testing.assert_close(model(**inp), before, atol=1e-5, rtol=1e-5)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(re.search(r"\.lora_[AB]\.0$", n) for n in trainable)
    assert all(k in model.state_dict() for k in ("double_blocks.0.img_attn.qkv.weight",
                                                   "double_blocks.0.img_attn.qkv.lora_A.0"))
    m = lora_modules(model)["single_blocks.0.linear1"]
    assert m.lora_scale == [2.0] and m.lora_A[0].shape == (4, 32) and m.lora_B[0].shape == (m.out_features, 4)


def test_adapter_math_merged_weight_and_merge():
    torch.manual_seed(0)
    lin = nn.Linear(6, 5)
    x = torch.randn(3, 6)
    add_lora(nn.Sequential(lin), 2, 3.0, "0")
    _randomize_adapters(lin)
    a = trained_adapters(nn.Sequential(lin))["0"]
    expected = x @ (lin.weight + 1.5 * lin.lora_B[0] @ lin.lora_A[0]).T + lin.bias
    torch.testing.assert_close(lin(x), expected)
    torch.testing.assert_close(x @ linear_weight(lin).T + lin.bias, expected)
    torch.testing.assert_close(a.delta(), 1.5 * lin.lora_B[0].detach() @ lin.lora_A[0].detach())
    # a second, frozen adapter at strength 0.5 adds its own delta; merging folds both and restores nn.Linear
    extra = Adapter(torch.randn(3, 6), torch.randn(5, 3), alpha=6.0)
    attach_adapters(nn.Sequential(lin), {"0": extra}, strength=0.5)
    both = expected + 0.5 * x @ extra.delta().T
    torch.testing.assert_close(lin(x), both)
    assert [p.requires_grad for p in lin.lora_A] == [True, False]
    merge_adapters(nn.Sequential(lin))
    assert type(lin) is nn.Linear and set(lin.state_dict()) == {"weight", "bias"}
    torch.testing.assert_close(lin(x), both, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family,model,kwargs,per_block", [
    ("dit", "DiT-debug", dict(input_size=8, in_channels=4, num_classes=10), {"blocks": 4}),
    ("video", "Latte-debug", {}, {"blocks": 4}),
    ("flux", "flux-debug", {}, {"double_blocks": 8, "single_blocks": 2}),
    ("wan", "Wan-debug", {}, {"blocks": 10}),
])
def test_default_targets_adapt_attention_and_mlp_of_every_block(family, model, kwargs, per_block):
    with torch.device("meta"):
        net = FAMILIES[family].models[model].build(**kwargs)
    names = add_lora(net, 2, None, FAMILIES[family].lora_targets)
    for blocks, count in per_block.items():
        n = len(getattr(net, blocks))
        assert sum(x.startswith(blocks + ".") for x in names) == count * n, (blocks, names)
    assert not any("adaLN" in x or "modulation" in x or "embed" in x for x in names)  # modulations stay frozen


def test_bad_targets_and_ranks_are_named():
    model = tiny_flux()
    with pytest.raises(ValueError, match=r"matches none of the model's .* Linear layers .*double_blocks"):
        add_lora(model, 4, None, "blocks.*attn")
    with pytest.raises(ValueError, match="not a regular expression"):
        add_lora(model, 4, None, "(")
    with pytest.raises(ValueError, match="--lora_rank 0"):
        add_lora(model, 0, None, ".*")
    with pytest.raises(ValueError, match="not Linear layers of this model"):
        attach_adapters(model, {"double_blocks.0.nope": Adapter(torch.zeros(1, 2), torch.zeros(2, 1), 1.0)})
    with pytest.raises(ValueError, match="for another model size"):
        attach_adapters(model, {"img_in": Adapter(torch.zeros(1, 3), torch.zeros(32, 1), 1.0)})


def test_frozen_linears_are_stored_in_the_compute_dtype():
    model = tiny_flux()
    add_lora(model, 2, None, FAMILIES["flux"].lora_targets)
    assert cast_frozen_linears(model, torch.bfloat16) == 2 * len(linear_names(model))  # every weight and bias
    assert {p.dtype for n, p in model.named_parameters() if ".lora_" in n} == {torch.float32}
    assert model.img_in.weight.dtype == torch.bfloat16


def test_memory_plan_and_step_benchmark_run_on_cpu(tmp_path):
    out = tmp_path / "step.md"
    cli("benchmarks/lora_step.py", "--steps", "2", "--batch_size", "8", "--work", tmp_path / "work", "--out", out)
    rows = [r.split("|") for r in out.read_text().splitlines() if r.startswith("| ") and "s/step" not in r]
    assert [r[1].strip() for r in rows] == ["full fine-tune", "LoRA rank 8", "LoRA / full"]
    assert 0 < float(rows[2][3]) < 0.2 and 0 < float(rows[2][5]) < 0.5  # few trainable params, a small checkpoint


def test_compiled_blocks_with_adapters_equal_eager():
    from opendit.booster.parallelize import apply_compile

    inp = flux_inputs()
    outs = []
    for compiled in (False, True):
        model = tiny_flux()
        add_lora(model, 2, None, FAMILIES["flux"].lora_targets, dropout=0.0)
        _randomize_adapters(model)
        if compiled:
            apply_compile(model, backend="aot_eager")  # train.py --compile's per-block compile (inductor there)
        out = model(**inp)
        out.square().mean().backward()
        outs.append((out.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-6, rtol=1e-5)
    assert outs[1][1].keys() == outs[0][1].keys() and len(outs[0][1]) == 2 * 10
    for name, grad in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], grad, atol=1e-6, rtol=1e-5, msg=name)
