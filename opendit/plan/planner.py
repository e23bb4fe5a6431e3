"""Choosing the fastest plan that fits a memory budget, by an explicit cost model.

The planner varies only the options left at their defaults (an option set on the command line to its default value
counts as left out): --grad_checkpoint (0, every 4th, every 2nd, every block), --optimizer_offload,
--optimizer_state_dtype, --master_weights (under --mixed_precision bf16), --fused_backward, --blocks_to_swap (one
process, --plugin ddp), --ema_on_host (one process with an EMA) and --grad_accum (the micro-batch, keeping
--batch_size). Every candidate is accounted (opendit.plan.account) and costed; the cheapest that fits both budgets
and passes opendit.training.run_checks.validate_run (the Trainer's own checks) wins. A smaller budget admits a subset of
the plans a larger one admits, so it never gets a faster plan.

Cost model, in seconds per optimizer step (only the order matters; the constants are stated, not measured):
- compute: the family's training FLOPs per sample x the per-device batch / COMPUTE_FLOPS (H100-class bf16 at ~40%
  MFU). Checkpointed blocks recompute their forward: + 1/3 of the compute x the checkpointed share of the blocks.
- each micro-batch beyond the first: + MICRO_BATCH_COST of the compute (smaller matmuls, one more pass of hooks).
- host traffic at PCIE_BYTES_S: --optimizer_offload moves the states and master copy in and out and the gradients
  and weights once each; --blocks_to_swap N moves the swapped blocks' weights in for the forward, the backward and
  (checkpointing) the recomputation; --ema_on_host copies the weights out every step.
- compressed optimizer states (bf16, f24, u16) and --fused_backward cost a small tie-breaking share of the compute
  (FORMAT_COST, FUSED_COST): the planner prefers the plain option when it fits.
"""
import dataclasses
import itertools

from opendit.optim import FORMATS
from opendit.plan.account import account, checkpointed

COMPUTE_FLOPS = 400e12  # bf16 FLOP/s of one device, effective
PCIE_BYTES_S = 25e9  # host <-> device, one direction (PCIe 4.0 x16 in practice)
MICRO_BATCH_COST = 0.03
FORMAT_COST = {"fp32": 0.0, "bf16": 0.002, "f24": 0.004, "u16": 0.006}
FUSED_COST = 0.001
KNOBS = ("grad_checkpoint", "optimizer_offload", "optimizer_state_dtype", "master_weights", "fused_backward",
         "blocks_to_swap", "ema_on_host", "grad_accum")
DEFAULTS = dict(grad_checkpoint=0, optimizer_offload=False, optimizer_state_dtype="fp32", master_weights="fp32",
                fused_backward=False, blocks_to_swap=0, ema_on_host=False, grad_accum=1)


@dataclasses.dataclass(frozen=True)
class Options:
    grad_checkpoint: int = 0
    optimizer_offload: bool = False
    optimizer_state_dtype: str = "fp32"
    master_weights: str = "fp32"
    fused_backward: bool = False
    blocks_to_swap: int = 0
    ema_on_host: bool = False
    grad_accum: int = 1

    def flags(self, against: "Options | None" = None) -> str:
        """The options as flags: those that differ from `against` (default: from the defaults)."""
        base = against or Options()
        out = [f"--{k} {_flag(getattr(self, k))}" for k in KNOBS if getattr(self, k) != getattr(base, k)]
        return " ".join(out) or "(no memory options)"


