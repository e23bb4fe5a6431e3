"""Shared training runs for the booster tests (helpers, no tests): a tiny DiT trained for a few steps on a fixed
synthetic set.

The objective is a plain MSE of model(x, t, y) against a fixed target, so the tests do not depend on the
diffusion code. Every run sees the same global batches (the resumable sampler's global batch k does not
depend on the data-parallel size), so runs at different world sizes are comparable step by step.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from opendit.booster import Booster, build_plugin
from opendit.families import build_model

GLOBAL_BATCH = 8


def make_model(seed: int = 0) -> torch.nn.Module:
    """DiT-debug with the adaLN-Zero / zero-init layers given small random values, so every parameter gets a
    gradient from the first step (a zero final layer would leave the blocks untrained for a step)."""
    torch.manual_seed(seed)
    model = build_model("DiT-debug", input_size=8, in_channels=3, num_classes=10, class_dropout_prob=0.0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and not p.any():
                p.normal_(0.0, 0.02)
    return model


def make_dataset(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 1000, (n,), generator=g),
                         torch.randint(0, 10, (n,), generator=g), torch.randn(n, 6, 8, 8, generator=g))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Two param groups with different options, to check that boosting keeps them."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                              {"params": no_decay, "weight_decay": 0.0, "lr": 5e-4}], lr=1e-3)


def full_state(model: torch.nn.Module) -> dict:
    """Unsharded fp32 copies of the parameters (DTensor shards gathered)."""
    out = {}
    for name, p in model.named_parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = p.detach().float().cpu().clone()
    return out


def train(plugin: str, precision: str = "fp32", steps: int = 5, accum: int = 1, grad_checkpoint: int = 0,
          dp_replicate: int = 1, max_norm: float = 0.5, overflow_step: int | None = None) -> dict:
    """Run `steps` optimizer steps; returns per-step global mean losses, grad norms, stepped flags, and more.

    overflow_step: at that step the loss is multiplied by 1e30, which overflows fp16 gradients."""
    booster = Booster(build_plugin(plugin, mixed_precision=precision, dp_replicate=dp_replicate,
                                   grad_checkpoint=grad_checkpoint))
    model = make_model()
    optimizer = make_optimizer(model)
    groups_before = [{k: v for k, v in g.items() if k != "params"} | {"n": len(g["params"])}
                     for g in optimizer.param_groups]
    loader = DataLoader(make_dataset(), batch_size=GLOBAL_BATCH, shuffle=True)
    model, optimizer, loader, _ = booster.boost(model, optimizer, dataloader=loader, data_seed=0)
    losses, norms, stepped, scales, checksums = [], [], [], [], []
    batches = iter(loader)
    for step in range(steps):
        x, t, y, target = next(batches)
        total = torch.zeros(())
        for i, mb in enumerate(zip(*(v.chunk(accum) for v in (x, t, y, target)))):
            with booster.no_sync(model, enabled=i < accum - 1), booster.autocast():
                loss = F.mse_loss(model(mb[0], mb[1], mb[2]).float(), mb[3]) / accum
                if step == overflow_step:
                    loss = loss * 1e30
            booster.backward(loss, optimizer)
            total += loss.detach().float()
        norms.append(float(booster.clip_grad_norm_(model, max_norm)))
        scales.append(booster.scaler.scale if booster.scaler else 1.0)
        stepped.append(booster.step(optimizer))
        dist.all_reduce(total)  # per-rank means of equal-sized shards -> the global batch mean
        losses.append(total.item() / dist.get_world_size())
        checksums.append(sum(v.double().sum().item() for v in full_state(booster.unwrap(model)).values()))
    groups_after = [{k: v for k, v in g.items() if k != "params"} | {"n": len(g["params"])}
                    for g in optimizer.param_groups]
    return {"losses": losses, "norms": norms, "stepped": stepped, "scales": scales,
            "skipped": booster.skipped_steps, "params": full_state(booster.unwrap(model)), "checksums": checksums,
            "groups": (groups_before, groups_after), "dp": (booster.dp_size, booster.dp_rank)}


def train_plain(steps: int = 5, max_norm: float = 0.5) -> dict:
    """The same run without the booster or any process group: the fp32 single-process reference."""
    from opendit.data import build_dataloader
    model = make_model()
    optimizer = make_optimizer(model)
    loader = build_dataloader(make_dataset(), GLOBAL_BATCH, dp_size=1, dp_rank=0, seed=0)
    losses, norms = [], []
    batches = iter(loader)
    for _ in range(steps):
        x, t, y, target = next(batches)
        loss = F.mse_loss(model(x, t, y), target)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": full_state(model)}
