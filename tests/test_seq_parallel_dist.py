"""Sequence parallelism on spawned gloo groups: every result equals the single-process one.

Tolerances (fp32): outputs atol 1e-5, gradients atol 2e-5 / rtol 1e-4. SP changes only the order of
floating-point sums (a weight gradient is summed from P partial token ranges; the input gradient of FastSeq from
P head groups), so differences are a few ulps of the values (~1e-6 measured); a real bug (a missing 1/P or P,
a wrong head or token order, a leaked pad token) is off by O(1) relative.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from opendit.models.dit import DiT
from opendit.models.layers import Attention
from opendit.parallel import CommCounter, SequenceParallel, broadcast_from_first
from tests.distributed import run_distributed

KINDS = ("fastseq", "ulysses")
OUT_TOL = dict(atol=1e-5, rtol=1e-5)
GRAD_TOL = dict(atol=2e-5, rtol=1e-4)


def _attention_case(group, N, kind):
    """Attention on this rank's chunk with a distributed upstream gradient; returns full-size results."""
    torch.manual_seed(0)
    attn = Attention(32, 4)
    x, dy = torch.randn(2, N, 32, requires_grad=True), torch.randn(2, N, 32)
    y_ref = attn(x)
    y_ref.backward(dy)
    ref = {"out": y_ref.detach(), "x": x.grad, **{n: p.grad for n, p in attn.named_parameters()}}

    attn.zero_grad()
    counter = CommCounter()
    sp = attn.sequence_parallel = SequenceParallel(group, kind, counter)
    xs = x.detach().clone().requires_grad_()
    y = attn(sp.split(xs))  # [B, ceil(N/P), D]
    y.backward(sp.split(dy))  # each rank owns the gradient of its own tokens (zero-padded)
    got = {"out": sp.gather(y.detach()), "x": xs.grad, **{n: p.grad for n, p in attn.named_parameters()}}
    for k in got:
        if k != "out":  # partial sums over token ranges (weights) or head groups (x), summed over the group
            dist.all_reduce(got[k], group=group)
    return got, ref, dict(counter.bytes)


def _random_dit(input_size):
    torch.manual_seed(0)
    model = DiT(input_size=input_size, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=4,
                num_classes=10, class_dropout_prob=0.0)  # label dropout draws random numbers: keep them out
    with torch.no_grad():  # break adaLN-Zero's identity init so every path carries signal
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    return model


