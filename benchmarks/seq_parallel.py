"""Sequence parallelism: bytes sent per attention layer per rank, and step times, FastSeq vs Ulysses; and bytes
per rank of the video models: VDiT (FastSeq, Ulysses over all T'·S tokens) and Latte (DSP).

    python benchmarks/seq_parallel.py                               # N=1024, D=1152 (DiT-XL), P = 2, 4, 8
    python benchmarks/seq_parallel.py --seq_len 4096 --sizes 2 4 --dtype bf16
    python benchmarks/seq_parallel.py --video_frames 0              # image attention table only

For each group size P it spawns P processes (NCCL on one GPU each when there are P GPUs, else gloo on the
CPU), runs one DiT attention layer forward + backward on this rank's N/P tokens, and prints the bytes the
CommCounter recorded (forward and backward) next to the analytic formula of opendit.parallel.plan, in units of
B*N*D*e (the size of the whole layer input), plus the median step time. The no-SP row is one process with the
whole sequence. Step times on the CPU show the method works, not how fast an interconnect is.

The video table runs one forward + backward of a 2-block VDiT (patch 1x2x2) and a 2-block Latte (patch 2: one
spatial + one temporal block) on a clip of --video_frames x --video_latent^2 latents (default 16 x 32 x 32,
Latte-XL/2's UCF-101 geometry: T' = 16 frames, S = 256 positions, N = 4096 tokens) with the XL width, and prints
the bytes per rank of its blocks (forward, backward, the analytic formula, the forward in units of B*N*D*e) and
of the output gather, and what 28 blocks + the gather (an XL model) send per training step.
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
from opendit.families.video.latte import Latte  # noqa: E402
from opendit.families.video.vdit import VDiT  # noqa: E402
from opendit.kernels import set_kernels
from opendit.models.layers import Attention  # noqa: E402
from opendit.parallel import (  # noqa: E402
    HEAD_KINDS,
    CommCounter,
    SequenceParallel,
    comm_bytes_per_layer,
    default_sp_kind,
    dsp_comm_bytes_per_block,
    enable_sequence_parallel,
    gather_comm_bytes,
)

VIDEO = (("VDiT", VDiT, "fastseq"), ("VDiT", VDiT, "ulysses"), ("Latte", Latte, "dsp"))
VIDEO_DEPTH, XL_DEPTH = 2, 28  # blocks run here; blocks of the XL models the last column scales to



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
        for kind in HEAD_KINDS:
            attn, counter = make_layer(cfg, device), CommCounter()
            attn.sequence_parallel = SequenceParallel(dist.group.WORLD, kind, counter)
            x = torch.randn(cfg["batch"], n, cfg["hidden"], device=device, dtype=DTYPES[cfg["dtype"]],
                            requires_grad=True)
            attn(x).float().sum().backward()  # one counted step
            fwd, bwd = counter.total(".fwd"), counter.total(".bwd")
            rows.append((kind, fwd, bwd, time_steps(attn, x, cfg["steps"], device)))
        video = [video_bytes(cfg, device, *case) for case in VIDEO] if cfg["video_frames"] else []
        if rank == 0:
            torch.save((rows, video), os.path.join(out_dir, f"{P}.pt"))
    finally:
        dist.destroy_process_group()


def video_bytes(cfg, device, name, cls, kind):
    """One counted forward + backward of a VIDEO_DEPTH-block model under `kind` -> (name, kind, blocks fwd,
    blocks bwd, output gather fwd + bwd) bytes sent by this rank."""
    torch.manual_seed(0)  # the same weights and inputs on every rank
    T, L = cfg["video_frames"], cfg["video_latent"]
    model = cls(input_size=(T, L, L), patch_size=(1, 2, 2) if cls is VDiT else 2, hidden_size=cfg["hidden"],
                depth=VIDEO_DEPTH, num_heads=cfg["heads"], class_dropout_prob=0.0, num_classes=10)
    model = model.to(device, DTYPES[cfg["dtype"]])
    set_kernels(model, attn_backend=cfg["backend"])
    counter = CommCounter()
    enable_sequence_parallel(model, dist.group.WORLD, kind, counter)
    x = torch.randn(cfg["batch"], 4, T, L, L, device=device, dtype=DTYPES[cfg["dtype"]])
    t = torch.randint(0, 1000, (cfg["batch"],), device=device)
    model(x, t, y=torch.zeros_like(t)).float().sum().backward()
    blocks = {d: sum(v for k, v in counter.bytes.items() if k.startswith(f"{kind}.") and k.endswith(d))
              for d in (".fwd", ".bwd")}
    return name, kind, blocks[".fwd"], blocks[".bwd"], counter.total("boundary.")


def video_analytic(name, kind, P, cfg, elem):
    """(bytes of VIDEO_DEPTH blocks, bytes of the output gather), forward + backward, per rank."""
    T, S, D, B = cfg["video_frames"], (cfg["video_latent"] // 2) ** 2, cfg["hidden"], cfg["batch"]
    if kind == "dsp":  # one temporal block per pair; the gather is over frames of S tokens x 32 outputs
        return (VIDEO_DEPTH // 2 * dsp_comm_bytes_per_block(P, T, S, D, B, elem),
                gather_comm_bytes(P, T, S * 32, B, elem))
    return VIDEO_DEPTH * comm_bytes_per_layer(kind, P, T * S, D, B, elem), gather_comm_bytes(P, T * S, 32, B, elem)


def print_video_table(args, video, elem):
    T, S = args.video_frames, (args.video_latent // 2) ** 2
    unit = args.batch * T * S * args.hidden * elem
    print(f"\nvideo models, {VIDEO_DEPTH} blocks (Latte: 1 spatial + 1 temporal): B={args.batch} T'={T} S={S} "
          f"N={T * S} D={args.hidden} H={args.heads} {args.dtype}; unit B*N*D*e = {unit / 2**20:.2f} MiB; "
          f"output 32 values per token; bytes sent per rank per training step")
    header = ("P", "model", "method", f"{VIDEO_DEPTH} blocks fwd MiB", "bwd MiB", "analytic MiB", "fwd / unit",
              "gather fwd+bwd MiB", f"{XL_DEPTH} blocks + gather MiB", "default")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for P, rows in video:
        for name, kind, fwd, bwd, gather in rows:
            blocks, gather_analytic = video_analytic(name, kind, P, vars(args), elem)
            if (fwd + bwd, gather) != (blocks, gather_analytic):
                sys.exit(f"{name} {kind} P={P}: counted {fwd + bwd} + {gather} bytes, analytic {blocks} + "
                         f"{gather_analytic}: the counter or the formula is wrong")
            kinds = {"VDiT": VDiT, "Latte": Latte}[name].parallel_plan.kinds
            mark = "yes" if kind == default_sp_kind(P, kinds) else ""
            total = XL_DEPTH // VIDEO_DEPTH * blocks + gather
            print(f"| {P} | {name} | {kind} | {fwd / 2**20:.2f} | {bwd / 2**20:.2f} | {blocks / 2**20:.2f} | "
                  f"{fwd / unit:.4f} | {gather / 2**20:.2f} | {total / 2**20:.1f} | {mark} |")


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
    p.add_argument("--video_frames", type=int, default=16, help="video table: latent frames T' (0: no video table)")
    p.add_argument("--video_latent", type=int, default=32, help="video table: latent side (2x2 patches)")
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
    video = []
    with tempfile.TemporaryDirectory() as out_dir:
        for P in args.sizes:
            mp.spawn(worker, args=(P, free_port(), out_dir, cfg), nprocs=P, join=True)
            rows, video_rows = torch.load(os.path.join(out_dir, f"{P}.pt"))
            video.append((P, video_rows))
            for kind, fwd, bwd, sec in rows:
                analytic = comm_bytes_per_layer(kind, P, args.seq_len, args.hidden, args.batch, elem)
                mark = "yes" if kind == default_sp_kind(P) else ""
                print(f"| {P} | {kind} | {fwd / 2**20:.2f} | {bwd / 2**20:.2f} | {analytic / 2**20:.2f} | "
                      f"{fwd / unit:.4f} | {sec * 1e3:.1f} | {mark} |")
    if args.video_frames:
        print_video_table(args, video, elem)


if __name__ == "__main__":
    main()
