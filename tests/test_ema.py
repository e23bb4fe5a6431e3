"""Sharded EMA: equals a full EMA under fsdp and ddp layouts, keeps ~1/world of the bytes, keeps official keys."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from opendit.ema import ShardedEMA, chunk_bounds
from opendit.families import build_model
from tests.distributed import run_distributed


def tiny_dit(seed: int = 0, class_dropout_prob: float = 0.1) -> nn.Module:
    """DiT-debug (8x8x3, 10 classes) with every trainable weight random, so every parameter gets a gradient
    (adaLN-Zero would leave most of them at exactly zero after a few steps)."""
    torch.manual_seed(seed)
    model = build_model("DiT-debug", input_size=8, in_channels=3, num_classes=10,
                        class_dropout_prob=class_dropout_prob)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    return model


def wrap(model: nn.Module, layout: str) -> nn.Module:
    """'fsdp': fully_shard per block then root (zero2-style); 'hsdp': the same on a 2 x (world/2)
    (replicate, shard) mesh; 'ddp': DistributedDataParallel; 'none': as is."""
    if layout in ("fsdp", "hsdp"):
        mesh = None
        if layout == "hsdp":
            shape = (2, dist.get_world_size() // 2)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=False)
        return fully_shard(model, mesh=mesh, reshard_after_forward=False)
    if layout == "ddp":
        return DDP(model)
    return model


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """{official fqn: full tensor} of a wrapped model, gathered (a collective under fsdp)."""
    inner = model.module if isinstance(model, DDP) else model
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in inner.named_parameters()}


def train_step(model, optimizer, gen: torch.Generator):
    """One MSE step on random data from `gen`; returns the loss."""
    x = torch.randn(2, 3, 8, 8, generator=gen)
    t = torch.randint(0, 1000, (2,), generator=gen)
    y = torch.randint(0, 10, (2,), generator=gen)
    noise = torch.randn(x.shape, generator=gen)
    loss = (model(x + noise, t, y)[:, :3] - noise).square().mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _ema_vs_full(rank, world, layout):
    model = wrap(tiny_dit(), layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ema = ShardedEMA(model, decay=0.9)
    ref = full_params(model)
    gen = torch.Generator().manual_seed(100 + rank)  # different data per rank, as in data parallelism
    for _ in range(3):
        train_step(model, optimizer, gen)
        ema.update(model)
        for name, p in full_params(model).items():  # the official DiT update, on full tensors
            ref[name].mul_(0.9).add_(p, alpha=0.1)
    got = ema.full_state_dict()
    weights = full_params(model)
    mismatched = [n for n in ref if not torch.equal(got[n], ref[n])]
    moved = [n for n in ref if not torch.equal(got[n], weights[n])]  # EMA lags the weights
    # load_state_dict from full tensors must restore this rank's shard exactly.
    other = ShardedEMA(model, decay=0.9)
    other.load_state_dict(got)
    reloaded = all(torch.equal(a, b) for a, b in zip(other._shards.values(), ema._shards.values()))
    row_bytes = sum(p[0].numel() * 4 for p in ref.values() if p.dim() > 0)
    return dict(mismatched=mismatched, moved=len(moved), n=len(ref), keys=sorted(got), reloaded=reloaded,
                local_bytes=ema.local_bytes(), full_bytes=sum(p.numel() * 4 for p in ref.values()),
                row_bytes=row_bytes, dtensor=all(isinstance(v, DTensor) for v in ema.state_dict().values()))


def _layouts(world):
    return ("fsdp", "ddp", "hsdp") if world == 4 else ("fsdp", "ddp")


def _worker(rank, world):
    return {layout: _ema_vs_full(rank, world, layout) for layout in _layouts(world)}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_ema_equals_full_ema_and_memory(world):
    results = run_distributed(_worker, world)
    official = sorted(tiny_dit().state_dict())
    for layout in _layouts(world):
        per_rank = [r[layout] for r in results]
        for r in per_rank:
            assert r["mismatched"] == [], f"{layout}: sharded EMA differs from full EMA at {r['mismatched'][:3]}"
            assert r["moved"] >= r["n"] - 1, f"{layout}: EMA equals the weights; update did nothing"
            assert r["keys"] == official and "pos_embed" in r["keys"]
            assert r["reloaded"] and r["dtensor"]
        # Memory: the shards partition the full copy (no duplication; hsdp keeps one copy per replica
        # group, like its weights), and each rank holds at most 1/shards of it plus one row per parameter
        # (ceil rounding of dim-0 chunks; pos_embed [1, N, D] has one row, so it sits whole on rank 0).
        replicas = 2 if layout == "hsdp" else 1
        shards = world // replicas
        full, rows = per_rank[0]["full_bytes"], per_rank[0]["row_bytes"]
        local = [r["local_bytes"] for r in per_rank]
        assert sum(local) == replicas * full, f"{layout}: shards sum to {sum(local)} bytes, full copy is {full}"
        assert max(local) <= full / shards + rows, f"{layout}: {max(local)} bytes > {full}/{shards} + {rows}"
        assert max(local) < 1.1 * full / shards  # DiT-debug: within 10% of an even split


def test_single_process_ema_is_full_copy_with_official_keys():
    model = tiny_dit()
    ema = ShardedEMA(model, decay=0.5)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    sd = ema.state_dict()
    assert list(sd) == list(model.state_dict())  # official order and keys, frozen pos_embed included
    for n, p in model.named_parameters():
        assert torch.equal(sd[n], ref[n] * 0.5 + p.detach() * 0.5), n
    assert ema.local_bytes() == sum(p.numel() * 4 for p in model.parameters())


def test_keys_strip_compile_and_checkpoint_wrappers_and_copy_to():
    model = tiny_dit()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
    compiled = torch.compile(model)  # only wraps; nothing is compiled until called
    ema = ShardedEMA(compiled, decay=0.9)
    assert sorted(ema.state_dict()) == sorted(tiny_dit().state_dict())
    ema.update(compiled, decay=0.0)  # decay 0 copies the weights
    target = tiny_dit(seed=1)
    ema.copy_to(target)
    for (n, a), b in zip(target.state_dict().items(), ema.full_state_dict().values()):
        assert torch.equal(a, b), n


def test_bad_inputs_name_the_problem():
    model = tiny_dit()
    with pytest.raises(ValueError, match="decay"):
        ShardedEMA(model, decay=1.5)
    ema = ShardedEMA(model)
    with pytest.raises(ValueError, match="shape"):
        ema.update(build_model("DiT-debug", input_size=8, in_channels=3, num_classes=10, learn_sigma=False))
    with pytest.raises(ValueError, match="differ"):
        ema.update(build_model("DiT-debug", input_size=8, in_channels=3, num_classes=10, depth=3))
    with pytest.raises(KeyError, match="missing"):
        ema.load_state_dict({})


@pytest.mark.parametrize("size,world", [(11, 4), (1, 4), (64, 2), (3, 4)])
def test_chunk_bounds_match_torch_chunk_and_cover_rows(size, world):
    bounds = [chunk_bounds(size, world, r) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [e - s for s, e in bounds if e > s]
    assert sizes == [len(c) for c in torch.arange(size).chunk(world)]
