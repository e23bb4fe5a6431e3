"""Bytes per part of one training step under a plan (the options the planner chooses), on the device (GPU) and
in host memory, from the model's measured facts (opendit.plan.measure). Each term says where it comes from.

Per device, with S = the ranks a sharded plugin shards over (1 for ddp), b = samples per micro-batch:
- weights: trainable parameters in fp32, or bf16 under a bf16 --master_weights mode; a LoRA base as stored. Block
  swap N moves the last N blocks to the host and holds two of them on the device (the running one, the next).
  Sharded plugins hold 1/S, plus what FSDP2 gathers in the compute dtype (zero2: every parameter for the step;
  zero3 / hsdp / gemini: the root's and two blocks'). gemini keeps its shards on the host.
- gradients: as the weights, 1/S; --fused_backward: one block's at a time. A step makes its gradients during
  backward, block by block as it frees those blocks' activations, and frees them after the optimizer step
  (zero_grad(set_to_none)): at its peak it holds the activations and workspace (backward's start) or the gradients
  (its end), so the part counts only what the gradients need beyond those (grads_replace_activations). Not where
  they outlive the step: DDP's buckets on several processes hold them, and --grad_accum's later micro-batches start
  with them. Not under plain autocast either, for now: there the activations are measured as with bf16 weights, and
  autocast keeps more (fp32 norm and softmax inputs beside the bf16 matmul inputs: 26% more for DiT-B/2 on a CPU),
  which the gradients counted in full cover.
- optimizer states and master copy: what opendit's (or torch's) optimizer allocates for these shapes, built on the
  meta device; 1/S. --optimizer_offload keeps them on the host, with a working set on the device sized for the
  largest tensor of a block (its host parts twice, for the prefetched next tensor, + fp32 m, v, master and
  gradient 16 B + 8 B of encode / decode temporaries per element: an estimate).
- EMA: fp32 of the trained parameters, 1/S; on the host with --ema_on_host; none with --ema_decay 0.
- activations: b x (root + every block not checkpointed: what it saves + every checkpointed block: its inputs +
  the largest checkpointed block again, recomputed in its backward).
- buffers / workspace: backward temporaries, b x half the largest block's saved bytes (estimate, checked against
  measured peaks by tests/test_plan.py); under plain autocast (ddp, fp32 weights, bf16 compute) the bf16 copies of
  the weights autograd saves (2 B per parameter of every block kept, and of the block recomputed).
- text encoders, VAE: the family's frozen encoders (opendit.families MemoryProbe); none from a latent cache;
  text encoders sharded over every rank under zero3 / hsdp / gemini.
"""
from dataclasses import dataclass, field

import torch

from opendit.booster import PLUGINS
from opendit.optim import build_optimizer

PARTS = ("weights", "gradients", "optimizer states", "master copy", "EMA", "activations", "buffers / workspace",
         "text encoders", "VAE")
WORKSPACE = 0.5  # backward temporaries, as a share of the largest block's saved bytes
OFFLOAD_TEMP = 8  # bytes per element of the offloaded optimizer's encode / decode temporaries (estimate)


