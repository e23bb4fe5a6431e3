"""Plugins: how a model is made data-parallel. `build_plugin(name, ...)` is what `--plugin` selects.

    ddp              DistributedDataParallel; fp32 params, torch.autocast for bf16/fp16 (bf16 params, which a
                     bf16 --master_weights mode makes: no autocast, inputs cast to bf16 and outputs to fp32 as
                     FSDP2 does). One process: no wrapper (nothing to all-reduce), and blocks_to_swap=N keeps
                     N blocks on the host (BlockSwap)
    zero2            fully_shard(reshard_after_forward=False): params gathered once per step
    zero3 / fsdp     fully_shard(reshard_after_forward=True): params gathered block by block
    hsdp             fully_shard on a (replicate, shard) mesh
    gemini           zero3 with params, grads and optimizer states on the CPU (CPUOffloadPolicy)

Every plugin applies, block by block, activation checkpointing, then compile, then (sharded plugins)
fully_shard; the root module last.
"""
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from opendit.booster import parallelize as par
from opendit.booster.mesh import mesh_shape, shard_mesh
from opendit.booster.precision import PRECISIONS, cast_forward_io, compute_dtype, fsdp_policy, params_in_dtype
from opendit.optim import BlockSwap


def validate_parallel_config(plugin: str, world_size: int, dp_replicate: int = 1, sp_size: int = 1,
                             mixed_precision: str = "fp32", grad_checkpoint: int = 0) -> None:
    """Raise ValueError naming the bad setting and the fix; call right after init_process_group."""
    if plugin not in PLUGINS:
        raise ValueError(f"unknown plugin {plugin!r}; valid plugins: {', '.join(PLUGINS)}")
    if mixed_precision not in PRECISIONS:
        raise ValueError(f"unknown mixed precision {mixed_precision!r}; valid: {', '.join(PRECISIONS)}")
    if not isinstance(grad_checkpoint, int) or grad_checkpoint < 0:
        raise ValueError(f"grad_checkpoint must be 0 (off), 1 (every block) or k >= 2 (every k-th block), "
                         f"got {grad_checkpoint!r}")
    for name, value in (("world size", world_size), ("dp_replicate", dp_replicate), ("sp_size", sp_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % sp_size:
        raise ValueError(f"sequence-parallel size {sp_size} does not divide the world size {world_size}; "
                         f"pick --sequence_parallel_size among the divisors of {world_size}")
    dp_size = world_size // sp_size
    if dp_replicate > 1 and plugin != "hsdp":
        raise ValueError(f"--dp_replicate {dp_replicate} only applies to --plugin hsdp (plugin {plugin!r} "
                         f"has no replicate dimension); use --plugin hsdp or --dp_replicate 1")
    if dp_size % dp_replicate:
        raise ValueError(f"--dp_replicate {dp_replicate} does not divide the data-parallel size {dp_size} "
                         f"(world {world_size} / sp {sp_size}); pick a divisor of {dp_size}")


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


class Plugin:
    """Settings shared by every plugin. compile: False, True (inductor) or a torch.compile backend name."""

    name = "base"
    sharded = False

    def __init__(self, mixed_precision: str = "fp32", dp_replicate: int = 1, sp_size: int = 1,
                 grad_checkpoint: int = 0, compile: bool | str = False, device: torch.device | str | None = None,
                 reduce_dtype: str = "fp32", blocks_to_swap: int = 0):
        # world-independent checks now; the world-size checks run in validate() once a group exists
        validate_parallel_config(self.name, sp_size * dp_replicate, dp_replicate, sp_size, mixed_precision,
                                 int(grad_checkpoint) if isinstance(grad_checkpoint, bool) else grad_checkpoint)
        compute_dtype(reduce_dtype)
        _check_blocks_to_swap(self.name, blocks_to_swap, compile)
        self.blocks_to_swap = blocks_to_swap
        self.block_swap = None  # the BlockSwap, once parallelize has placed the model
        self.mixed_precision = mixed_precision
        self.dp_replicate, self.sp_size = dp_replicate, sp_size
        self.grad_checkpoint = int(grad_checkpoint)
        self.compile_backend = "inductor" if compile is True else (compile or None)
        self.device = torch.device(device) if device is not None else default_device()
        self.reduce_dtype = reduce_dtype

    def validate(self, world_size: int) -> None:
        validate_parallel_config(self.name, world_size, self.dp_replicate, self.sp_size, self.mixed_precision,
                                 self.grad_checkpoint)
        if self.blocks_to_swap and world_size > 1:
            raise ValueError(f"--blocks_to_swap {self.blocks_to_swap} streams blocks to the one GPU of a single "
                             f"process, but the world size is {world_size}; run one process, or shard the model "
                             f"across GPUs instead (--plugin zero3 or gemini) with --blocks_to_swap 0")

    def mesh_shape(self, world_size: int) -> tuple[int, int, int]:
        return mesh_shape(self.name, world_size, self.dp_replicate, self.sp_size)

    def prepare_blocks(self, model: nn.Module) -> None:
        """Activation checkpointing, then compile, on each block (keys unchanged)."""
        par.apply_activation_checkpointing(model, self.grad_checkpoint)
        if self.compile_backend:
            par.apply_compile(model, self.compile_backend)

    def parallelize(self, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        raise NotImplementedError

    def autocast(self):
        return contextlib.nullcontext()

    def no_sync(self, model: nn.Module):
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(mixed_precision={self.mixed_precision!r}, dp_replicate={self.dp_replicate}, "
                f"sp_size={self.sp_size}, grad_checkpoint={self.grad_checkpoint}, "
                f"compile={self.compile_backend!r}, device={str(self.device)!r})")


class DDPPlugin(Plugin):
    name = "ddp"
    params_in_compute_dtype = False  # set by parallelize: the model's own weights are bf16/fp16

    def parallelize(self, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if self.mixed_precision != "fp32" and params_in_dtype(model, compute_dtype(self.mixed_precision)):
            self.params_in_compute_dtype = True
            cast_forward_io(model, compute_dtype(self.mixed_precision))
        self.prepare_blocks(model)
        if mesh.size() == 1:
            # One process has nothing to all-reduce; DDP would only add buckets holding every gradient (which
            # a fused backward pass exists to avoid). Weights move in place, so the optimizer's references hold.
            if self.blocks_to_swap:
                self.block_swap = BlockSwap(model, self.blocks_to_swap, device=self.device)  # places the model
            else:
                model.to(self.device)
            return model
        model.to(self.device)  # in place: the Parameter objects (and the optimizer's references) survive
        # the whole world is one replica group: dp_shard is 1, and SP ranks average their chunk gradients too
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # float8 tensors (a LoRA run's --base_dtype fp8 base) are not broadcast at wrap time: no collective takes
        # them, and every rank quantized the same weights file
        DDP._set_params_and_buffers_to_ignore_for_model(model, [
            name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.dtype.itemsize == 1
            and t.is_floating_point()])
        # gradients live in DDP's communication buckets instead of beside them: one copy, not two; a model that
        # declares `partly_used` (a step trains part of it) leaves the others' gradients None
        return DDP(model, device_ids=device_ids, process_group=None, gradient_as_bucket_view=True,
                   find_unused_parameters=getattr(model, "partly_used", False))

    def autocast(self):
        if self.mixed_precision == "fp32" or self.params_in_compute_dtype:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=compute_dtype(self.mixed_precision))

    def no_sync(self, model: nn.Module):
        if isinstance(model, DDP):
            return model.no_sync()
        if torch.distributed.get_world_size() > 1:
            raise TypeError("no_sync needs the model returned by booster.boost (a DistributedDataParallel)")
        return contextlib.nullcontext()  # one process, no wrapper: gradients are never synced anyway


class FSDPPlugin(Plugin):
    """FSDP2 sharding; subclasses choose resharding, the mesh and offloading."""

    name = "zero3"
    sharded = True
    reshard_after_forward = True
    replicate = False  # HSDP: shard within dp_shard, replicate across dp_replicate
    offload = False

    def parallelize(self, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        self.prepare_blocks(model)
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.offload else None
        return par.apply_fully_shard(
            model, shard_mesh(mesh, self.replicate), self.reshard_after_forward,
            fsdp_policy(self.mixed_precision, self.reduce_dtype),
            fsdp_policy(self.mixed_precision, self.reduce_dtype, root=True), offload)

    def no_sync(self, model: nn.Module):
        if not isinstance(model, FSDPModule):
            raise TypeError("no_sync needs the model returned by booster.boost (an FSDP module)")
        return _fsdp_no_sync(model)


@contextlib.contextmanager
def _fsdp_no_sync(model: FSDPModule):
    """Micro-steps accumulate unsharded gradients locally (in reduce_dtype); the next synced backward
    reduce-scatters the sum."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class Zero2Plugin(FSDPPlugin):
    name = "zero2"
    reshard_after_forward = False


class Zero3Plugin(FSDPPlugin):
    name = "zero3"


class HSDPPlugin(FSDPPlugin):
    name = "hsdp"
    replicate = True


class GeminiPlugin(FSDPPlugin):
    name = "gemini"
    offload = True


def _check_blocks_to_swap(plugin: str, blocks_to_swap: int, compile) -> None:
    if not isinstance(blocks_to_swap, int) or blocks_to_swap < 0:
        raise ValueError(f"--blocks_to_swap must be an integer >= 0, got {blocks_to_swap!r}")
    if not blocks_to_swap:
        return
    if plugin != "ddp":
        raise ValueError(f"--blocks_to_swap {blocks_to_swap} does not combine with --plugin {plugin}: FSDP2 owns "
                         "where its shards live; use --plugin ddp in one process, or --plugin gemini to keep "
                         "sharded weights on the CPU")
    if compile:
        raise ValueError(f"--blocks_to_swap {blocks_to_swap} with --compile is not supported: swapping repoints "
                         "each block's weights in hooks around its forward, which per-block compile would trace "
                         "or guard on; drop --compile or use --blocks_to_swap 0")


# --plugin name -> class: the one list of plugin names (validation, build_plugin, the sharded ones)
PLUGINS = {"ddp": DDPPlugin, "zero2": Zero2Plugin, "zero3": Zero3Plugin, "fsdp": Zero3Plugin,
           "hsdp": HSDPPlugin, "gemini": GeminiPlugin}


def build_plugin(name: str, mixed_precision: str = "fp32", dp_replicate: int = 1, sp_size: int = 1,
                 grad_checkpoint: int = 0, compile: bool | str = False, device=None,
                 reduce_dtype: str = "fp32", blocks_to_swap: int = 0) -> Plugin:
    if name not in PLUGINS:
        raise ValueError(f"unknown plugin {name!r}; valid plugins: {', '.join(PLUGINS)}")
    return PLUGINS[name](mixed_precision=mixed_precision, dp_replicate=dp_replicate, sp_size=sp_size,
                         grad_checkpoint=grad_checkpoint, compile=compile, device=device, reduce_dtype=reduce_dtype,
                         blocks_to_swap=blocks_to_swap)


def shard_frozen(module: nn.Module, blocks, plugin: str) -> nn.Module:
    """Shard a frozen, forward-only module (a text encoder such as T5-XXL, 9.5 GB in bf16) over every rank, block
    by block, under a plugin that keeps weights sharded between uses (zero3, fsdp, hsdp, gemini: `sharded` and
    `reshard_after_forward`); each block is gathered for its forward and freed after it. Under ddp and zero2, and
    in one process, the module stays whole on every rank. Returns the module."""
    kind = PLUGINS[plugin]
    if not (kind.sharded and kind.reshard_after_forward) or not dist.is_initialized() or dist.get_world_size() == 1:
        return module
    for block in blocks:
        fully_shard(block)
    fully_shard(module)
    return module
