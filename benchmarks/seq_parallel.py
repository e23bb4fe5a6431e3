"""Sequence parallelism: bytes sent per attention layer per rank, and step times, FastSeq vs Ulysses.

    python benchmarks/seq_parallel.py                               # N=1024, D=1152 (DiT-XL), P = 2, 4, 8
    python benchmarks/seq_parallel.py --seq_len 4096 --sizes 2 4 --dtype bf16

For each group size P it spawns P processes (NCCL on one GPU each when there are P GPUs, else gloo on the
CPU), runs one DiT attention layer forward + backward on this rank's N/P tokens, and prints the bytes the
CommCounter recorded (forward and backward) next to the analytic formula of opendit.parallel.plan, in units of
B*N*D*e (the size of the whole layer input), plus the median step time. The no-SP row is one process with the
whole sequence. Step times on the CPU show the method works, not how fast an interconnect is.
"""
import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from opendit.booster.precision import DTYPES  # noqa: E402
from opendit.models.layers import Attention  # noqa: E402
from opendit.parallel import KINDS, CommCounter, SequenceParallel, comm_bytes_per_layer, default_sp_kind  # noqa: E402



def time_steps(attn, x, steps, device):
    """Median seconds of forward + backward over `steps` runs after one warm-up."""
    times = []
    for i in range(steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        attn(x).float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_layer(cfg, device):
    torch.manual_seed(0)
    attn = Attention(cfg["hidden"], cfg["heads"]).to(device, DTYPES[cfg["dtype"]])
    attn.attn_backend = cfg["backend"]
    return attn


def worker(rank, P, port, out_dir, cfg):
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= P
    device = torch.device(f"cuda:{rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:  # P processes share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // P))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=P)
    rows = []
    try:
        n = -(-cfg["seq_len"] // P)
        for kind in KINDS:
            attn, counter = make_layer(cfg, device), CommCounter()
            attn.sequence_parallel = SequenceParallel(dist.group.WORLD, kind, counter)
            x = torch.randn(cfg["batch"], n, cfg["hidden"], device=device, dtype=DTYPES[cfg["dtype"]],
                            requires_grad=True)
            attn(x).float().sum().backward()  # one counted step
            fwd, bwd = counter.total(".fwd"), counter.total(".bwd")
            rows.append((kind, fwd, bwd, time_steps(attn, x, cfg["steps"], device)))
        if rank == 0:
            torch.save(rows, os.path.join(out_dir, f"{P}.pt"))
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def baseline_time(cfg):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    attn = make_layer(cfg, device)
    x = torch.randn(cfg["batch"], cfg["seq_len"], cfg["hidden"], device=device, dtype=DTYPES[cfg["dtype"]],
                    requires_grad=True)
    return time_steps(attn, x, cfg["steps"], device)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1152)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--backend", choices=["sdpa", "flash", "math"], default="sdpa")
    args = p.parse_args()
    cfg = vars(args)
    bad = [P for P in args.sizes if args.heads % P]
    if bad:
        sys.exit(f"--sizes {bad} do not divide --heads {args.heads}")
    elem = torch.tensor([], dtype=DTYPES[args.dtype]).element_size()
    unit = args.batch * args.seq_len * args.hidden * elem
    print(f"one attention layer: B={args.batch} N={args.seq_len} D={args.hidden} H={args.heads} {args.dtype}; "
          f"unit B*N*D*e = {unit / 2**20:.2f} MiB; bytes are sent per rank")
    print(f"no SP, 1 process: fwd+bwd {baseline_time(cfg) * 1e3:.1f} ms")
    header = ("P", "method", "fwd MiB", "bwd MiB", "analytic MiB", "fwd / unit", "step ms", "default")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    with tempfile.TemporaryDirectory() as out_dir:
        for P in args.sizes:
            mp.spawn(worker, args=(P, free_port(), out_dir, cfg), nprocs=P, join=True)
            for kind, fwd, bwd, sec in torch.load(os.path.join(out_dir, f"{P}.pt")):
                analytic = comm_bytes_per_layer(kind, P, args.seq_len, args.hidden, args.batch, elem)
                mark = "yes" if kind == default_sp_kind(P) else ""
                print(f"| {P} | {kind} | {fwd / 2**20:.2f} | {bwd / 2**20:.2f} | {analytic / 2**20:.2f} | "
                      f"{fwd / unit:.4f} | {sec * 1e3:.1f} | {mark} |")


if __name__ == "__main__":
    main()
