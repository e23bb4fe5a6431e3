"""Booster: one verb, `boost`, that makes a plain model, optimizer and dataloader data-parallel.

    booster = Booster(build_plugin("zero2", mixed_precision="bf16"))
    model, optimizer, loader, scheduler = booster.boost(model, optimizer, dataloader=loader, lr_scheduler=sched)
    for batch in loader:
        with booster.no_sync(model, enabled=not last_micro_step), booster.autocast():
            booster.backward(loss_fn(model, batch), optimizer)
        booster.clip_grad_norm_(model, 1.0)
        booster.step(optimizer)          # False when an fp16 overflow skipped the step

Without a process group (plain `python script.py`), the Booster starts a one-process group itself
(opendit.distributed.init_distributed), so DeviceMesh/DTensor/DCP paths are the same everywhere; `close()`
ends a group it started.
"""
import contextlib
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, RandomSampler

from opendit.booster.mesh import build_mesh, dp_coordinates
from opendit.booster.plugins import Plugin
from opendit.booster.precision import DynamicLossScaler
from opendit.booster import parallelize as par
from opendit.data import ResumableDataLoader, build_dataloader
from opendit.distributed import init_distributed, local_tensor, unwrap_model

logger = logging.getLogger("opendit")


class Booster:
    def __init__(self, plugin: Plugin):
        self.plugin = plugin
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            init_distributed()
        world = dist.get_world_size()
        plugin.validate(world)
        self.device = plugin.device
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.mesh = build_mesh(self.device, plugin.mesh_shape(world))
        self.dp_size, self.dp_rank = dp_coordinates(self.mesh)
        # 1-D mesh over the data-parallel ranks (replicate x shard flattened, in dp_rank order); SP excluded
        self.dp_mesh = self.mesh["dp_replicate", "dp_shard"]._flatten("dp")
        self.dp_group = self.dp_mesh.get_group()
        self.sp_group = self.mesh["sp"].get_group() if plugin.sp_size > 1 else None
        self.scaler = DynamicLossScaler(device=self.device) if plugin.mixed_precision == "fp16" else None

    # ---- boost --------------------------------------------------------------------------------------------------
    def boost(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
              dataloader: DataLoader | None = None, lr_scheduler=None, data_seed: int = 0):
        """-> (model, optimizer, dataloader, lr_scheduler), the same kinds of objects.

        model: built identically on every rank (same seed), or on the meta device for sharded plugins (then
          the weights are uninitialised until a checkpoint is loaded). optimizer: built from model.parameters()
          and not stepped yet; its param groups and options are kept and rebound to the boosted parameters.
        dataloader: its batch_size is the GLOBAL batch; the returned loader yields this data-parallel rank's
          share from a resumable sampler (shuffled iff the given loader shuffles; seeded by data_seed)."""
        names = par.parameter_names(unwrap_model(model))  # the names rebinding finds in self.unwrap(boosted)
        meta = any(p.is_meta for p in model.parameters())
        if meta and not self.plugin.sharded:
            raise ValueError(f"plugin {self.plugin.name!r} needs materialized weights, but the model is on the "
                             f"meta device; build it on the CPU, or use a sharded plugin (zero2/zero3/hsdp/gemini)")
        if not meta and self.plugin.sharded:
            _check_same_weights(model, self.device)
        model = self.plugin.parallelize(model, self.mesh)
        if meta:
            model.to_empty(device="cpu" if self.plugin.offload else self.device)
        if optimizer is not None:
            par.rebind_optimizer(optimizer, names, self.unwrap(model))
        if dataloader is not None:
            dataloader = self._shard_loader(dataloader, data_seed)
        return model, optimizer, dataloader, lr_scheduler

    def _shard_loader(self, loader: DataLoader, seed: int) -> DataLoader:
        if isinstance(loader, ResumableDataLoader):
            s = loader.sampler
            if (s.num_replicas, s.rank) != (self.dp_size, self.dp_rank):
                raise ValueError(f"the dataloader is already sharded for DP rank {s.rank} of {s.num_replicas}, "
                                 f"but this rank is {self.dp_rank} of {self.dp_size}; pass a plain DataLoader "
                                 f"whose batch_size is the global batch")
            return loader
        if loader.batch_size is None:
            raise ValueError("boost needs a DataLoader with batch_size set (the global batch), not a batch_sampler")
        sharded = build_dataloader(loader.dataset, loader.batch_size, self.dp_size, self.dp_rank, seed,
                                   num_workers=loader.num_workers,
                                   shuffle=isinstance(loader.sampler, RandomSampler), drop_last=loader.drop_last)
        sharded.collate_fn, sharded.worker_init_fn = loader.collate_fn, loader.worker_init_fn
        return sharded

    # ---- the step -----------------------------------------------------------------------------------------------
    def autocast(self):
        """torch.autocast for ddp with fp32 params and bf16/fp16 compute; a no-op otherwise (FSDP2, or ddp with
        bf16 params, cast at the model's inputs instead)."""
        return self.plugin.autocast()

    def no_sync(self, model: nn.Module, enabled: bool = True):
        """Accumulate gradients locally (no communication) while enabled; the last micro-step syncs."""
        return self.plugin.no_sync(model) if enabled else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer | None = None) -> None:
        """loss.backward(), with the loss scaled under fp16."""
        (self.scaler.scale_loss(loss) if self.scaler else loss).backward()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients of the model to a global norm; returns the norm before clipping (a plain tensor,
        the same on every rank). Under fp16 the gradients are unscaled first."""
        params = [p for p in model.parameters() if p.grad is not None]
        total = self.grad_norm(model, norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        by_kind = {}  # one multi-tensor multiply per (device, dtype)
        for p in params:
            g = local_tensor(p.grad)
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        for (device, dtype), grads in by_kind.items():
            torch._foreach_mul_(grads, coef.to(device, dtype))
        return total

    def grad_norm(self, model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
        """The global norm of all gradients of the model (unscaled first under fp16), the same on every rank."""
        params = [p for p in model.parameters() if p.grad is not None]
        if self.scaler:
            self.scaler.unscale_(params)
        return global_grad_norm(params, norm_type, self.device)

    def skip_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop this step's gradients without an update (a non-finite step; not an fp16 overflow, not counted
        by the loss scaler)."""
        if self.scaler:
            self.scaler.forget_step()
        optimizer.zero_grad(set_to_none=True)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """optimizer.step() unless an fp16 step overflowed (then skipped and counted); then zero_grad."""
        stepped = True
        if self.scaler:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            if not self.scaler.unscale_(params):
                optimizer.step()
            stepped = self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return stepped

    @property
    def skipped_steps(self) -> int:
        return self.scaler.skipped_steps if self.scaler else 0

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain module (DDP and a root torch.compile wrapper stripped): its state_dict keys equal the
        un-boosted model's own."""
        return unwrap_model(model)

    def close(self) -> None:
        """End the process group if this Booster started it."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False


def global_grad_norm(params, norm_type: float, device: torch.device) -> torch.Tensor:
    """The norm of all gradients together, over sharded (DTensor) and plain gradients; fp32 scalar on device.

    A DTensor gradient's local shards are disjoint along its Shard mesh dims (summed across them) and copies
    along Replicate dims (not summed)."""
    inf = norm_type == float("inf")
    groups: dict = {}
    for p in params:
        g = p.grad
        key = None
        if hasattr(g, "device_mesh"):
            dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            key = (g.device_mesh, dims) if dims else None
        groups.setdefault(key, []).append(local_tensor(g))
    total = torch.zeros((), dtype=torch.float32, device=device)
    for key, grads in groups.items():
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).to(device) for g in grads])
        part = norms.max() if inf else norms.pow(norm_type).sum()
        if key is not None:
            mesh, dims = key
            for d in dims:
                dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=mesh.get_group(d))
        total = torch.maximum(total, part) if inf else total + part
    return total if inf else total.pow(1.0 / norm_type)


def _check_same_weights(model: nn.Module, device: torch.device) -> None:
    """FSDP shards each rank's own copy, so every rank must start from the same weights (DDP broadcasts
    rank 0's; FSDP does not). Compare per-parameter sums across ranks: cheap, and catches unseeded builds."""
    if dist.get_world_size() == 1:
        return
    sums = torch.stack([p.detach().double().sum() for p in model.parameters()]).to(device)
    lo, hi = sums.clone(), sums.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if not torch.equal(lo, hi):
        raise ValueError("the model's initial weights differ across ranks; seed every rank identically (e.g. "
                         "torch.manual_seed(seed)) before building the model, or load the same checkpoint")
