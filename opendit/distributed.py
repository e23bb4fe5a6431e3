"""Process-group set-up shared by the entry scripts, and the two ways to see through distributed wrappers.

Under torchrun (WORLD_SIZE set) this joins the job's group: NCCL for CUDA tensors plus gloo for CPU ones when
a GPU exists, gloo otherwise. A plain `python train.py` gets a one-process gloo group, so the same code paths
(DeviceMesh, DTensor, DCP) run everywhere.

`local_tensor` gives this rank's part of a DTensor; `unwrap_model` the module inside a DDP or torch.compile
wrapper. Both import nothing from opendit, so the booster, the optimizers and the EMA can share them.
"""
import datetime
import logging
import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_distributed(timeout_minutes: float | None = None) -> DistInfo:
    """Join (or make) the process group. timeout_minutes: how long a collective waits for a peer before it
    fails (None: torch's default, 10 min for NCCL, 30 min for gloo)."""
    cuda = torch.cuda.is_available()
    kw = {} if timeout_minutes is None else {"timeout": datetime.timedelta(minutes=timeout_minutes)}
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:
            store = _restart_safe_store(kw.get("timeout", dist.default_pg_timeout))
            if store is not None:
                kw.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
            dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", device_id=device if cuda else None,
                                    **kw)
            wait_for_peers()
        else:
            dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", store=dist.HashStore(), rank=0,
                                    world_size=1, device_id=device if cuda else None, **kw)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def wait_for_peers() -> None:
    """Return once every rank of the job has got here; call it after creating process groups. A rank that went on
    and stopped on an error only it sees (rank 0 resolving --load) would take its store away from a peer still
    reading it to connect the same groups, and that peer would log a C++ stack trace of the lost store."""
    dist.all_reduce(torch.zeros(1))  # a CPU tensor: gloo, the backend that reads the store to connect


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """torch's init_device_mesh (a collective: every rank builds it), returned once every rank has connected its
    groups (wait_for_peers)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    wait_for_peers()
    return mesh


def _restart_safe_store(timeout: datetime.timedelta):
    """A store of this attempt's own under torchrun (None: torch makes a fresh one itself).

    By default torchrun keeps one store server for the whole job (TORCHELASTIC_USE_AGENT_STORE=True), and a
    restarted attempt finds the keys the killed one left there: gloo's peer addresses, NCCL's unique id. A new
    rank can read a dead peer's address and init_process_group fails ("Gloo connectFullMesh failed ...
    Connection refused"; PyTorch issue 135712). torch's own scope for an attempt, the restart count, is a count
    per node: after a failure on one node of several the counts differ, and the nodes look under different keys.
    So rank 0 of every attempt serves a new store on its node and announces its address, port and a token in the
    job's store (at MASTER_ADDR, which need not be rank 0's node); the other ranks connect to what is announced
    there and check the token. An address the killed attempt announced refuses the connection (its server died
    with it) or shows another token, and is read again until rank 0 of this attempt has announced its own: no
    setting (TORCH_DISABLE_SHARE_RDZV_TCP_STORE) is needed on any node."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host, rank, world = os.environ["MASTER_ADDR"], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    job = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    if rank == 0:
        own = dist.TCPStore(_reachable_address(host, int(os.environ["MASTER_PORT"])), 0, world, is_master=True,
                            timeout=timeout, wait_for_workers=False)
        token = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
        own.set(_ATTEMPT_TOKEN, token)
        job.set(_ATTEMPT_STORE, f"{own.host} {own.port} {token}")
        return _keep_attempt_scope(job, token, own)
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        address, port, token = job.get(_ATTEMPT_STORE).decode().split()
        try:
            own = dist.TCPStore(address, int(port), is_master=False, timeout=_PROBE)
            if own.get(_ATTEMPT_TOKEN).decode() == token:
                return _keep_attempt_scope(job, token, own)
        except (RuntimeError, dist.DistError):  # the killed attempt's server, gone: wait for this attempt's
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: timed out after {timeout} waiting for rank 0 of this torchrun attempt "
                               f"to announce its store (last announced: port {port} on {address})")
        time.sleep(0.2)


def _keep_attempt_scope(job, token: str, own):
    global _lasting
    _lasting = dist.PrefixStore(f"opendit/attempt/{token}/", job)
    return own


def lasting_store():
    """A store that every rank of this job reaches and that outlives any one worker: this attempt's keys in
    torchrun's job store when rank 0 serves the attempt's own (whose server ends with rank 0), else the default
    store. For messages between ranks about a failure, such as "rank 0 has printed the error"."""
    return _lasting or dist.distributed_c10d._get_default_store()


