"""validate_run: the checks of a run's options shared by the Trainer and the memory planner."""
from opendit.booster import build_plugin
from opendit.parallel import validate_sp
from opendit.training.optimizer import run_optimizer_settings, validate_optimizer


def validate_run(cfg, spec, world_size: int, device=None):
    """Every impossible combination of a run's options, as a ValueError naming the flag and the fix, before any work
    (no process group needed) -> (the plugin, the optimizer's settings, the sequence-parallel kind). The Trainer asks
    it, and so does the memory planner (opendit.plan) of every plan it would pick."""
    plugin = build_plugin(cfg.plugin, mixed_precision=cfg.mixed_precision, dp_replicate=cfg.dp_replicate,
                          sp_size=cfg.sequence_parallel_size, grad_checkpoint=cfg.grad_checkpoint, compile=cfg.compile,
                          device=device, blocks_to_swap=cfg.blocks_to_swap)
    plugin.validate(world_size)
    optimizer = run_optimizer_settings(cfg, device)
    validate_optimizer(optimizer, plugin=cfg.plugin, world_size=world_size, mixed_precision=cfg.mixed_precision,
                       grad_clip=cfg.grad_clip, blocks_to_swap=cfg.blocks_to_swap)
    sp_kind = validate_sp(world_size, cfg.sequence_parallel_size, cfg.sequence_parallel_type, spec.num_heads,
                          kinds=spec.sp_kinds)
    if cfg.ema_on_host and (world_size > 1 or cfg.ema_decay == 0):
        raise ValueError("--ema_on_host is for one process with an EMA (--ema_decay > 0); with several "
                         "processes the EMA is already sharded over the ranks: leave it out")
    dp_size = world_size // cfg.sequence_parallel_size
    if cfg.grad_accum < 1 or cfg.batch_size % (dp_size * cfg.grad_accum):
        raise ValueError(f"--batch_size {cfg.batch_size} must be divisible by data-parallel size "
                         f"{dp_size} x --grad_accum {cfg.grad_accum}")
    return plugin, optimizer, sp_kind
