"""Sequence parallelism of the Wan transformer (opendit.families.wan.model) on spawned gloo groups of 2 and 4 ranks.

The tiny random model of test_wan_model.py on 27 video tokens (a 3x3x3 patch grid: divisible by neither 2 nor 4,
so the last rank's chunk is padded) gives the unsplit output and gradients, for FastSeq and Ulysses, with and
without activation-checkpointed blocks (whose recompute re-runs the collectives): the q/k RMSNorm spans all heads,
which Ulysses computes on its chunk before the all-to-all and FastSeq from the group's sums of squares. The list
forward of equal-sized samples with different grids (per-sample RoPE) matches too, and so do Wan2.2's per-token
timesteps. Bytes per self-attention layer
equal opendit.parallel.comm_bytes_per_layer; FastSeq's norm adds one [B, L] all-gather per norm. Tolerances as
in test_seq_parallel_dist.py.
"""
import copy

import pytest
import torch
import torch.distributed as dist

from opendit.parallel import CommCounter, comm_bytes_per_layer, enable_sequence_parallel, padded_len
from tests.distributed import run_distributed
from tests.test_seq_parallel_dist import GRAD_TOL, KINDS, OUT_TOL
from tests.test_wan_model import TINY, tiny_wan

B, N = 2, 27


def _inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, TINY["in_dim"], 3, 6, 6, generator=g)  # (3, 3, 3) patches
    context = torch.randn(B, TINY["text_len"], TINY["text_dim"], generator=g)
    return x, torch.tensor([7.0, 640.0]), context, torch.randn(B, TINY["out_dim"], 3, 6, 6, generator=g)


def _run(model, x, t, context, target):
    x, context = x.clone().requires_grad_(), context.clone().requires_grad_()
    out = model(x, t, context)
    ((out - target) ** 2).mean().backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
    return out.detach(), {**grads, "x": x.grad, "context": context.grad}


def _case(group, kind, checkpoint):
    """Unsplit vs split forward/backward of the whole model; the same (replicated) loss on every rank. checkpoint
    "per-token": Wan2.2's per-token timesteps instead (the first latent frame's 9 tokens at t = 0, as TI2V's clean
    first frame), whose modulation rows are split with their tokens."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model, inp = tiny_wan(), _inputs()
    if checkpoint == "per-token":
        x, t, context, target = inp
        per_token = t[:, None].repeat(1, N)
        per_token[:, :9] = 0
        inp, checkpoint = (x, per_token, context, target), False
    ref = _run(copy.deepcopy(model), *inp)
    counter = CommCounter()
    enable_sequence_parallel(model, group, kind, counter)
    if checkpoint:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    out, grads = _run(model, *inp)
    for g in grads.values():
        dist.all_reduce(g, group=group)  # the SUM over the group; the test checks SUM / P == unsplit
    return (out, grads), ref, dict(counter.bytes)


@torch.no_grad()
def _list_case(group, kind):
    """Two samples of 27 tokens on different grids: per-sample RoPE tables split like the tokens."""
    model = tiny_wan()
    g = torch.Generator().manual_seed(2)
    x = [torch.randn(TINY["in_dim"], 3, 6, 6, generator=g), torch.randn(TINY["in_dim"], 1, 6, 18, generator=g)]
    context = [torch.randn(5, TINY["text_dim"], generator=g), torch.randn(8, TINY["text_dim"], generator=g)]
    t = torch.tensor([3.0, 900.0])
    ref = model(x, t, context, seq_len=N)
    enable_sequence_parallel(model, group, kind)
    out = model(x, t, context, seq_len=N)
    with pytest.raises(ValueError, match="padded samples"):
        model(x, t, context, seq_len=N + 1)
    return out, ref


def _worker(rank, world_size):
    group = dist.group.WORLD
    return {"model": {(kind, ckpt): _case(group, kind, ckpt) for kind in KINDS for ckpt in (False, True, "per-token")},
            "list": {kind: _list_case(group, kind) for kind in KINDS}}


@pytest.mark.slow
@pytest.mark.parametrize("P", [2, 4])
def test_sequence_parallel_equals_unsplit(P):
    layers, dim = TINY["num_layers"], TINY["dim"]
    for rank, res in enumerate(run_distributed(_worker, P)):
        for (kind, ckpt), ((out, grads), (ref_out, ref_grads), sent) in res["model"].items():
            where = f"wan {kind} checkpoint={ckpt} P={P} rank {rank}"
            assert ref_out.abs().mean() > 0.3
            torch.testing.assert_close(out, ref_out, **OUT_TOL, msg=lambda m: f"{where} output: {m}")
            assert grads.keys() == ref_grads.keys()
            for n in ref_grads:
                # every rank's loss is the whole loss: the group's SUM is P times the unsplit gradient
                torch.testing.assert_close(grads[n] / P, ref_grads[n], **GRAD_TOL,
                                           msg=lambda m: f"{where} grad {n}: {m}")
            if ckpt is False:  # forward + backward of every self-attention layer; the head's gather is counted apart
                assert sum(v for k, v in sent.items() if k.startswith(kind)) == \
                    layers * comm_bytes_per_layer(kind, P, N, dim, B), (where, sent)
                norm_bytes = layers * 2 * 2 * (P - 1) * B * padded_len(N, P) * 4  # q and k; fwd and bwd
                assert sum(v for k, v in sent.items() if k.startswith("qk_norm")) == \
                    (norm_bytes if kind == "fastseq" else 0), (where, sent)
        for kind, (out, ref) in res["list"].items():
            for o, r in zip(out, ref):
                torch.testing.assert_close(o, r, **OUT_TOL, msg=lambda m: f"wan list {kind} P={P} rank {rank}: {m}")