def _reachable_address(host: str, port: int) -> str:
    """This node's address on the route to host:port (the job's store), which the other nodes reach too; the
    host name where no route is found."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP: picks the route and the local address, sends nothing
            return s.getsockname()[0]
    except OSError:
        return socket.getfqdn()


_ATTEMPT_STORE, _ATTEMPT_TOKEN = "opendit/attempt-store", "opendit/attempt-token"
_lasting = None  # lasting_store() under a store of the attempt's own
_PROBE = datetime.timedelta(seconds=3)  # connecting to an announced store: a live one answers at once


def default_num_workers() -> int:
    """DataLoader workers per process when the user sets none: the CPU cores this process may use, shared by
    the processes of this node, less one for the process itself; at most 4 (enough to keep a GPU fed from a
    latent cache or decoded images of DiT's sizes)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_process = cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(0, min(4, per_process - 1))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (an FSDP2 shard, or a replica), else the tensor itself.

    The DTensor's own storage tensor, not `to_local()`: with grad mode on, to_local() of a parameter is the
    output of an autograd function, and in-place updates of it (optimizer steps, master-weight rounding)
    raise. For tensors without autograd history (gradients) both give the same storage."""
    return t._local_tensor if isinstance(t, DTensor) else t


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP and torch.compile wrappers around the root module, whose parameter names carry their
    prefixes ("module.", "_orig_mod."). FSDP2, per-block compile and composable checkpointing change
    modules in place and leave nothing to strip."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def in_process_group() -> bool:
    """True inside an initialised process group (train.py and sample.py always make one; a library call
    from plain Python may run without)."""
    return dist.is_available() and dist.is_initialized()


def current_rank() -> int:
    return dist.get_rank() if in_process_group() else 0


def barrier() -> None:
    if in_process_group():
        dist.barrier()


def all_gather_objects(obj, group=None) -> list:
    """Every rank's obj, in rank order ([obj] without a process group). group: another process group than the
    default one (the background checkpoint writer's)."""
    if not in_process_group():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank src's obj on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_mean(value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def cleanup() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int = 0) -> None:
    """End an entry script's process that ran collectives, after cleanup(): flush logs and streams, then
    os._exit. Interpreter finalization is skipped on purpose: a gloo worker thread may still be dropping its
    last reference to a finished collective's tensors, which needs the GIL; during finalization that thread
    is killed inside a noexcept destructor and the process aborts (SIGABRT, "terminate called without an
    active exception") although all work is done. Seen about once in 40-150 two-rank runs on a loaded CPU."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _spawned(rank, world_size, port, result_dir, environ, fn, args):
    os.environ.clear()  # the caller's, now: a forked rank has the forkserver's
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)  # the parent's: see spawn_gloo
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        out = {"ok": fn(rank, world_size, *args)}
    except BaseException:
        out = {"error": traceback.format_exc()}
        raise
    finally:
        torch.save(out, os.path.join(result_dir, f"{rank}.pt"))
        dist.destroy_process_group()
    exit_process(0)  # the result is saved; see exit_process for why finalization is skipped


# What every spawned rank imports first, imported once by the forkserver (each rank is a fork of it). torch only:
# opendit's own modules read the rank's environment when imported (OPENDIT_FAMILIES), so each rank imports them
SPAWN_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor"]


def spawn_gloo(fn, world_size: int, *args) -> list:
    """Run fn(rank, world_size, *args) in world_size new CPU processes joined in a gloo group (tests and
    benchmarks); returns fn's return values by rank. fn must be importable (module level).

    The ranks are forks of multiprocessing's forkserver: a clean process (no threads, nothing run) that imported
    SPAWN_PRELOAD once, so a rank starts in milliseconds instead of importing torch again (seconds on a small
    CPU, in every rank of every call). Each rank takes this process's current environment and working folder
    (multiprocessing passes the folder), as a spawned one would."""
    # the parent serves the group's store on a port it keeps bound: a port found free and let go could be taken by
    # another test's group in the meantime, whose ranks would then meet ours and wait for ever
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.set_forkserver_preload(SPAWN_PRELOAD)  # read when the forkserver starts (the first call)
    with tempfile.TemporaryDirectory() as result_dir:
        mp.start_processes(_spawned, args=(world_size, store.port, result_dir, dict(os.environ), fn, args),
                           nprocs=world_size, join=True, start_method="forkserver")
        results = [torch.load(os.path.join(result_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError("a rank failed:\n" + errors[0])
    return [r["ok"] for r in results]
