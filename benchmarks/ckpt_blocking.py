"""How long a checkpoint holds the training step up: a synchronous save (the step waits for the whole write) beside
--async_ckpt (the step waits for the copy to host memory; the write goes on in the background), both through
opendit's own save path (DCP shards, rank files, the manifest's checksums, the rename), for the training state of
DiT-XL/2: weights, AdamW's two moments and the EMA, fp32 (675M parameters, 10.8 GB).

    python benchmarks/ckpt_blocking.py                       # DiT-XL/2 (needs about 2 x 10.8 GB of free memory)
    python benchmarks/ckpt_blocking.py --model DiT-B/2       # smaller, for a quick look
    python benchmarks/ckpt_blocking.py --model DiT-debug --saves 1 --out /tmp/ckpt_smoke     # smoke run

Per mode and save: the seconds the save call blocked, the seconds until the checkpoint was complete (for
--async_ckpt: the background write, waited for after the call), and the throughput of the whole write. The EMA is
left out (and the header says so) when free memory is short of twice the state (the staged copy is a second one).
"""
import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from opendit.checkpoint import save_checkpoint  # noqa: E402
from opendit.checkpoint.async_save import AsyncCheckpointer  # noqa: E402
from opendit.distributed import init_distributed  # noqa: E402
from opendit.ema import ShardedEMA  # noqa: E402
from opendit.families import build_model  # noqa: E402


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def training_state(name: str, with_ema: bool):
    """The model, an AdamW whose moments exist (one step on zero gradients, lr 0), and the EMA (or None)."""
    model = build_model(name, input_size=32, num_classes=1000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # gradients are not part of a checkpoint
    return model, optimizer, ShardedEMA(model) if with_ema else None


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="DiT-XL/2")
    p.add_argument("--saves", type=int, default=2, help="saves per mode")
    p.add_argument("--out", default="outputs/ckpt_blocking", help="where the checkpoints are written (removed after)")
    a = p.parse_args(argv)
    init_distributed()
    with torch.device("meta"):  # sizes only
        params = sum(q.numel() for q in build_model(a.model, input_size=32, num_classes=1000).parameters())
    state_bytes = params * 4 * 4  # weights, two moments, EMA
    with_ema = available_bytes() > 2 * state_bytes + (2 << 30)
    if not with_ema:
        state_bytes = params * 4 * 3
    model, optimizer, ema = training_state(a.model, with_ema)
    root = Path(a.out)
    print(f"{a.model}: {params / 1e6:.0f}M parameters, state {state_bytes / 1e9:.1f} GB (weights, AdamW moments"
          f"{', EMA' if with_ema else '; EMA left out: free memory is short of twice the state'}); "
          f"{os.cpu_count()} cores, torch {torch.__version__}, writing to {root.resolve()}\n")
    rows, background = [], AsyncCheckpointer()
    for mode in ("sync", "async"):
        for k in range(a.saves):
            step = len(rows) + 1
            start = time.perf_counter()
            if mode == "sync":
                save_checkpoint(str(root), step, model, optimizer, ema=ema, keep_last=1)
                blocked = done = time.perf_counter() - start
            else:
                blocked = background.save(str(root), step, model, optimizer, ema=ema, keep_last=1)
                background.wait()
                done = time.perf_counter() - start
            rows.append(dict(mode=mode, save=k + 1, blocked_s=blocked, complete_s=done,
                             gb_per_s=state_bytes / 1e9 / done))
            print(f"{mode} save {k + 1}: the step blocked {blocked:.2f} s, complete after {done:.2f} s", flush=True)
    background.close()
    shutil.rmtree(root, ignore_errors=True)
    best = {m: min(r["blocked_s"] for r in rows if r["mode"] == m) for m in ("sync", "async")}
    print("\n| mode | save | step blocked (s) | checkpoint complete (s) | GB/s |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['save']} | {r['blocked_s']:.2f} | {r['complete_s']:.2f} | {r['gb_per_s']:.2f} |")
    print(f"\nthe step blocks {best['sync'] / best['async']:.1f}x shorter with --async_ckpt "
          f"({best['async']:.2f} s against {best['sync']:.2f} s, best of {a.saves})")
    return rows


if __name__ == "__main__":
    main()
