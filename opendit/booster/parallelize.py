"""Block-by-block model transforms: activation checkpointing -> compile -> sharding, root last.

All three keep parameter names (state_dict keys) unchanged: checkpointing is the composable
`torch.distributed._composable.checkpoint` (hooks, no wrapper module), compile is `nn.Module.compile`
(a compiled call, same module), and FSDP2's `fully_shard` swaps the class in place.
"""
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

from opendit.kernels import probe_optional_imports


def iter_blocks(model: nn.Module) -> Iterator[nn.Module]:
    """The repeated blocks, in forward order, from the lists named by the model's `_block_lists`."""
    names = getattr(model, "_block_lists", None)
    if not names:
        raise ValueError(f"{type(model).__name__} does not declare its repeated blocks; set the class attribute "
                         f"_block_lists = ('blocks',) naming its nn.ModuleList attributes")
    for name in names:
        blocks = getattr(model, name, None)
        if not isinstance(blocks, nn.ModuleList):
            raise ValueError(f"{type(model).__name__}._block_lists names {name!r}, which is not an nn.ModuleList")
        yield from blocks


def apply_activation_checkpointing(model: nn.Module, every: int) -> int:
    """Checkpoint every `every`-th block (1: all; 0: none), counting across all block lists.

    Returns the number of checkpointed blocks. Recomputation happens inside the block's backward, after
    FSDP's pre-backward hook has gathered its parameters."""
    if every <= 0:
        return 0
    count = 0
    for i, block in enumerate(iter_blocks(model)):
        if i % every == 0:
            checkpoint(block)
            count += 1
    return count


def apply_compile(model: nn.Module, backend: str = "inductor", mode: str | None = None) -> None:
    """torch.compile each block separately: blocks repeat, so one compiled graph is reused."""
    probe_optional_imports()  # a first probe inside a compiled block would force one recompile
    for block in iter_blocks(model):
        block.compile(backend=backend, mode=mode)


def apply_fully_shard(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool,
                      mp_policy: MixedPrecisionPolicy, root_mp_policy: MixedPrecisionPolicy,
                      offload_policy: OffloadPolicy | None = None) -> nn.Module:
    """fully_shard each block, then the root (which owns the embedders, final layer and any other params).

    The last block keeps its parameters gathered after forward: backward starts with it, so resharding would
    only gather them again at once. Likewise the root's own parameters (embedders, final layer), which the
    output's backward needs first."""
    offload = offload_policy if offload_policy is not None else OffloadPolicy()
    blocks = list(iter_blocks(model))
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1,
                    mp_policy=mp_policy, offload_policy=offload)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=root_mp_policy,
                offload_policy=offload)
    return model


def parameter_names(model: nn.Module) -> dict[int, str]:
    """id(param) -> name, taken before a transform that may replace the Parameter objects."""
    return {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}


def rebind_optimizer(optimizer: torch.optim.Optimizer, old_names: dict[int, str], model: nn.Module) -> None:
    """Point every param group at the transformed model's parameters, keeping groups and their options.

    Must run before the optimizer has state (state is keyed by the old Parameter objects)."""
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError("the optimizer already has state (it has stepped); boost the model and optimizer "
                         "before the first optimizer step, and load optimizer checkpoints after boosting")
    new_params = dict(model.named_parameters(remove_duplicate=False))
    for gi, group in enumerate(optimizer.param_groups):
        rebound = []
        for p in group["params"]:
            name = old_names.get(id(p))
            if name is None:
                raise ValueError(f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} that is not "
                                 f"a parameter of the model being boosted; build the optimizer from "
                                 f"model.parameters()")
            rebound.append(new_params[name])
        group["params"] = rebound
    optimizer.state.clear()
