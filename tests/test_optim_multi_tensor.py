"""opendit AdamW runs torch's fused AdamW kernel: bitwise torch.optim.AdamW(fused=True); its multi-tensor
step equals its per-parameter step bit for bit in every master mode; fp32_copy equals bf16_exact."""
import pytest
import torch

import opendit.optim.adam as adam
from opendit.optim import build_optimizer, join_bf16
from tests.test_optim import batches, flat, tiny, train

pytestmark = pytest.mark.usefixtures("one_thread")


def bits(t):
    return t.detach().view(torch.int16 if t.element_size() == 2 else torch.int32)


def test_adamw_equals_torch_fused_adamw_bitwise():
    data = batches(20)
    ref = train(m := tiny(), torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1,
                                               fused=True), data)
    for multi_tensor in (True, False):
        opt = build_optimizer((m := tiny()).parameters(), "adamw", lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)
        opt.multi_tensor = multi_tensor
        assert torch.equal(bits(flat(train(m, opt, data))), bits(flat(ref)))


def train_skipping(model, opt, data, skip_every=3):
    """Like train(), but the first layer gets no gradient every `skip_every` steps: step counts then differ
    between parameters, so one optimizer step holds several (device, step) buckets."""
    dtype = next(model.parameters()).dtype
    first = list(model[0].parameters())
    for i, (x, y) in enumerate(data):
        (model(x.to(dtype)).float() - y).square().mean().backward()
        if i % skip_every == 1:
            for p in first:
                p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("master", ["fp32", "fp32_copy", "bf16_exact", "bf16_stochastic"])
def test_multi_tensor_step_equals_per_parameter_step_bitwise(master, monkeypatch):
    monkeypatch.setattr(adam, "CHUNK_NUMEL", 3000)  # several fused calls per bucket
    dtype = torch.float32 if master == "fp32" else torch.bfloat16
    data, runs = batches(12), []
    for multi_tensor in (True, False):
        m = tiny(dtype)
        opt = build_optimizer(m.parameters(), "adamw", lr=1e-3, weight_decay=0.01, master_weights=master, seed=3)
        opt.multi_tensor = multi_tensor
        assert opt.multi_tensor_ready() == multi_tensor
        runs.append((train_skipping(m, opt, data), opt))
    (a, opt_a), (b, opt_b) = runs
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(bits(pa), bits(pb))
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys() and all(torch.equal(bits(sa[k]), bits(sb[k])) for k in sa)
    steps = {int(opt_a.state[p]["step"]) for p in a.parameters()}
    assert steps == {12, 8}  # the skipping really made two step counts


def test_fp32_copy_equals_bf16_exact_bitwise():
    data = batches(20)
    a, b = tiny(torch.bfloat16), tiny(torch.bfloat16)
    opt_a = build_optimizer(a.parameters(), "adamw", lr=1e-3, weight_decay=0.01, master_weights="fp32_copy")
    opt_b = build_optimizer(b.parameters(), "adamw", lr=1e-3, weight_decay=0.01, master_weights="bf16_exact")
    train(a, opt_a, data)
    train(b, opt_b, data)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(bits(pa), bits(pb))
        assert torch.equal(bits(opt_a.state[pa]["master"]), bits(join_bf16(pb.detach(), opt_b.state[pb]["master_lo"])))


def test_fp32_copy_refuses_fp32_parameters():
    with pytest.raises(ValueError, match="cast the model to torch.bfloat16"):
        build_optimizer([torch.nn.Parameter(torch.zeros(3))], "adamw", master_weights="fp32_copy")


def test_fused_kernel_on_non_contiguous_states_updates_the_right_elements():
    # torch's kernel treats each tensor as flat memory; fused_adamw_ must hand it dense copies
    g = torch.randn(4, 6)
    dense = [torch.zeros(4, 6), torch.zeros(4, 6), torch.zeros(4, 6)]
    padded = [torch.zeros(4, 8)[:, :6] for _ in range(3)]
    for w, m, v in (dense, padded):
        adam.fused_adamw_([w], [g], [m], [v], 1, 0.1, 0.9, 0.999, 1e-8, 0.01)
    for d, p in zip(dense, padded):
        assert not p.is_contiguous() and torch.equal(d, p)


def test_fused_update_bumps_the_version_counter():
    # torch's kernel does not; block swap relies on it to see that a weight changed inside backward
    w = torch.zeros(5)
    before = w._version
    adam.fused_adamw_([w], [torch.ones(5)], [torch.zeros(5)], [torch.zeros(5)], 1, 0.1, 0.9, 0.999, 1e-8, 0.0)
    assert w._version > before and not torch.equal(w, torch.zeros(5))


@pytest.mark.gpu
@pytest.mark.parametrize("master", ["fp32", "fp32_copy"])
def test_cuda_multi_tensor_step_equals_torch_fused_and_per_parameter(master):
    """On CUDA: one multi-tensor call == per-parameter calls == torch.optim.AdamW(fused=True) (fp32 params)."""
    dtype = torch.float32 if master == "fp32" else torch.bfloat16
    data = [(x.cuda(), y.cuda()) for x, y in batches(10)]
    runs = []
    for multi_tensor in (True, False):
        m = tiny(dtype).cuda()
        opt = build_optimizer(m.parameters(), "adamw", lr=1e-3, weight_decay=0.01, master_weights=master)
        opt.multi_tensor = multi_tensor
        runs.append(flat(train_skipping(m, opt, data)))
    assert torch.equal(bits(runs[0]), bits(runs[1]))
    if master == "fp32":
        ref = tiny().cuda()
        train_skipping(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, fused=True), data)
        assert torch.equal(bits(runs[0]), bits(flat(ref)))
