"""Fused backward pass: updates in post-accumulate-grad hooks equal a normal optimizer step."""
import pytest
import torch

from opendit.optim import attach_fused_backward, build_optimizer
from tests.test_optim import batches, flat, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def run(fused, name="adamw", dtype=torch.float32, steps=6, **kw):
    m = tiny(dtype)
    opt = build_optimizer(m.parameters(), name, lr=1e-3, weight_decay=0.01, fused_backward=fused, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for x, y in batches(steps):
        (m(x.to(dtype)).float() - y).square().mean().backward()
        if fused:
            assert all(p.grad is None for p in m.parameters())  # freed inside the hooks
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return m, opt


@pytest.mark.parametrize("name,kw", [
    ("adamw", {}),
    ("nadamw", {}),
    ("adan", {}),
    ("adamw", {"state_dtype": "u16", "state_device": "cpu", "small_numel": 256}),
    ("adan", {"state_dtype": "f24", "state_device": "cpu", "small_numel": 256}),
    ("adamw", {"dtype": torch.bfloat16, "master_weights": "bf16_exact", "state_device": "cpu"}),
    ("adamw", {"per_tensor_clip": 0.05}),
])
def test_fused_equals_step(name, kw):
    a, _ = run(False, name, **kw)
    b, _ = run(True, name, **kw)
    assert torch.equal(flat(a), flat(b))
    assert not torch.equal(flat(a), flat(tiny(kw.get("dtype", torch.float32))))


def test_clip_changes_the_result():
    a, _ = run(True, per_tensor_clip=0.05)
    b, _ = run(True)
    assert not torch.equal(flat(a), flat(b))


def test_hook_order_drives_prefetch():
    m, opt = run(True, state_device="cpu", steps=3)
    fused = opt._fused
    params = [p for p in m.parameters()]
    assert sorted(fused.order) == sorted(id(p) for p in params)
    # backward reaches the last layer first
    assert fused.order.index(id(m[3].weight)) < fused.order.index(id(m[0].weight))


def test_accumulation_is_refused():
    m = tiny()
    with pytest.raises(ValueError, match="grad_accum_steps=1"):
        build_optimizer(m.parameters(), "adamw", fused_backward=True, grad_accum_steps=4)
    with pytest.raises(ValueError, match="opendit's optimizers"):
        attach_fused_backward(torch.optim.SGD(m.parameters(), lr=0.1))


def test_remove_restores_normal_steps():
    m = tiny()
    opt = build_optimizer(m.parameters(), "adamw", lr=1e-3, fused_backward=True)
    opt._fused.remove()
    x, y = batches(1)[0]
    (m(x) - y).square().mean().backward()
    assert all(p.grad is not None for p in m.parameters())
    before = flat(m)
    opt.step()
    assert not torch.equal(before, flat(m))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["adamw", "adan"])
def test_cuda_offloaded_fused_equals_on_device_step(name):
    # side-stream prefetch / write-back against states that never leave the device
    def run_cuda(fused, state_device):
        torch.manual_seed(0)
        m = tiny(torch.bfloat16).cuda()
        opt = build_optimizer(m.parameters(), name, lr=1e-3, state_dtype="u16", master_weights="bf16_exact",
                              state_device=state_device, fused_backward=fused, small_numel=256)
        for x, y in batches(5):
            (m(x.cuda().bfloat16()).float() - y.cuda()).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return m, opt

    a, _ = run_cuda(False, "gpu")
    b, opt = run_cuda(True, "cpu")
    assert torch.equal(flat(a), flat(b))
    st = opt.state[b[0].weight]
    assert st["exp_avg.u16"].device.type == "cpu" and st["exp_avg.u16"].is_pinned()