def _flag(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def choices(run) -> dict[str, list]:
    """The values each option may take in this run: its own value when the user set it, else the search range."""
    cfg, n = run.cfg, len(run.facts.blocks)
    one = run.world == 1
    dp = run.world // cfg.sequence_parallel_size
    per_rank = cfg.batch_size // dp if cfg.batch_size % dp == 0 else 1
    search = dict(grad_checkpoint=[0, 4, 2, 1], optimizer_offload=[False, True], optimizer_state_dtype=list(FORMATS),
                  master_weights=["fp32", "fp32_copy", "bf16_exact"] if cfg.mixed_precision == "bf16" else ["fp32"],
                  fused_backward=[False, True],
                  blocks_to_swap=list(range(n + 1)) if one and cfg.plugin == "ddp" else [0],
                  ema_on_host=[False, True] if one and cfg.ema_decay > 0 else [False],
                  grad_accum=[m for m in range(1, per_rank + 1) if per_rank % m == 0])
    return {k: ([getattr(cfg, k)] if getattr(cfg, k) != DEFAULTS[k] else search[k]) for k in KNOBS}


def cost(run, o: Options) -> float:
    """Seconds per optimizer step under the cost model of the module docstring."""
    f, cfg = run.facts, run.cfg
    compute = f.flops * cfg.batch_size / run.world / COMPUTE_FLOPS
    share = sum(checkpointed(o.grad_checkpoint, len(f.blocks))) / len(f.blocks) if o.grad_checkpoint else 0.0
    t = compute * (1 + share / 3 + MICRO_BATCH_COST * (o.grad_accum - 1) + FORMAT_COST[o.optimizer_state_dtype]
                   + FUSED_COST * o.fused_backward)
    pb = 4 if o.master_weights == "fp32" else 2
    traffic = 0.0
    if o.optimizer_offload:
        states, master = run.state_bytes(o.optimizer_state_dtype, o.master_weights, True)
        traffic += 2 * (states + master) + 2 * f.trainable * pb
    if o.blocks_to_swap:
        traffic += (3 if o.grad_checkpoint else 2) * sum(f.blocks[-o.blocks_to_swap:]) * pb
    if o.ema_on_host:
        traffic += f.trainable * pb
    return t + traffic / PCIE_BYTES_S


def candidates(run) -> list[tuple[float, Options, dict]]:
    """Every combination of the options' values: (cost, options, bytes by part), cheapest first."""
    ranges = choices(run)
    out = []
    for values in itertools.product(*(ranges[k] for k in KNOBS)):
        o = Options(**dict(zip(KNOBS, values)))
        if o.fused_backward and o.grad_accum > 1:  # never valid: skip before the costly checks
            continue
        out.append((cost(run, o), o, None))
    out.sort(key=lambda c: (c[0], c[1].grad_accum))
    return out


@dataclasses.dataclass
class Choice:
    options: Options
    parts: dict  # {"gpu": {part: bytes}, "host": {...}}
    seconds: float
    next_smaller: "Choice | None" = None  # the fastest valid plan with less device memory


def totals(parts: dict, on_cpu: bool) -> tuple[float, float]:
    """(device bytes, host bytes); a CPU run holds both in one memory: (all, all)."""
    gpu, host = sum(parts["gpu"].values()), sum(parts["host"].values())
    return (gpu + host, gpu + host) if on_cpu else (gpu, host)


def choose(run, budget: tuple[float, float], validate, on_cpu: bool = False) -> Choice:
    """The fastest valid plan within budget (device bytes, host bytes). validate(options) raises ValueError for an
    invalid plan. No fit: a ValueError naming the smallest budget that would fit."""
    valid, smallest, best, refusals = {}, None, None, []

    def ok(o):
        if o not in valid:
            try:
                validate(o)
                valid[o] = True
            except ValueError as e:
                valid[o] = False
                refusals.append(e)
        return valid[o]

    for seconds, o, _ in candidates(run):
        parts = account(run, o)
        gpu, host = totals(parts, on_cpu)
        fits = gpu <= budget[0] and host <= budget[1]
        if best is None and fits and ok(o):
            best = Choice(o, parts, seconds)
        elif best is not None and fits and gpu < totals(best.parts, on_cpu)[0] - 2**20 and ok(o):
            best.next_smaller = Choice(o, parts, seconds)
            return best
        if best is None and (smallest is None or max(gpu / budget[0] if budget[0] else 0, host / budget[1]) <
                             smallest[0]) and ok(o):
            smallest = (max(gpu / budget[0] if budget[0] else 0, host / budget[1]), o, gpu, host)
    if best is not None:
        return best
    if smallest is None:  # the run itself is invalid, whatever the planner chooses
        raise refusals[0]
    _, o, gpu, host = smallest
    where = f"{host / 2**30:.1f} GiB of memory" if on_cpu else \
        f"{gpu / 2**30:.1f} GiB of device memory and {host / 2**30:.1f} GiB of host memory"
    ema_gib = 4 * run.facts.trainable / run.shards / 2**30
    ema = f" (--ema_decay 0 drops the EMA's {ema_gib:.1f} GiB)" if run.cfg.ema_decay > 0 else ""
    raise ValueError(f"--memory_budget: no plan fits {budget[0] / 2**30:.1f} GiB device / {budget[1] / 2**30:.1f} "
                     f"GiB host; the smallest needs {where} ({o.flags()}); raise --memory_budget to that, or leave "
                     f"more of the options {', '.join('--' + k for k in KNOBS)} at their defaults for the planner, "
                     f"or lower --batch_size / --image_size{ema}")
