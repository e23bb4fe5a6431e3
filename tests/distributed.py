"""Spawn a gloo process group on the CPU and run a function on every rank (see opendit.distributed.spawn_gloo).

`run_distributed(fn, world_size, *args)` returns the list of fn's return values, indexed by rank.
fn(rank, world_size, *args) runs after init_process_group; it must be a module-level function.
`train_each` is such a function: several training runs in one spawn (a plugin matrix pays the start-up once).
"""
from opendit.distributed import spawn_gloo as run_distributed


def train_each(rank, world_size, configs) -> list[list[float]]:
    """Each TrainConfig's losses, one Trainer after another in this process group."""
    from opendit.training.loop import Trainer
    return [Trainer(cfg).train() for cfg in configs]


__all__ = ["run_distributed", "train_each"]
