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
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from opendit.families.dit.model import DiT
from opendit.models.layers import Attention
from opendit.parallel import CommCounter, SequenceParallel, broadcast_from_first, enable_sequence_parallel
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

    enable_sequence_parallel(model, group, kind)
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


def _dataset(n=12):
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 4, 6, 6, generator=g), torch.randint(0, 1000, (n,), generator=g),
                         torch.randint(0, 10, (n,), generator=g), torch.randn(n, 8, 6, 6, generator=g))


def _train(plugin, kind, steps):
    """Booster with sp_size=2 on 4 ranks (DP 2 x SP 2) next to a single-process DP-only run of the same batches.

    SGD, not Adam: Adam divides by sqrt(v), so a gradient that is zero in exact arithmetic (the key bias:
    softmax ignores a constant added to every score of a row) turns its ~1e-9 rounding noise into lr-sized
    steps that differ between any two summation orders. SGD keeps differences at rounding level.
    """
    from opendit.booster import Booster, build_plugin
    from opendit.data import build_dataloader

    booster = Booster(build_plugin(plugin, sp_size=2))
    model = _random_dit(6)  # 9 tokens: padded under SP = 2
    ref = copy.deepcopy(model)
    enable_sequence_parallel(model, booster.sp_group, kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(_dataset(), batch_size=4, shuffle=True)  # global batch 4: 2 samples per DP rank
    model, opt, loader, _ = booster.boost(model, opt, dataloader=loader, data_seed=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    ref_loader = build_dataloader(_dataset(), 4, dp_size=1, dp_rank=0, seed=0)  # the same global batches
    losses, ref_losses = [], []
    for (x, t, y, target), (rx, rt, ry, rtarget) in zip(loader, ref_loader):
        seen = [torch.empty_like(x) for _ in range(2)]
        dist.all_gather(seen, x, group=booster.sp_group)
        assert torch.equal(seen[0], seen[1]), "the two SP ranks of a group got different samples"
        loss = F.mse_loss(model(x, t, y), target)
        booster.backward(loss, opt)
        booster.step(opt)
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        losses.append(logged.item() / dist.get_world_size())

        ref_loss = F.mse_loss(ref(rx, rt, ry), rtarget)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
        if len(losses) == steps:
            break
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            for n, p in booster.unwrap(model).named_parameters()}
    return losses, ref_losses, full, {n: p.detach() for n, p in ref.named_parameters()}


def _dp_sp_worker(rank, world_size, cases, steps):
    return {case: _train(*case, steps) for case in cases}


@pytest.mark.slow
def test_dp2_sp2_training_through_the_booster_equals_dp_only():
    """zero2 shards over dp_shard x sp flattened and averages over all 4 ranks; ddp averages over the world."""
    cases = [("zero2", "fastseq"), ("ddp", "ulysses")]
    results = run_distributed(_dp_sp_worker, 4, cases, 3)
    for case in cases:
        losses, ref_losses, params, ref_params = results[0][case]
        assert all(r[case][0] == losses for r in results)
        assert losses[0] != losses[-1]  # the steps moved the weights
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{case} losses {losses} vs DP-only {ref_losses}: {m}")
        for n in ref_params:
            torch.testing.assert_close(params[n], ref_params[n], **GRAD_TOL, msg=lambda m: f"{case} {n}: {m}")