def _dit_case(group, input_size, kind, checkpoint=False):
    """A whole DiT forward/backward with the same (replicated) loss on every rank of the group.

    checkpoint: wrap the blocks in activation checkpointing, whose recompute re-runs the collectives.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _random_dit(input_size)
    torch.manual_seed(1)
    x, t, y = torch.randn(2, 4, input_size, input_size), torch.randint(0, 1000, (2,)), torch.tensor([3, 7])
    target = torch.randn(2, 8, input_size, input_size)
    ref_model = copy.deepcopy(model)
    ref_out = ref_model(x, t, y)
    ((ref_out - target) ** 2).mean().backward()

    model.enable_sequence_parallel(group, kind)
    if checkpoint:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    out = model(x, t, y)
    ((out - target) ** 2).mean().backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
             for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():
        dist.all_reduce(g, group=group)  # the SUM over the group; the test checks SUM / P == unsplit
    ref = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
    return out.detach(), ref_out.detach(), grads, ref


def _sp_worker(rank, world_size):
    group = dist.group.WORLD
    res = {"attn": {}, "dit": {}, "noise": broadcast_from_first(torch.randn(3) + rank, group)}
    for kind in KINDS:
        for N in (16, 9):  # 9: not divisible by P = 2 or 4, exercises padding and key masking
            res["attn"][kind, N] = _attention_case(group, N, kind)
        for size in (8, 6):  # 16 and 9 tokens
            res["dit"][kind, size] = _dit_case(group, size, kind)
        res["dit"][kind, "6+AC"] = _dit_case(group, 6, kind, checkpoint=True)
    return res


@pytest.mark.slow
@pytest.mark.parametrize("P", [2, 4])
def test_sp_attention_and_dit_equal_single_process(P):
    results = run_distributed(_sp_worker, P)
    for rank, res in enumerate(results):
        assert torch.equal(res["noise"], results[0]["noise"])
        for (kind, N), (got, ref, sent) in res["attn"].items():
            where = f"attention {kind} P={P} N={N} rank {rank}"
            torch.testing.assert_close(got["out"], ref["out"], **OUT_TOL, msg=lambda m: f"{where} output: {m}")
            for k in ("x", "qkv.weight", "qkv.bias", "proj.weight", "proj.bias"):
                torch.testing.assert_close(got[k], ref[k], **GRAD_TOL, msg=lambda m: f"{where} grad {k}: {m}")
            # Bytes sent per rank for one layer (fwd + bwd), from the tensor sizes: B=2, D=32, fp32.
            bnd = 2 * (-(-N // P) * P) * 32 * 4
            expected = {"fastseq": 2 * ((P - 1) * bnd // P + (P - 1) * bnd // P ** 2),
                        "ulysses": 2 * 4 * (P - 1) * bnd // P ** 2}[kind]
            assert sum(v for k, v in sent.items() if k.startswith(kind)) == expected, (where, sent)
        for (kind, size), (out, ref_out, grads, ref) in res["dit"].items():
            where = f"DiT {kind} P={P} input {size} rank {rank}"
            torch.testing.assert_close(out, ref_out, **OUT_TOL, msg=lambda m: f"{where} output: {m}")
            assert grads.keys() == ref.keys()
            for n in ref:
                # Every rank's loss is the whole sample's loss, so the group MEAN of the gradients is the unsplit
                # gradient (OpenDiT's first release gave 1/P of it; a sum-convention bug would give P times).
                torch.testing.assert_close(grads[n] / P, ref[n], **GRAD_TOL, msg=lambda m: f"{where} {n}: {m}")


def _train(rank, world_size, sp_size, kind, steps):
    """FSDP over all ranks (DP x SP), SP groups from a (dp, sp) mesh; returns per-step global losses.

    SGD, not Adam: Adam divides by sqrt(v), so a gradient that is zero in exact arithmetic (the key bias:
    softmax ignores a constant added to every score of a row) turns its ~1e-9 rounding noise into lr-sized
    steps that differ between any two summation orders. SGD keeps differences at rounding level.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dp_size = world_size // sp_size
    mesh = init_device_mesh("cpu", (dp_size, sp_size), mesh_dim_names=("dp", "sp"))
    dp_rank = mesh.get_local_rank("dp")
    model = _random_dit(6)  # 9 tokens: padded under SP = 2
    ref = copy.deepcopy(model)
    model.enable_sequence_parallel(mesh["sp"].get_group(), kind)
    world_mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=world_mesh)
    fully_shard(model, mesh=world_mesh)  # gradients are averaged over all DP x SP ranks, unscaled
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    per_dp, batch = 2, 2 * dp_size
    losses, ref_losses = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)  # the global batch of this step, identical everywhere
        x, target = torch.randn(batch, 4, 6, 6, generator=g), torch.randn(batch, 8, 6, 6, generator=g)
        t, y = torch.randint(0, 1000, (batch,), generator=g), torch.randint(0, 10, (batch,), generator=g)
        mine = slice(dp_rank * per_dp, (dp_rank + 1) * per_dp)  # every rank of one SP group: the same samples
        loss = ((model(x[mine], t[mine], y[mine]) - target[mine]) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        losses.append(logged.item() / world_size)

        ref_loss = ((ref(x, t, y) - target) ** 2).mean()  # the single-process DP-only baseline
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    params = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    return losses, ref_losses, params, {n: p.detach() for n, p in ref.named_parameters()}


def _dp_sp_worker(rank, world_size, sp_size, steps):
    return {kind: _train(rank, world_size, sp_size, kind, steps) for kind in KINDS}


@pytest.mark.slow
def test_dp2_sp2_training_equals_dp_only():
    results = run_distributed(_dp_sp_worker, 4, 2, 3)
    for kind in KINDS:
        losses, ref_losses, params, ref_params = results[0][kind]
        assert all(r[kind][0] == losses for r in results)
        assert losses[0] != losses[-1]  # the steps moved the weights
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{kind} losses {losses} vs DP-only {ref_losses}: {m}")
        for n in ref_params:
            torch.testing.assert_close(params[n], ref_params[n], **GRAD_TOL, msg=lambda m: f"{kind} {n}: {m}")
