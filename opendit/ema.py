"""Sharded exponential moving average (EMA) of model weights.

Each rank keeps the EMA of only its own shard and updates it with local `torch._foreach` ops: no
communication per step. Layout, chosen so that one checkpoint loads under any plugin or world size:

- FSDP2 (`fully_shard`) parameters are DTensors; the EMA tensor is a DTensor with the same mesh and
  placements (Shard(0) on the dp mesh, or (Replicate, Shard(0)) under HSDP), so a rank averages
  exactly the rows its optimizer steps.
- Plain parameters (DDP, or no wrapper) are replicated; the EMA keeps only this rank's dim-0 chunk,
  as a DTensor Shard(0) on the data-parallel mesh (rows [r*ceil(d0/W), (r+1)*ceil(d0/W)) clipped to d0,
  torch.chunk semantics, the same as DTensor and FSDP2). 0-dim parameters stay replicated.
- Without a process group (or at world size 1) the EMA is a plain full copy.

Why dim-0 chunks and not a 1/world slice of one flattened buffer: the dim-0 layout is FSDP2's own, so
`state_dict()` is {fqn: DTensor with the parameter's global shape} under every plugin, and torch DCP
reshards it between ddp, zero2/zero3 and a single process at any world size. A flat slice would need its
own resharding code and would differ from the FSDP2 layout. The cost: memory per rank is 1/world of a
full copy up to one row per parameter (ceil rounding), and a parameter with fewer rows than ranks sits
on the first ranks (DiT's pos_embed [1, N, D] lives on rank 0) - `local_bytes()` measures it.

Keys equal the unwrapped model's state_dict keys (official DiT keys): wrapper prefixes from DDP
("module."), torch.compile ("_orig_mod.") and activation checkpointing are stripped. Parameters only,
frozen ones included (pos_embed); buffers are not averaged. EMA tensors are fp32 by default.
"""
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from opendit.distributed import unwrap_model

_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def clean_fqn(name: str) -> str:
    """'blocks.0._orig_mod._checkpoint_wrapped_module.attn.qkv.weight' -> 'blocks.0.attn.qkv.weight'."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def named_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """{official fqn: parameter} of the unwrapped model, frozen parameters included."""
    return {clean_fqn(n): p for n, p in unwrap_model(model).named_parameters()}


def chunk_bounds(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """[start, end) of chunk `index` when `size` rows are cut like torch.chunk / DTensor Shard."""
    step = -(-size // num_chunks)
    start = min(index * step, size)
    return start, min(start + step, size)


class _Spec(NamedTuple):
    """Where this rank's EMA tensor sits in the global tensor."""
    mesh: DeviceMesh | None  # None: a plain full copy
    placements: tuple[Placement, ...]
    shape: torch.Size  # global shape
    stride: tuple[int, ...]  # global stride
    rows: tuple[int, int] | None  # dim-0 slice of a plain replicated parameter, else None
    dtensor: bool  # the parameter itself is a DTensor (FSDP2); else a plain tensor


def _dp_mesh(dp_group, device_type: str) -> DeviceMesh | None:
    """A 1-D mesh to partition plain parameters over, or None to keep a full copy."""
    if isinstance(dp_group, DeviceMesh):
        if dp_group.ndim != 1:
            raise ValueError(f"dp_group mesh has dims {dp_group.mesh_dim_names}; pass a 1-D data-parallel "
                             "submesh (e.g. mesh['dp_shard'] or a flattened dp mesh)")
        return dp_group if dp_group.size() > 1 else None
    if not (dist.is_available() and dist.is_initialized()):
        if dp_group is not None:
            raise ValueError("dp_group was given but no process group is initialized; call "
                             "torch.distributed.init_process_group first or pass dp_group=None")
        return None
    group = dp_group if dp_group is not None else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return None
    return DeviceMesh.from_group(group, device_type)


