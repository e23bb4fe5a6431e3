"""CFG parallelism for sampling: the two halves of classifier-free guidance's batch on two rank groups.

With guidance, every denoising step calls the model once on a doubled batch [cond; uncond] (DiT, VDiT, Latte
and FLUX inside their forward_with_cfg; Wan and flow-matching video on the batch directly). `enable_cfg_parallel`
hooks the model's own call: on the rank with index r (0 or 1) of its CFG group, every batched input (a tensor
whose dim 0 is the first input's, 2B) is cut to half r ([B, ...]: the conditional or the unconditional half);
the output [B, ...] is all-gathered in the group back to [2B, ...]. Everything around the call (the guidance
mix, the sampler's math, the noise) runs on the whole batch on every rank, so every rank ends with the guided
result a single process computes, for half the model work and one all-gather of the output per step.

A model that a pipeline calls twice per step instead, conditional then unconditional with the same latents
(diffusers' FLUX.1, FLUX.2 [klein], Qwen-Image, Wan and HunyuanVideo-1.5 pipelines), says so with
`model.cfg_calls = "pairs"`: the first step runs whole on every rank and shows which inputs the unconditional call
changes (the conditions, the same tensors every step); from then on, at each conditional call, rank 0 computes it and
rank 1 the unconditional one (those inputs swapped in), the pair is all-gathered, and the unconditional call that
follows returns its half without computing. Its inputs are checked against the ones swapped in; a pipeline that
changed them would be an error, not a wrong image.

`sampling_mesh` lays the world out as ("dp", "cfg", "sp"): sequence parallelism (a collective in every layer)
innermost on neighbouring ranks, the CFG pair (one collective per step) next, data parallelism (none) outside.
The ranks of one cfg x sp group share each batch of samples. See docs/sampling.md.
"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from opendit.distributed import device_mesh
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
    return device_mesh(device.type, shape, MESH_DIMS)


def enable_cfg_parallel(model: torch.nn.Module, group, counter=None) -> list:
    """Hook model's calls so that each rank of the 2-rank `group` computes its half of every [cond; uncond]
    batch (a list of 2B per-sample tensors is a batch too), or of every (cond, uncond) pair of calls where
    `model.cfg_calls` is "pairs"; returns the hooks' handles. counter (a CommCounter) tallies the gather under
    "cfg"."""
    model.cfg_parallel_group = group  # step caches (opendit.models.step_cache) agree their skips over the pair
    if getattr(model, "cfg_calls", "batched") == "pairs":
        return [_PairedCalls(model, group, counter)]
    rank = dist.get_rank(group)

    def take_half(module, args, kwargs):
        batch = next(v for v in (*args, *kwargs.values()) if torch.is_tensor(v)).shape[0]
        if batch % 2:
            raise ValueError(f"--cfg_parallel: the model was called on an odd batch of {batch}, not on a "
                             f"[cond; uncond] pair of halves")

        def half(v):  # [2B, ...] -> this rank's [B, ...]; anything not batched passes whole
            if isinstance(v, list) and len(v) == batch:
                return v[rank * batch // 2:(rank + 1) * batch // 2]
            return v.chunk(2)[rank] if torch.is_tensor(v) and v.dim() and v.shape[0] == batch else v
        return tuple(map(half, args)), {k: half(v) for k, v in kwargs.items()}

    def gather(out):  # [B, ...] per rank -> [2B, ...], cond half first, on both ranks
        if isinstance(out, tuple):
            return tuple(gather(o) for o in out)
        if isinstance(out, list):
            return list(gather(torch.stack(out)).unbind(0))
        return gather_seq(out, group, dim=0, counter=counter, site="cfg")
    return [model.register_forward_pre_hook(take_half, with_kwargs=True),
            model.register_forward_hook(lambda module, args, out: gather(out))]


class _PairedCalls:
    """model.forward replaced for cfg_calls "pairs" (see the module's text); remove() puts it back."""

    def __init__(self, model, group, counter):
        self.model, self.group, self.counter, self.inner = model, group, counter, model.forward
        self.rank, self.calls, self.first, self.swap, self.pending = dist.get_rank(group), 0, None, None, None
        model.forward = self.forward

    def remove(self):
        self.model.forward = self.inner

    def forward(self, *args, **kwargs):
        call, self.calls = self.calls, self.calls + 1
        if call == 0:  # the first step whole on every rank: what the unconditional call changes
            self.first = kwargs
            return self.inner(*args, **kwargs)
        if call == 1:
            self.swap = {k: v for k, v in kwargs.items() if not _same(v, self.first.get(k))}
            self.first = None
            return self.inner(*args, **kwargs)
        if call % 2 == 1:
            changed = [k for k, v in kwargs.items() if k in self.swap and not _same(v, self.swap[k])]
            if changed:
                raise RuntimeError(f"--cfg_parallel: the pipeline's unconditional call changed {changed} since its "
                                   f"first step, which this rank's half was computed without; leave out "
                                   f"--cfg_parallel")
            return self.pending
        out = self.inner(*args, **(kwargs if self.rank == 0 else {**kwargs, **self.swap}))
        if not (torch.is_tensor(out) or isinstance(out, (tuple, list))):
            raise TypeError(f"--cfg_parallel: the model returned a {type(out).__name__}; it gathers tensors or tuples "
                            f"of them (call it with return_dict=False)")
        tensors = [out] if torch.is_tensor(out) else list(out)
        pairs = [gather_seq(t.contiguous()[None], self.group, dim=0, counter=self.counter, site="cfg") for t in tensors]
        cond, uncond = ([p[i] for p in pairs] for i in (0, 1))
        self.pending = uncond[0] if torch.is_tensor(out) else type(out)(uncond)
        return cond[0] if torch.is_tensor(out) else type(out)(cond)


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return a is b or (torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and
                          a.dtype == b.dtype and torch.equal(a, b))
    return a == b
