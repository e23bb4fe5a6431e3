"""Sequence parallelism of a diffusers transformer through diffusers' own context-parallel machinery (a plan: which
inputs are split along the sequence, which output is gathered; the class's `_cp_plan`, or opendit's for a class
without one) and its Ulysses attention (q, k, v all-to-all to whole heads, attention, all-to-all back), with
opendit's process group and gradient convention.

What opendit adds to diffusers' `enable_parallelism`:
- a device mesh over opendit's sequence-parallel groups (consecutive ranks), also on the CPU (diffusers picks a
  CUDA device by rank);
- the gradient convention: diffusers' output gather passes back each rank's own chunk of the gradient, opendit's
  (opendit.parallel.gather_seq) the sum over the group; every plugin then averages over the group (see
  opendit.booster.mesh.shard_mesh), so the gathered output's gradient is multiplied by the group size here;
- an error naming the sizes when a sequence does not split evenly (diffusers' Ulysses needs equal chunks, and its
  uneven variant needs all-gathers of unequal sizes, which gloo lacks).
"""
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from opendit.distributed import device_mesh
from opendit.parallel.model_plan import ParallelPlan

SPLIT_INPUTS = ("hidden_states", "encoder_hidden_states")  # the forward's token sequences, checked


@dataclass
class DiffusersUlysses:
    """What `model.sequence_parallel` holds while diffusers' context parallelism is on."""
    group: object
    size: int
    kind: str = "ulysses"

    def __deepcopy__(self, memo):  # process groups cannot be copied; a copy of the model shares them
        return self


class _GradTimes(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x, factor: int):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def apply_diffusers_ulysses(model, group, kind: str = "ulysses", cp_plan: Callable[[], dict] | None = None,
                            checked: tuple[str, ...] = SPLIT_INPUTS,
                            prepare: Callable | None = None) -> DiffusersUlysses:
    """Split `model`'s token sequences over `group` with a context-parallel plan (`cp_plan()`, a function so that
    diffusers is imported late; None: the class's `_cp_plan`) and diffusers' Ulysses attention (the one kind: `kind`
    is "ulysses" or "auto"). `checked`: the forward inputs whose token counts must split evenly (an error names them
    before anything runs); `prepare(model, size)` adapts a class the plan alone cannot split (its attention
    processors, which hold the parallel config by then, and its inputs) before the plan is applied."""
    from diffusers import ContextParallelConfig
    from diffusers.hooks.context_parallel import ContextParallelOutput, apply_context_parallel
    from diffusers.models._modeling_parallel import ParallelConfig

    size, world = dist.get_world_size(group), dist.get_world_size()
    heads = next(getattr(model.config, k) for k in ("num_attention_heads", "n_heads") if hasattr(model.config, k))
    if heads % size:
        raise ValueError(f"--sequence_parallel_size {size} does not divide {type(model).__name__}'s {heads} attention "
                         f"heads (Ulysses gives each rank whole heads)")
    cuda = dist.get_backend(group) == "nccl"
    mesh = device_mesh("cuda" if cuda else "cpu", (world // size, 1, size), ("sp_replica", "ring", "ulysses"))
    if mesh["ulysses"].mesh.tolist() != dist.get_process_group_ranks(group):
        raise ValueError(f"the sequence-parallel group {dist.get_process_group_ranks(group)} is not a run of "
                         f"consecutive ranks, which diffusers' context-parallel mesh lays out")
    cp = ContextParallelConfig(ulysses_degree=size, mesh=mesh["ring", "ulysses"])
    config = ParallelConfig(context_parallel_config=cp)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    config.setup(dist.get_rank(), world, device, mesh=cp.mesh)
    model._parallel_config = config
    for module in model.modules():  # the attention processors: each dispatches to Ulysses attention
        if hasattr(getattr(module, "processor", None), "_parallel_config"):
            module.processor._parallel_config = config
    if prepare is not None:
        prepare(model, size)
    cp_plan = model._cp_plan if cp_plan is None else cp_plan()
    apply_context_parallel(model, cp, cp_plan)

    def check_split(module, args, kwargs):
        for name in checked:
            tokens = _token_count(module, kwargs.get(name))
            if tokens is not None and tokens % size:
                raise ValueError(f"sequence parallelism over {size} ranks splits {name} ({tokens} tokens) into "
                                 f"equal chunks: choose sizes (buckets, frames) and a text length whose token counts "
                                 f"are multiples of {size}, or a --sequence_parallel_size that divides them")

    def times_size(module, args, out):
        return _GradTimes.apply(out, size) if torch.is_grad_enabled() else out

    gathered = [name for name, entry in cp_plan.items() if isinstance(entry, ContextParallelOutput)]
    if not gathered:
        raise TypeError(f"{type(model).__name__}'s context-parallel plan gathers no single output opendit can scale "
                        f"the gradient of; its sequence cannot be split by opendit")
    model.register_forward_pre_hook(check_split, with_kwargs=True)
    for name in gathered:  # runs after diffusers' gather of that module's output
        model.get_submodule(name).register_forward_hook(times_size)
    return DiffusersUlysses(group, size)


def masked_padding(size: int, text: str, mask: str, beside: Callable[[dict], int] = lambda kwargs: 0) -> Callable:
    """A forward pre-hook (with_kwargs) that pads the forward's `text` tokens [B, L, D] with zeros, masked False in
    its `mask` input [B, L] (all True where absent), so that L + beside(kwargs) (the other tokens of the sequence the
    plan splits) is a multiple of `size`: attention never reads a masked key, so the real tokens' outputs stay."""
    def pad(module, args, kwargs):
        tokens = kwargs.get(text)
        extra = 0 if tokens is None else -(tokens.shape[1] + beside(kwargs)) % size
        if not extra:
            return None
        found = kwargs.get(mask)
        found = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device) if found is None else found
        return args, {**kwargs, text: torch.nn.functional.pad(tokens, (0, 0, 0, extra)),
                      mask: torch.cat([found, found.new_zeros(found.shape[0], extra)], dim=1)}
    return pad


def _token_count(model, x) -> int | None:
    """Tokens of a forward input: [B, L, D] -> L; a video [B, C, T, H, W] -> its patches (the class's patch_size)."""
    if x is None or x.ndim not in (3, 5):
        return None
    if x.ndim == 3:
        return x.shape[1]
    patch = model.config.patch_size
    pt, ph, pw = patch if isinstance(patch, (list, tuple)) else (getattr(model.config, "patch_size_t", 1), patch, patch)
    return x.shape[2] // pt * (x.shape[3] // ph) * (x.shape[4] // pw)


def diffusers_plan(split: tuple[str, ...], **how) -> ParallelPlan:
    """The parallel plan of a diffusers transformer class: its own `_cp_plan` over a forward that takes SPLIT_INPUTS,
    or what `how` gives apply_diffusers_ulysses (cp_plan, checked, prepare)."""
    return ParallelPlan(kinds=("ulysses",), split=split, replicated=("time embedding", "modulation"),
                        apply=functools.partial(apply_diffusers_ulysses, **how))
