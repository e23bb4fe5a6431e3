"""Spawn a gloo process group on the CPU and run a function on every rank.

`run_distributed(fn, world_size, *args)` returns the list of fn's return values, indexed by rank.
fn(rank, world_size, *args) runs after init_process_group; it must be a module-level function.
"""
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, result_dir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        out = fn(rank, world_size, *args)
        torch.save({"ok": out}, os.path.join(result_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(result_dir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size, *args):
    with tempfile.TemporaryDirectory() as result_dir:
        mp.spawn(_worker, args=(world_size, _free_port(), result_dir, fn, args), nprocs=world_size, join=True)
        results = [torch.load(os.path.join(result_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError("a rank failed:\n" + errors[0])
    return [r["ok"] for r in results]