def _local_chunk(full: torch.Tensor, spec: _Spec) -> torch.Tensor:
    """This rank's piece of a full (global-shape) tensor under `spec`, without communication."""
    if spec.mesh is None:
        return full
    coords = spec.mesh.get_coordinate()
    for mesh_dim, placement in enumerate(spec.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:  # _StridedShard (FSDP over TP) needs DTensor's own redistribution
            raise NotImplementedError(f"EMA cannot slice placement {placement}; only Shard and Replicate")
        start, end = chunk_bounds(full.shape[placement.dim], spec.mesh.size(mesh_dim), coords[mesh_dim])
        full = full.narrow(placement.dim, start, end - start)
    return full


class ShardedEMA:
    """EMA of `model`'s parameters, sharded like them (see the module docstring for the layout).

    Create it after the model is wrapped (booster.boost / fully_shard / DDP): it starts as a copy of the
    current weights. `dp_group`: a ProcessGroup or 1-D DeviceMesh over which plain (replicated) parameters
    are partitioned; default: the whole world when a process group exists.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999, dp_group=None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, trainable_only: bool = False):
        """device: where the EMA lives (None: beside each parameter; "cpu": host memory, one process only,
        e.g. a 12B model's 48 GB fp32 EMA kept off the GPU; each update then copies the weights to the host).
        trainable_only: average only the parameters that require grad (LoRA: the adapters, not the frozen base)."""
        self.decay = self._check_decay(decay)
        self.dtype = dtype
        self.trainable_only = trainable_only
        params = self._averaged(model)
        plain = [p for p in params.values() if not isinstance(p, DTensor)]
        if device is not None and (len(plain) < len(params) or (dist.is_initialized() and dist.get_world_size() > 1)):
            raise ValueError("an EMA in host memory (--ema_on_host) is for one process; with several, the EMA is "
                             "already sharded over the ranks: leave the option out")
        mesh = _dp_mesh(dp_group, plain[0].device.type) if plain else None
        self._specs: dict[str, _Spec] = {}
        self._shards: dict[str, torch.Tensor] = {}  # local EMA storage, one tensor per parameter
        with torch.no_grad():
            for name, p in params.items():
                self._specs[name] = self._make_spec(p, mesh)
                self._shards[name] = self._local_param(name, p).detach().to(device=device, dtype=dtype, copy=True)

    def _averaged(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """{official fqn: parameter} the EMA averages: all, or those that require grad (trainable_only)."""
        params = named_parameters(model)
        return {n: p for n, p in params.items() if p.requires_grad} if self.trainable_only else params

    @staticmethod
    def _check_decay(decay: float) -> float:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
        return float(decay)

    @staticmethod
    def _make_spec(p: torch.Tensor, mesh: DeviceMesh | None) -> _Spec:
        if isinstance(p, DTensor):
            return _Spec(p.device_mesh, tuple(p.placements), p.shape, p.stride(), None, True)
        stride = torch.empty(p.shape, device="meta").stride()
        if mesh is None:
            return _Spec(None, (), p.shape, stride, None, False)
        if p.dim() == 0:  # nothing to chunk; a replicated scalar costs nothing
            return _Spec(mesh, (Replicate(),), p.shape, stride, None, False)
        rows = chunk_bounds(p.shape[0], mesh.size(), mesh.get_local_rank())
        return _Spec(mesh, (Shard(0),), p.shape, stride, rows, False)

    def _local_param(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """The part of parameter `p` that this rank's EMA tensor averages (a view, no copy)."""
        spec = self._specs[name]
        if isinstance(p, DTensor) != spec.dtensor:
            raise ValueError(f"parameter {name!r} changed kind (DTensor vs plain) since the EMA was built; "
                             "create ShardedEMA after wrapping the model (booster.boost / fully_shard / DDP)")
        if p.shape != spec.shape:
            raise ValueError(f"parameter {name!r} has shape {tuple(p.shape)}, EMA expects {tuple(spec.shape)}")
        if spec.dtensor:
            if tuple(p.placements) != spec.placements:
                raise ValueError(f"parameter {name!r} has placements {p.placements}, the EMA was built for "
                                 f"{spec.placements}; update the EMA after optimizer.step(), when FSDP "
                                 "parameters are sharded")
            return p.to_local()
        return p if spec.rows is None else p[spec.rows[0]:spec.rows[1]]

    @torch.no_grad()
    def update(self, model: nn.Module, decay: float | None = None) -> None:
        """ema = decay * ema + (1 - decay) * param on this rank's shard; call after optimizer.step().

        Same arithmetic as the official DiT update (mul_ then add_ with alpha), so a sharded EMA equals a
        full one bit for bit. decay=0 copies the weights.
        """
        d = self.decay if decay is None else self._check_decay(decay)
        params = self._averaged(model)
        if params.keys() != self._shards.keys():
            missing, extra = self._shards.keys() - params.keys(), params.keys() - self._shards.keys()
            raise ValueError(f"model parameters differ from the EMA's: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(extra)[:5]}; build the EMA from this model")
        emas = list(self._shards.values())
        srcs = [self._local_param(n, params[n]).detach().to(device=e.device, dtype=self.dtype)
                for n, e in self._shards.items()]
        torch._foreach_mul_(emas, d)
        torch._foreach_add_(emas, srcs, alpha=1.0 - d)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{fqn: DTensor of the global shape} (plain tensors without a mesh); shares storage with the EMA,
        so torch.distributed.checkpoint can load into it in place."""
        out = {}
        for name, local in self._shards.items():
            spec = self._specs[name]
            if spec.mesh is None:
                out[name] = local
            else:
                out[name] = DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                                               shape=spec.shape, stride=spec.stride)
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load EMA values: DTensors in this layout, DTensors in another (gathered), or full tensors
        (e.g. from load_weights; every rank must pass the same full tensors)."""
        missing, extra = self._shards.keys() - state_dict.keys(), state_dict.keys() - self._shards.keys()
        if missing or extra:
            raise KeyError(f"EMA state_dict keys differ: missing {sorted(missing)[:5]}, "
                           f"unexpected {sorted(extra)[:5]}")
        for name in self._shards:  # same order on every rank: full_tensor() below is a collective
            value, spec, local = state_dict[name], self._specs[name], self._shards[name]
            if isinstance(value, DTensor):
                same = spec.mesh is not None and value.device_mesh == spec.mesh
                if same and tuple(value.placements) == spec.placements:
                    value = value.to_local()
                else:
                    value = _local_chunk(value.full_tensor(), spec)
            else:
                if value.shape != spec.shape:
                    raise ValueError(f"EMA value {name!r} has shape {tuple(value.shape)}, "
                                     f"expected {tuple(spec.shape)}")
                value = _local_chunk(value, spec)
            local.copy_(value)  # a no-op copy when DCP already loaded into state_dict()'s views

    def full_state_dict(self, rank0_only: bool = False, cpu: bool = True) -> dict[str, torch.Tensor]:
        """{official fqn: full tensor}; a collective when sharded (call on every rank). With rank0_only,
        other ranks get {} (they still join each gather, one parameter at a time, to bound memory)."""
        keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
        out = {}
        for name, value in self.state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()
            if keep:
                out[name] = full.cpu() if cpu else full
        return out

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Write the EMA into `model`'s parameters (e.g. to sample with EMA weights); a collective
        for plain partitioned parameters, which need the full tensor on every rank."""
        params = named_parameters(model)
        for name, value in self.state_dict().items():
            p, spec = params[name], self._specs[name]
            if spec.dtensor:
                self._local_param(name, p).copy_(value.to_local())
            else:
                p.copy_(value.full_tensor() if isinstance(value, DTensor) else value)

    def local_bytes(self) -> int:
        """Bytes of EMA storage held by this rank."""
        return sum(t.numel() * t.element_size() for t in self._shards.values())
