"""The optimizer a training run asks for: checks before any work, the optimizer itself (built before
booster.boost, like any optimizer, so boosting rebinds its groups to the sharded parameters), and what must
happen after boosting (states allocated, fused-backward hooks on the boosted parameters).

| --optimizer          | lean option set? | optimizer                                     |
|----------------------|------------------|-----------------------------------------------|
| adamw                | no               | torch.optim.AdamW (fused kernel on CUDA)      |
| adamw, nadamw, adan  | yes / any        | opendit.optim (LeanOptimizer)                 |
| adafactor            | must not be      | torch.optim.Adafactor                         |

Lean options: --optimizer_offload, --optimizer_state_dtype != fp32, --master_weights != fp32,
--fused_backward. States exist for this rank's shard only (FSDP2) and are saved as DTensors with the
parameter's placements, so Distributed Checkpoint saves, reshards and restores them exactly.
"""
import dataclasses

import torch

from opendit.booster import PLUGINS
from opendit.optim import (FORMATS, MASTER_MODES, OPTIMIZER_NAMES, LeanOptimizer, OptimizerSettings,
                           attach_fused_backward)

SHARDED_PLUGINS = tuple(name for name, plugin in PLUGINS.items() if plugin.sharded)


def run_optimizer_settings(cfg, device=None) -> OptimizerSettings:
    """The optimizer a run's flags ask for (see the table above): --optimizer adamw without a lean option is
    torch's AdamW, with its single-kernel step where every parameter is on the GPU at step time (not under
    --plugin gemini or --blocks_to_swap)."""
    fused_kernel = device is not None and torch.device(device).type == "cuda" and cfg.plugin != "gemini" and \
        not cfg.blocks_to_swap
    settings = OptimizerSettings(cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                 state_device="cpu" if cfg.optimizer_offload else "gpu",
                                 state_dtype=cfg.optimizer_state_dtype, master_weights=cfg.master_weights,
                                 fused_backward=cfg.fused_backward, grad_accum_steps=cfg.grad_accum,
                                 seed=cfg.global_seed, fused_kernel=fused_kernel)
    return dataclasses.replace(settings, name="torch_adamw") if settings.name == "adamw" and not settings.lean \
        else settings


def validate_optimizer(opts: OptimizerSettings, *, plugin: str, world_size: int, mixed_precision: str,
                       grad_clip: float, blocks_to_swap: int = 0) -> None:
    """Raise ValueError naming the flag and the fix for every combination that cannot train correctly."""
    name = "adamw" if opts.name == "torch_adamw" else opts.name
    for flag, value, valid in (("--optimizer", name, OPTIMIZER_NAMES),
                               ("--optimizer_state_dtype", opts.state_dtype, FORMATS),
                               ("--master_weights", opts.master_weights, MASTER_MODES)):
        if value not in valid:
            raise ValueError(f"unknown {flag} {value!r}; valid: {', '.join(valid)}")
    if opts.name == "adafactor" and opts.lean:
        raise ValueError("--optimizer adafactor is torch's Adafactor, which has no --optimizer_offload, "
                         "--optimizer_state_dtype, --master_weights or --fused_backward; drop them, or use "
                         "--optimizer adamw/nadamw/adan")
    if opts.name == "adafactor" and plugin in SHARDED_PLUGINS:
        raise ValueError(f"--optimizer adafactor does not run on --plugin {plugin}: torch's Adafactor factors "
                         "each gradient with in-place ops that DTensor shards cannot take; use --plugin ddp, or "
                         "--optimizer adamw/nadamw/adan (with --optimizer_state_dtype u16 for small states)")
    if opts.master_weights != "fp32" and mixed_precision != "bf16":
        raise ValueError(f"--master_weights {opts.master_weights} keeps the parameters in bf16, so compute "
                         f"must be bf16 too, got --mixed_precision {mixed_precision}; add --mixed_precision bf16 "
                         "or use --master_weights fp32")
    if opts.fused_backward:
        _validate_fused(plugin, world_size, mixed_precision, opts.grad_accum_steps, grad_clip)
        if blocks_to_swap and opts.state_device != "cpu":
            raise ValueError(f"--blocks_to_swap {blocks_to_swap} with --fused_backward needs --optimizer_offload: "
                             "the swapped blocks update on the GPU inside backward, so their states would be "
                             "made there and cost more memory than swapping saves")


def _validate_fused(plugin, world_size, mixed_precision, grad_accum, grad_clip) -> None:
    if plugin == "ddp" and world_size > 1:
        raise ValueError(f"--fused_backward with --plugin ddp at world size {world_size}: DDP all-reduces a "
                         "gradient after autograd accumulates it, so the update in the accumulate hook would use "
                         "this rank's un-reduced gradient; use --plugin zero2/zero3/hsdp/gemini (their hooks fire "
                         "after the reduce-scatter) or run one process")
    if grad_accum != 1:
        raise ValueError(f"--fused_backward updates every parameter during each backward pass, so gradients "
                         f"cannot accumulate (--grad_accum {grad_accum}); use --grad_accum 1 (a larger "
                         "--batch_size) or drop --fused_backward")
    if grad_clip > 0:
        raise ValueError(f"--grad_clip {grad_clip} clips by the norm of all gradients, which do not coexist "
                         "under --fused_backward (each is freed right after its update); use --grad_clip 0 or "
                         "drop --fused_backward")
    if mixed_precision == "fp16":
        raise ValueError("--fused_backward with --mixed_precision fp16: an overflowing step must be skipped "
                         "as a whole, but parameters are already updated when the overflow is found; use "
                         "--mixed_precision bf16")


def cast_for_master_weights(model: torch.nn.Module, master_weights: str) -> int:
    """bf16 master modes keep the trainable parameters in bf16: cast them in place (before boosting, so the
    sharded copies are bf16 too). Frozen parameters and buffers keep their dtype. Returns the count cast."""
    if master_weights == "fp32":
        return 0
    count = 0
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.bfloat16:
            p.data = p.data.to(torch.bfloat16)
            count += 1
    return count


def prepare_boosted_optimizer(optimizer: torch.optim.Optimizer, opts: OptimizerSettings):
    """After booster.boost: allocate a lean optimizer's states and attach the fused-backward hooks to the
    boosted (sharded) parameters. Returns the FusedBackward handle or None.

    States are allocated now because Distributed Checkpoint "initialises" an empty optimizer by a step on
    zero gradients, which a fused optimizer skips (its step is a no-op): a resumed run would then restore no
    states at all."""
    if isinstance(optimizer, LeanOptimizer):
        optimizer.init_states()
    if opts.fused_backward:
        return attach_fused_backward(optimizer, opts.grad_accum_steps)
    return None
