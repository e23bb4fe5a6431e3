"""The parallel layout: the 3-D DeviceMesh and each plugin's sizes on it (plugins.py validates a configuration
against the world before these run).

Mesh dims, outermost first: ("dp_replicate", "dp_shard", "sp"). Sequence-parallel ranks are innermost so
one SP group sits on neighbouring ranks (one node). Per plugin:

    ddp            dp_replicate = world / sp,        dp_shard = 1
    zero2/zero3/gemini  dp_replicate = 1,            dp_shard = world / sp
    hsdp           dp_replicate = R (--dp_replicate), dp_shard = world / (R * sp)

Data-parallel rank = replicate index * dp_shard + shard index; all ranks of one SP group share it (and so
read the same batch).
"""
import torch
from torch.distributed.device_mesh import DeviceMesh

from opendit.distributed import device_mesh

MESH_DIMS = ("dp_replicate", "dp_shard", "sp")


def mesh_shape(plugin: str, world_size: int, dp_replicate: int = 1, sp_size: int = 1) -> tuple[int, int, int]:
    """(dp_replicate, dp_shard, sp) sizes for a validated configuration."""
    dp_size = world_size // sp_size
    if plugin == "ddp":
        return dp_size, 1, sp_size
    return dp_replicate, dp_size // dp_replicate, sp_size


def build_mesh(device: torch.device, shape: tuple[int, int, int]) -> DeviceMesh:
    return device_mesh(device.type, shape, MESH_DIMS)


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
