"""CFG parallelism for sampling: the two halves of classifier-free guidance's batch on two rank groups.

With guidance, every denoising step calls the model once on a doubled batch [cond; uncond] (DiT, VDiT, Latte
and FLUX inside their forward_with_cfg; Wan and flow-matching video on the batch directly). `enable_cfg_parallel`
hooks the model's own call: on the rank with index r (0 or 1) of its CFG group, every batched input (a tensor
whose dim 0 is the first input's, 2B) is cut to half r ([B, ...]: the conditional or the unconditional half);
the output [B, ...] is all-gathered in the group back to [2B, ...]. Everything around the call (the guidance
mix, the sampler's math, the noise) runs on the whole batch on every rank, so every rank ends with the guided
result a single process computes, for half the model work and one all-gather of the output per step.

`sampling_mesh` lays the world out as ("dp", "cfg", "sp"): sequence parallelism (a collective in every layer)
innermost on neighbouring ranks, the CFG pair (one collective per step) next, data parallelism (none) outside.
The ranks of one cfg x sp group share each batch of samples. See docs/sampling.md.
"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from opendit.parallel.comm import gather_seq

MESH_DIMS = ("dp", "cfg", "sp")


def validate_cfg_parallel(world_size: int, sp_size: int, guided: bool) -> None:
    """Check --cfg_parallel before any group is built: 2 x sp ranks (or a multiple: data parallel over the rest),
    and a run that guides (conditional model, --cfg_scale > 1)."""
    if world_size % (2 * sp_size):
        raise ValueError(f"--cfg_parallel needs 2 x --sequence_parallel_size = {2 * sp_size} processes (one group "
                         f"of {sp_size} per guidance half), or a multiple of {2 * sp_size}; got {world_size}: launch "
                         f"torchrun --nproc_per_node {2 * sp_size}, or leave out --cfg_parallel")
    if not guided:
        raise ValueError("--cfg_parallel splits classifier-free guidance's [cond; uncond] batch, but this run samples "
                         "without guidance (it needs --cfg_scale > 1 and a conditional model); pass --cfg_scale > 1 "
                         "or leave out --cfg_parallel")


def sampling_mesh(device: torch.device, world_size: int, sp_size: int, cfg_size: int) -> DeviceMesh:
    """The ("dp", "cfg", "sp") mesh of a validated configuration (cfg_size 1 or 2)."""
    shape = (world_size // (cfg_size * sp_size), cfg_size, sp_size)
    return init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)


def enable_cfg_parallel(model: torch.nn.Module, group, counter=None) -> list:
    """Hook model's calls so that each rank of the 2-rank `group` computes its half of every [cond; uncond]
    batch; returns the hooks' handles. counter (a CommCounter) tallies the gather under "cfg"."""
    rank = dist.get_rank(group)

    def take_half(module, args, kwargs):
        batch = next(v for v in (*args, *kwargs.values()) if torch.is_tensor(v)).shape[0]
        if batch % 2:
            raise ValueError(f"--cfg_parallel: the model was called on an odd batch of {batch}, not on a "
                             f"[cond; uncond] pair of halves")

        def half(v):  # [2B, ...] -> this rank's [B, ...]; anything not batched passes whole
            return v.chunk(2)[rank] if torch.is_tensor(v) and v.dim() and v.shape[0] == batch else v
        return tuple(map(half, args)), {k: half(v) for k, v in kwargs.items()}

    def gather_halves(module, args, out):  # [B, ...] per rank -> [2B, ...], cond half first, on both ranks
        return gather_seq(out, group, dim=0, counter=counter, site="cfg")

    model.cfg_parallel_group = group  # step caches (opendit.models.step_cache) agree their skips over the pair
    return [model.register_forward_pre_hook(take_half, with_kwargs=True),
            model.register_forward_hook(gather_halves)]
