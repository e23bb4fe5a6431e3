"""What a model declares about sequence parallelism (`parallel_plan`), and the one function that applies it.

A model class states its plan instead of coding a switch:

    class WanModel(nn.Module):
        parallel_plan = ParallelPlan(kinds=HEAD_KINDS, attention=(WanSelfAttention,),
                                     split=("video tokens",), replicated=("text context", "time embedding"),
                                     heads="num_heads")

`enable_sequence_parallel(model, group, kind)` checks the kind against the plan, builds the hook (a
`SequenceParallel` for FastSeq / Ulysses, a `DynamicSequenceParallel` for DSP) and hands it to the model
(`model.sequence_parallel`, which its forward reads to split and gather around the blocks) and to every
attention layer the plan names. Nothing else is per model. A model whose own library splits its sequence (a
diffusers transformer's context-parallel plan) names that code as the plan's `apply` instead.
"""
from collections.abc import Callable
from dataclasses import dataclass

from opendit.parallel.attention import SequenceParallel
from opendit.parallel.dsp import DynamicSequenceParallel
from opendit.parallel.plan import HEAD_KINDS


@dataclass(frozen=True)
class ParallelPlan:
    """kinds: the sequence-parallel methods the model's forward implements — HEAD_KINDS (FastSeq, Ulysses: one
    token sequence split, each rank attends with H/P heads) or ("dsp",) (frames split for spatial blocks,
    positions for temporal ones). attention: the layer classes that attend across the split sequence; each gets
    the hook as `.sequence_parallel`. split / replicated: what the forward splits along the sequence and what every
    rank of the group keeps whole, in words (the run log shows them). heads: the model attribute holding the head
    count the head-split methods divide (None: the registry's num_heads is checked before the run instead).
    apply: for a model that is split by its own code rather than by opendit's hook, apply(model, group, kind) sets
    that up and returns what `model.sequence_parallel` holds (its `size` and `kind`)."""
    kinds: tuple[str, ...] = HEAD_KINDS
    attention: tuple[type, ...] = ()
    split: tuple[str, ...] = ()
    replicated: tuple[str, ...] = ()
    heads: str | None = None
    apply: Callable | None = None

    def describe(self) -> str:
        return f"split: {', '.join(self.split) or '-'}; replicated: {', '.join(self.replicated) or '-'}"


def plan_of(model) -> ParallelPlan:
    plan = getattr(model, "parallel_plan", None)
    if plan is None:
        raise TypeError(f"{type(model).__name__} declares no parallel_plan (opendit.parallel.ParallelPlan), so "
                        f"its sequence cannot be split; run it with --sequence_parallel_size 1")
    return plan


def enable_sequence_parallel(model, group, kind: str = "auto", counter=None):
    """Split every sample's sequence over the ranks of `group` with `kind` (one of the plan's kinds, or "auto");
    None turns it off. Every rank of the group must get the same inputs (and noise). `counter` (a CommCounter)
    tallies the bytes sent. Returns the hook (None when off)."""
    plan = plan_of(model)
    if kind != "auto" and kind not in plan.kinds:
        raise ValueError(f"{type(model).__name__} implements sequence parallel types {plan.kinds}: type {kind!r} "
                         f"does not apply; use {' or '.join(map(repr, plan.kinds))} or 'auto'")
    if group is None:
        sp = None
    elif plan.apply is not None:
        sp = plan.apply(model, group, kind)
    elif plan.kinds == ("dsp",):
        sp = DynamicSequenceParallel(group, counter)
    else:
        sp = SequenceParallel(group, kind, counter)
    heads = getattr(model, plan.heads) if plan.heads else None
    if sp is not None and sp.kind != "dsp" and heads is not None and heads % sp.size:
        raise ValueError(f"{heads} attention heads cannot be split over a sequence-parallel group of {sp.size}; "
                         f"choose a group size that divides the head count")
    model.sequence_parallel = sp
    for m in model.modules():
        if isinstance(m, plan.attention):
            m.sequence_parallel = sp
    return sp
