"""The parallel layout: validation of a plugin's sizes against the world, and the 3-D DeviceMesh.

Mesh dims, outermost first: ("dp_replicate", "dp_shard", "sp"). Sequence-parallel ranks are innermost so
one SP group sits on neighbouring ranks (one node). Per plugin:

    ddp            dp_replicate = world / sp,        dp_shard = 1
    zero2/zero3/gemini  dp_replicate = 1,            dp_shard = world / sp
    hsdp           dp_replicate = R (--dp_replicate), dp_shard = world / (R * sp)

Data-parallel rank = replicate index * dp_shard + shard index; all ranks of one SP group share it (and so
read the same batch).
"""
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from opendit.booster.precision import PRECISIONS

MESH_DIMS = ("dp_replicate", "dp_shard", "sp")
PLUGIN_NAMES = ("ddp", "zero2", "zero3", "fsdp", "hsdp", "gemini")


def validate_parallel_config(plugin: str, world_size: int, dp_replicate: int = 1, sp_size: int = 1,
                             mixed_precision: str = "fp32", grad_checkpoint: int = 0) -> None:
    """Raise ValueError naming the bad setting and the fix; call right after init_process_group."""
    if plugin not in PLUGIN_NAMES:
        raise ValueError(f"unknown plugin {plugin!r}; valid plugins: {', '.join(PLUGIN_NAMES)}")
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


def mesh_shape(plugin: str, world_size: int, dp_replicate: int = 1, sp_size: int = 1) -> tuple[int, int, int]:
    """(dp_replicate, dp_shard, sp) sizes for a validated configuration."""
    dp_size = world_size // sp_size
    if plugin == "ddp":
        return dp_size, 1, sp_size
    return dp_replicate, dp_size // dp_replicate, sp_size


def build_mesh(device: torch.device, shape: tuple[int, int, int]) -> DeviceMesh:
    return init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)


def shard_mesh(mesh: DeviceMesh, replicate: bool) -> DeviceMesh:
    """The mesh FSDP lays parameters on: 1-D (ZeRO) or 2-D (HSDP: replicate x shard).

    Parameters are replicated across SP ranks, and every SP rank contributes a gradient, so the shard dim
    is dp_shard x sp flattened: the reduce-scatter then averages over SP ranks too. That is right because every
    SP rank computes the whole sample's loss and the output gather's backward is a reduce-scatter, so the
    SP-group mean of the gradients is the unsplit gradient (docs/sequence_parallel.md)."""
    shard_dim = "dp_shard"
    if mesh["sp"].size() > 1:
        mesh["dp_shard", "sp"]._flatten("dp_shard_sp")
        shard_dim = "dp_shard_sp"
    return mesh["dp_replicate", shard_dim] if replicate else mesh[shard_dim]


def dp_coordinates(mesh: DeviceMesh) -> tuple[int, int]:
    """(dp_size, dp_rank) of this process."""
    rep, shard = mesh["dp_replicate"], mesh["dp_shard"]
    return rep.size() * shard.size(), rep.get_local_rank() * shard.size() + shard.get_local_rank()
