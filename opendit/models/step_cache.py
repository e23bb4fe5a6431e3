"""Training-free step caches for sampling: reuse what the transformer computed at the previous denoising step when
its input has barely changed. One seam serves every model: a model cuts its block loop into a `BlockLoop` and
calls `run_blocks(self.step_cache, loop, state)`; with no cache attached that is the plain loop, op for op.

- TeaCache (Liu et al. 2024): the relative L1 change of block 0's adaLN-modulated input between consecutive steps
  is accumulated; while the sum stays below the threshold the whole block stack is skipped and the residual it
  added last time (output of the last block - input of the first) is added again; once it crosses, every block
  runs, the residual is stored and the sum restarts. The paper rescales the relative L1 with a polynomial fitted
  per model; here it is the identity, so thresholds are not the paper's.
- First-block cache (FBCache, xDiT / ParaAttention): block 0 always runs; when the relative L1 change of its
  residual against the one of the last computed step is below the threshold, the residual of the other blocks is
  reused, else they run and it is stored.
- Pyramid Attention Broadcast (PAB, Zhao et al. 2024): inside a middle range of the trajectory each attention
  layer is recomputed only every N steps, N per kind (cross > temporal > spatial), and its stored output is
  reused (broadcast) otherwise. A model names its attention layers and their kinds with `pab_attention()`.

A cache is attached to one model (a forward pre-hook counts its calls: one call is one sampling step, the sampler's
[cond; uncond] batch included) and reset before every sampling batch. State is per sample: every row of the batch
(with guidance the cond and uncond halves) has its own metric and its own stored residual; a call skips only
when every row may (else all rows run and restart). Under sequence parallelism each rank holds a chunk of the
tokens, so the metric is all-reduced (max) over the group and every rank takes the same decision. The first and
the last step always run; a threshold of 0 never skips.
"""
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

CACHES = ("none", "teacache", "fbcache", "pab")
THRESHOLD_CACHES = ("teacache", "fbcache")
PAB_KINDS = ("spatial", "temporal", "cross")  # PAB's pyramid: cross-attention is broadcast the longest


@dataclass(frozen=True)
class BlockLoop:
    """A model's block loop as the caches see it. `state` is what flows between units (DiT: tokens [B, N, D];
    FLUX: (img, txt) through the double blocks, then the joint sequence).

    run(state, start=0, stop=None): units start..stop-1 (a unit is a block; Latte's a spatial + temporal pair).
    out(state): the tokens the head reads, rows sample-major (reshape(batch, -1) gives one row per sample).
    probe(state): block 0's adaLN-modulated input (TeaCache's signal), rows sample-major.
    group: the sequence-parallel process group when tokens are split over ranks, else None.
    blocks_per_unit: what the skip share counts (Latte: 2)."""
    run: Callable[..., Any]
    units: int
    batch: int
    probe: Callable[[Any], torch.Tensor]
    out: Callable[[Any], torch.Tensor] = lambda state: state
    group: Any = None
    blocks_per_unit: int = 1


def run_blocks(cache, loop: BlockLoop, state) -> torch.Tensor:
    """The tokens the head reads: the plain loop without a cache, else what the cache decides."""
    if cache is None:
        return loop.out(loop.run(state))
    return cache.run(loop, state)


def relative_l1(new: torch.Tensor, old: torch.Tensor, batch: int, group=None) -> torch.Tensor:
    """Per sample mean|new - old| / mean|old| in fp32 [batch] (rows of new / old are sample-major). With a group
    (tokens split over its ranks) the max over the group, so every rank decides alike."""
    diff = (new.float() - old.float()).abs().reshape(batch, -1).mean(1)
    metric = diff / old.float().abs().reshape(batch, -1).mean(1)
    if group is not None:
        dist.all_reduce(metric, op=dist.ReduceOp.MAX, group=group)
    return metric


class StepCache:
    """What every cache shares: the step count (one call of the attached model per step), the per-batch reset
    and the share of evaluations skipped. `steps`: the sampler's steps per batch."""
    name = ""
    counts = "block evaluations"  # what ran and skipped count

    def __init__(self, steps: int):
        self.steps = steps
        self.model, self._hook = None, None
        self.reset()

    def reset(self) -> None:
        """Before a new sampling batch: forget every stored tensor and count from step 0 again."""
        self.step, self.ran, self.skipped = -1, 0, 0
        self._forget()

    def _forget(self) -> None:
        raise NotImplementedError

    @property
    def skipped_share(self) -> float:
        """Skipped / all evaluations (blocks; PAB: attention layers) since the last reset."""
        total = self.ran + self.skipped
        return self.skipped / total if total else 0.0

    def report(self) -> str:
        """The skip share in words, for sample.py's log."""
        return f"{self.name} skipped {self.skipped_share:.1%} of {self.ran + self.skipped} {self.counts}"

    def attach(self, model: torch.nn.Module) -> "StepCache":
        self.model = model
        self._hook = model.register_forward_pre_hook(self._tick)
        return self

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self.model, self._hook = None, None

    def _tick(self, module, args) -> None:
        self.step += 1

    def _edge_step(self) -> bool:
        """The first and the last step always run: nothing to reuse yet, and the last sets the output."""
        return self.step <= 0 or self.step >= self.steps - 1