@dataclass
class Run:
    """What stays fixed while the planner varies its options: the model's facts, encoders, precision, world."""
    facts: object  # opendit.plan.measure.ModelFacts
    encoders: dict  # {name: bytes}, {} from a latent cache
    cfg: object  # the run's TrainConfig (plugin, batch, precision, optimizer, EMA, LoRA)
    world: int = 1
    _states: dict = field(default_factory=dict)  # cached sums, by options

    @property
    def shards(self) -> int:
        if not PLUGINS[self.cfg.plugin].sharded:
            return 1
        return max(self.world // (self.cfg.sequence_parallel_size * self.cfg.dp_replicate), 1)

    def block_bytes(self, every: int) -> tuple[float, float, float]:
        if ("blocks", every) not in self._states:
            self._states[("blocks", every)] = _block_bytes(self.facts, every)
        return self._states[("blocks", every)]

    def state_bytes(self, fmt: str, master: str, lean: bool) -> tuple[int, int]:
        """(optimizer state bytes, master bytes) for every trainable parameter (torch's AdamW: 8 B each)."""
        if not lean:
            return 8 * self.facts.trainable, 0
        key = (fmt, master)
        if key not in self._states:
            self._states[key] = optimizer_bytes(self.facts.shapes, self.cfg.optimizer, fmt, master)
        return self._states[key]


def _block_bytes(f, every: int) -> tuple[float, float, float]:
    """(activations, workspace, autocast weight copies) at batch 1 under --grad_checkpoint `every`."""
    ck = checkpointed(every, len(f.acts))
    kept = [a.inputs if c else a.kept for a, c in zip(f.acts, ck)]
    recompute = max((a.kept for a, c in zip(f.acts, ck) if c), default=0)
    held = sum(n for n, c in zip(f.blocks, ck) if not c) + max((n for n, c in zip(f.blocks, ck) if c), default=0)
    return f.root_acts + sum(kept) + recompute, WORKSPACE * max(a.kept for a in f.acts), 2 * held


def optimizer_bytes(shapes, name: str, fmt: str, master: str) -> tuple[int, int]:
    """(state bytes without the master, master bytes) opendit's optimizer allocates for parameters of these
    shapes (built on the meta device, no storage)."""
    dtype = torch.float32 if master == "fp32" else torch.bfloat16
    params = [torch.nn.Parameter(torch.empty(s, device="meta", dtype=dtype)) for s in shapes]
    opt = build_optimizer(params, name, state_dtype=fmt, master_weights=master)
    opt.init_states()
    states = masters = 0
    for st in opt.state.values():
        for k, t in st.items():
            if torch.is_tensor(t) and k not in ("step", "mu_product"):
                size = t.numel() * t.element_size()
                masters += size if k.startswith("master") else 0
                states += 0 if k.startswith("master") else size
    return states, masters


def checkpointed(every: int, n: int) -> list[bool]:
    """Which of n blocks --grad_checkpoint `every` checkpoints (opendit.booster.parallelize's rule)."""
    return [every > 0 and i % every == 0 for i in range(n)]


def gathered_bytes(plugin: str, params: int, blocks: list[int], cb: int) -> int:
    """Parameter bytes FSDP2 holds unsharded at once, in the compute dtype (cb bytes each): zero2 every parameter
    for the step; zero3 / hsdp / gemini the root's and two blocks' (the running one, the prefetched next); ddp 0."""
    if not PLUGINS[plugin].sharded:
        return 0
    return params * cb if plugin == "zero2" else (params - sum(blocks) + 2 * max(blocks)) * cb


def offload_working_set(largest: int, host_bytes: float) -> float:
    """--optimizer_offload's device bytes for a tensor of `largest` elements whose states and master take
    host_bytes per element on the host: those parts twice (this tensor's, the prefetched next's) + fp32 m, v,
    master and gradient (16 B) + OFFLOAD_TEMP of encode / decode temporaries."""
    return largest * (2 * host_bytes + 16 + OFFLOAD_TEMP)


def account(run: Run, o) -> dict[str, dict[str, float]]:
    """{"gpu": {part: bytes}, "host": {part: bytes}} of one step under the options `o` (a config-like object)."""
    f, cfg, S = run.facts, run.cfg, run.shards
    plugin = PLUGINS[cfg.plugin]
    offload = getattr(plugin, "offload", False)  # gemini: shards, gradients and states on the host
    pb = 4 if o.master_weights == "fp32" else 2  # trained weights' (and gradients') bytes
    cb = 4 if cfg.mixed_precision == "fp32" else 2  # compute dtype's
    gpu, host = {p: 0.0 for p in PARTS}, {p: 0.0 for p in PARTS}
    weights = (f.trainable * pb + f.frozen_bytes) / S
    swapped = sum(f.blocks[len(f.blocks) - o.blocks_to_swap:]) * pb if o.blocks_to_swap else 0
    in_flight = 2 * max(f.blocks[len(f.blocks) - o.blocks_to_swap:]) * pb if o.blocks_to_swap else 0
    gathered = gathered_bytes(cfg.plugin, f.params, f.blocks, cb)
    (host if offload else gpu)["weights"] += weights - swapped
    gpu["weights"] += in_flight + gathered
    host["weights"] += swapped
    block_grad = max(f.block_trainable) * pb
    grads = block_grad if o.fused_backward else f.trainable * pb / S + (block_grad * cb / pb if S > 1 else 0)
    (host if offload and not o.fused_backward else gpu)["gradients"] += grads
    lean = o.optimizer_offload or o.optimizer_state_dtype != "fp32" or o.master_weights != "fp32" or \
        o.fused_backward or cfg.optimizer != "adamw"
    states, master = (x / S for x in run.state_bytes(o.optimizer_state_dtype, o.master_weights, lean))
    away = o.optimizer_offload or offload
    (host if away else gpu)["optimizer states"] += states
    (host if away else gpu)["master copy"] += master
    if o.optimizer_offload:
        gpu["optimizer states"] += offload_working_set(f.largest, (states + master) * S / max(f.trainable, 1))
    if cfg.ema_decay > 0:
        (host if o.ema_on_host or offload else gpu)["EMA"] += 4 * f.trainable / S
    freed = _activations(run, o, gpu, cb, pb)
    if grads_replace_activations(run, o) and not offload and not autocast(cfg, pb):
        gpu["gradients"] = max(0.0, gpu["gradients"] - freed)
    for name, size in run.encoders.items():
        share = S if getattr(plugin, "reshard_after_forward", False) and "VAE" not in name else 1
        gpu["VAE" if "VAE" in name else "text encoders"] += size / share
    return {"gpu": gpu, "host": host}


def autocast(cfg, pb: int) -> bool:
    """Plain autocast: fp32 weights (pb 4 bytes) computing in bf16 / fp16 under --plugin ddp."""
    return cfg.mixed_precision != "fp32" and pb == 4 and cfg.plugin == "ddp"


def grads_replace_activations(run: Run, o) -> bool:
    """Whether the step's gradients exist only from its backward to its optimizer step (module docstring)."""
    return not o.fused_backward and o.grad_accum == 1 and not (run.cfg.plugin == "ddp" and run.world > 1)


def _activations(run: Run, o, gpu: dict, cb: int, pb: int) -> float:
    """Adds the activations and the backward workspace -> their bytes (backward frees them as it goes); autocast's
    weight copies are held until it ends."""
    cfg = run.cfg
    micro = cfg.batch_size / (run.world // cfg.sequence_parallel_size) / o.grad_accum / cfg.sequence_parallel_size
    acts, workspace, autocast_copies = run.block_bytes(o.grad_checkpoint)
    gpu["activations"] += micro * acts
    gpu["buffers / workspace"] += micro * workspace
    if autocast(cfg, pb):  # autocast's saved bf16 weight copies
        gpu["buffers / workspace"] += autocast_copies
    return micro * (acts + workspace)
