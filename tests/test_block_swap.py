"""Block swap: outputs and gradients equal the unswapped model; swapped weights live on the host between uses."""
import copy

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from opendit.optim import BlockSwap, build_optimizer


pytestmark = pytest.mark.usefixtures("one_thread")


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2, self.norm = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d), torch.nn.LayerNorm(d)

    def forward(self, x, c):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x) * (1 + c))))


class Stack(torch.nn.Module):
    _block_lists = ("blocks", "tail")

    def __init__(self, d=16, depth=3, checkpointing=False):
        super().__init__()
        self.embed, self.cond = torch.nn.Linear(8, d), torch.nn.Linear(4, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(depth))
        self.tail = torch.nn.ModuleList([Block(d)])
        self.head = torch.nn.Linear(d, 8)
        self.checkpointing = checkpointing

    def forward(self, x, y):
        h, c = self.embed(x), self.cond(y)
        for b in list(self.blocks) + list(self.tail):
            h = checkpoint(b, h, c, use_reentrant=False) if self.checkpointing else b(h, c)
        return self.head(h)


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 7, 8, generator=g), torch.randn(5, 1, 4, generator=g)


def pair(num_blocks=3, **kw):
    torch.manual_seed(0)
    ref = Stack(**kw)
    model = copy.deepcopy(ref)
    return ref, model, BlockSwap(model, num_blocks, device="cpu")


def grads(m):
    return [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_outputs_and_gradients_equal_unswapped(checkpointing):
    ref, model, swap = pair(checkpointing=checkpointing)
    assert swap.swapped == [1, 2, 3]  # the last three of blocks + tail
    for seed in range(2):  # twice: the second pass starts from evicted blocks and accumulates gradients
        x, y = inputs(seed)
        out_ref, out = ref(x, y), model(x, y)
        assert torch.equal(out_ref, out)
        out_ref.square().mean().backward()
        out.square().mean().backward()
    for a, b in zip(grads(ref), grads(model)):
        assert torch.equal(a, b)
    assert not swap._resident  # everything is back on the host after backward


def test_weights_live_on_host_between_uses_and_device_copies_are_freed():
    ref, model, swap = pair()
    host_ptrs = {i: [h.data_ptr() for h in swap._host[i]] for i in swap.swapped}
    seen = {}

    def spy(i):
        def hook(module, args):
            w = module.fc1.weight
            assert w.data_ptr() not in host_ptrs[i]  # during use: a device copy, not the host buffer
            seen[i] = StorageWeakRef(w.untyped_storage())
        return hook

    blocks = list(model.blocks) + list(model.tail)
    for i in swap.swapped:
        blocks[i].register_forward_pre_hook(spy(i))
    out = model(*inputs())
    for i in swap.swapped:
        assert [t.data_ptr() for t in swap._slots[i]] == host_ptrs[i]  # between uses: the host buffer
        # autograd holds references, not the device copy (a Linear would otherwise save weight.t())
        assert seen[i].expired()
    assert blocks[0].fc1.weight.data_ptr() not in sum(host_ptrs.values(), [])  # an unswapped block stays
    out.sum().backward()
    for i in swap.swapped:
        assert [t.data_ptr() for t in swap._slots[i]] == host_ptrs[i]


def test_no_grad_forward_equals_and_evicts():
    ref, model, swap = pair(num_blocks=4)
    with torch.no_grad():
        assert torch.equal(ref(*inputs()), model(*inputs()))
    assert not swap._resident and not swap._aliases


@pytest.mark.parametrize("fused", [True, False])
def test_training_with_swap_equals_without(fused):
    ref, model, swap = pair()
    opts = [build_optimizer(m.parameters(), "adamw", lr=1e-2, fused_backward=fused, small_numel=64,
                            state_dtype="u16") for m in (ref, model)]
    for seed in range(3):
        for m, opt in zip((ref, model), opts):
            m(*inputs(seed)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    # the host copies hold the updated weights (refreshed after the in-hook update when fused)
    for i in swap.swapped:
        for t, h in zip(swap._slots[i], swap._host[i]):
            assert t.data_ptr() == h.data_ptr()


def test_dit_blocks_swap():
    from opendit.families import build_model
    torch.manual_seed(0)
    ref = build_model("DiT-debug", input_size=8, num_classes=10)
    for p in ref.parameters():  # adaLN-zero starts every block as the identity; make them do something
        torch.nn.init.normal_(p, std=0.05) if p.requires_grad else None
    model = copy.deepcopy(ref)
    BlockSwap(model, 1, device="cpu")
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 500]), torch.tensor([1, 7])
    torch.manual_seed(1)  # the same class-dropout draws in both
    a = ref(x, t, y)
    torch.manual_seed(1)
    b = model(x, t, y)
    assert torch.equal(a, b)
    a.square().mean().backward()
    b.square().mean().backward()
    for p, q in zip(ref.parameters(), model.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="_block_lists"):
        BlockSwap(torch.nn.Linear(2, 2), 1, device="cpu")
    with pytest.raises(ValueError, match="between 0 and"):
        BlockSwap(Stack(), 9, device="cpu")


@pytest.mark.gpu
def test_cuda_swap_with_fused_adamw_equals_unswapped():
    torch.manual_seed(0)
    ref = Stack().cuda()
    model = copy.deepcopy(ref).cpu()
    swap = BlockSwap(model, 3, device="cuda")
    assert all(h.is_pinned() for i in swap.swapped for h in swap._host[i])
    opts = [build_optimizer(m.parameters(), "adamw", lr=1e-2, fused_backward=True) for m in (ref, model)]
    for seed in range(3):
        x, y = (t.cuda() for t in inputs(seed))
        for m, opt in zip((ref, model), opts):
            m(x, y).square().mean().backward()
            opt.step()
    torch.cuda.synchronize()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.cpu(), b.cpu())
    assert all(t.device.type == "cpu" for i in swap.swapped for t in swap._slots[i])