class BlockCache(StepCache):
    """A cache of the block stack (TeaCache, FBCache): the model's forward hands it its BlockLoop."""

    def __init__(self, steps: int, threshold: float):
        super().__init__(steps)
        self.threshold, self.agree_group = threshold, None

    def attach(self, model):
        check_supported(model, self.name)
        model.step_cache = self
        # under CFG-parallel sampling each rank holds one half of the rows: the pair agrees on every skip, as the
        # whole batch does in one process (skip only when every row may)
        self.agree_group = getattr(model, "cfg_parallel_group", None)
        return super().attach(model)

    def detach(self):
        if self.model is not None:
            self.model.step_cache = None
        super().detach()

    def _below(self, metric: torch.Tensor) -> bool:
        """Every sample's metric under the threshold (NaN or inf never is; 0 never skips), on every rank of the
        CFG pair."""
        below = (metric < self.threshold).all()
        if self.agree_group is not None:
            below = below.to(torch.int32)
            dist.all_reduce(below, op=dist.ReduceOp.MIN, group=self.agree_group)
        return bool(below)


class TeaCache(BlockCache):
    name = "teacache"

    def _forget(self):
        self.probe, self.accumulated, self.residual = None, None, None

    def run(self, loop: BlockLoop, state) -> torch.Tensor:
        probe, start = loop.probe(state), loop.out(state)
        if self.probe is not None and self.probe.shape == probe.shape:
            self.accumulated = self.accumulated + relative_l1(probe, self.probe, loop.batch, loop.group)
        self.probe = probe
        if not self._edge_step() and self.residual is not None and self.residual.shape == start.shape \
                and self._below(self.accumulated):
            self.skipped += loop.units * loop.blocks_per_unit
            return start + self.residual
        out = loop.out(loop.run(state))
        self.ran += loop.units * loop.blocks_per_unit
        self.residual = out - start  # [rows, N, D]: each row's own, the cond and uncond halves apart
        self.accumulated = torch.zeros(loop.batch, device=out.device)
        return out


class FirstBlockCache(BlockCache):
    name = "fbcache"

    def _forget(self):
        self.first_residual, self.rest_residual = None, None

    def run(self, loop: BlockLoop, state) -> torch.Tensor:
        first = loop.run(state, 0, 1)
        start, after_first = loop.out(state), loop.out(first)
        first_residual = after_first - start
        if not self._edge_step() and self.rest_residual is not None \
                and self.rest_residual.shape == after_first.shape \
                and self._below(relative_l1(first_residual, self.first_residual, loop.batch, loop.group)):
            self.ran += loop.blocks_per_unit
            self.skipped += (loop.units - 1) * loop.blocks_per_unit
            return after_first + self.rest_residual
        out = loop.out(loop.run(first, 1))
        self.ran += loop.units * loop.blocks_per_unit
        # compared against the last COMPUTED step's, so a run of skips cannot drift step by step
        self.first_residual, self.rest_residual = first_residual, out - after_first
        return out


class PyramidAttentionBroadcast(StepCache):
    """every: {kind: N} (PAB_KINDS); inside steps [start * steps, stop * steps) a layer of kind k runs at the
    range's first step and every N-th after it, and returns its stored output between."""
    name = "pab"
    counts = "attention evaluations"

    def __init__(self, steps: int, every: dict[str, int], start: float, stop: float):
        super().__init__(steps)
        self.every, self.start, self.stop = every, start, stop
        self._wrapped = []

    def _forget(self):
        self.outputs = {}  # id(attention module) -> its last output, only kept inside the range

    def _in_range(self) -> bool:
        return self.start * self.steps <= self.step < self.stop * self.steps

    def _broadcasts(self, kind: str) -> bool:
        first = math.ceil(self.start * self.steps)  # the range's first step, which always computes
        return self._in_range() and (self.step - first) % self.every[kind] != 0

    def attach(self, model):
        check_supported(model, self.name)
        super().attach(model)
        for module, kind in model.pab_attention():
            self._wrap(module, kind)
        return self

    def _wrap(self, module: torch.nn.Module, kind: str) -> None:
        compute = module.forward

        def forward(*args, **kwargs):
            key = id(module)
            if self._broadcasts(kind) and key in self.outputs:
                self.skipped += 1
                return self.outputs[key]
            out = compute(*args, **kwargs)
            self.ran += 1
            if self._in_range() and self.every[kind] > 1:
                self.outputs[key] = out
            return out
        module.forward = forward  # an instance attribute: nn.Module.__call__ finds it first; detach deletes it
        self._wrapped.append(module)

    def detach(self):
        for module in self._wrapped:
            del module.forward
        self._wrapped = []
        super().detach()


def check_supported(model, kind: str) -> None:
    """A ValueError naming --cache when `model` (a model or its class) has no hook for the cache `kind`."""
    name = getattr(model, "__name__", type(model).__name__)
    if kind == "pab" and not hasattr(model, "pab_attention"):
        raise ValueError(f"--cache pab: {name} has no attention for PAB to broadcast (PAB is for the spatial, "
                         f"temporal and cross attention of the video models VDiT, Latte and Wan); use --cache "
                         f"teacache or fbcache")
    if kind in THRESHOLD_CACHES and not hasattr(model, "step_cache"):
        raise ValueError(f"--cache {kind}: {name} has no step-cache hook (a `step_cache` attribute its forward "
                         f"passes to opendit.models.step_cache.run_blocks); use --cache none")


def make_step_cache(kind: str, steps: int, threshold: float | None = None, every: dict[str, int] | None = None,
                    pab_range: tuple[float, float] = (0.1, 0.9)) -> StepCache | None:
    """The cache `kind` names (CACHES; "none": None) for batches of `steps` sampling steps."""
    if kind == "none":
        return None
    if kind == "pab":
        return PyramidAttentionBroadcast(steps, every or {"spatial": 2, "temporal": 4, "cross": 6}, *pab_range)
    return {"teacache": TeaCache, "fbcache": FirstBlockCache}[kind](steps, threshold)
