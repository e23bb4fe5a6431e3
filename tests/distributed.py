"""Spawn a gloo process group on the CPU and run a function on every rank (see opendit.distributed.spawn_gloo).

`run_distributed(fn, world_size, *args)` returns the list of fn's return values, indexed by rank.
fn(rank, world_size, *args) runs after init_process_group; it must be a module-level function.
"""
from opendit.distributed import spawn_gloo as run_distributed

__all__ = ["run_distributed"]
