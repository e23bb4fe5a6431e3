"""GPU step time of DiT-XL/2 with CPU-offloaded, compressed optimizer states vs AdamW on the GPU.

    python benchmarks/optim_offload.py --batch_size 32 --steps 5          # one H200: about 2 minutes

For each configuration: ms per training step, the step's overhead over forward+backward alone, the time of
the optimizer's work measured on its own (same configuration, not fused into backward), the share of that
work hidden behind compute (1 - overhead / optimizer-alone), and peak GPU memory. bf16 compute throughout.
Our AdamW makes one multi-tensor fused call per step when its states are fp32 on the GPU; the
"per-parameter calls" row runs the same kernel once per parameter, to show what the grouping saves.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from opendit.families import build_model  # noqa: E402
from opendit.optim import build_optimizer  # noqa: E402

CONFIGS = {  # name -> (param dtype, build_optimizer kwargs)
    "torch fused AdamW on GPU (fp32 params, autocast)": (torch.float32, dict(name="torch_adamw")),
    "ours AdamW, fp32 states on GPU (fp32 params)": (torch.float32, dict(name="adamw")),
    "ours AdamW, fp32_copy master (bf16 params), one multi-tensor call": (
        torch.bfloat16, dict(name="adamw", master_weights="fp32_copy")),
    "ours AdamW, fp32_copy master (bf16 params), per-parameter calls": (
        torch.bfloat16, dict(name="adamw", master_weights="fp32_copy", multi_tensor=False)),
    "ours AdamW, fp32 states on CPU (fp32 params)": (torch.float32, dict(name="adamw", state_device="cpu")),
    "ours AdamW, u16 states on CPU, bf16_exact": (torch.bfloat16, dict(name="adamw", state_device="cpu",
                                                                       state_dtype="u16", master_weights="bf16_exact")),
    "ours AdamW, f24 states on CPU, bf16_exact, fused backward": (
        torch.bfloat16, dict(name="adamw", state_device="cpu", state_dtype="f24", master_weights="bf16_exact",
                             fused_backward=True)),
}


def timed(fn, steps):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1e3


def run(name, dtype, kw, a):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(a.model, input_size=a.image_size // 8, num_classes=1000).to("cuda", dtype)
    x = torch.randn(a.batch_size, 4, a.image_size // 8, a.image_size // 8, device="cuda")
    t = torch.randint(0, 1000, (a.batch_size,), device="cuda")
    y = torch.randint(0, 1000, (a.batch_size,), device="cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, lr=1e-4, **{k: v for k, v in kw.items() if k != "multi_tensor"})
    opt.multi_tensor = kw.get("multi_tensor", True)

    def fwd_bwd():
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(x.to(dtype), t, y).float().square().mean()
        loss.backward()

    def step():
        fwd_bwd()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(a.warmup):
        step()
    step_ms = timed(step, a.steps)
    peak = torch.cuda.max_memory_allocated() / 2**30
    if kw.get("fused_backward"):
        opt_ms = float("nan")  # measured on the non-fused twin below
    else:
        fwd_bwd()
        opt_ms = timed(opt.step, 1)
    compute_ms = timed(lambda: (fwd_bwd(), [setattr(p, "grad", None) for p in params]), a.steps)
    return step_ms, compute_ms, opt_ms, peak


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="DiT-XL/2")
    p.add_argument("--image_size", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("optim_offload.py needs a CUDA GPU; nothing to measure here")
        return
    rows = ["| configuration | ms/step | fwd+bwd ms | overhead ms | optimizer alone ms | hidden | peak GiB |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    title = f"{a.model}, {a.image_size}px, batch {a.batch_size}, bf16 compute, {torch.cuda.get_device_name()}\n\n"
    alone = {}
    for name, (dtype, kw) in CONFIGS.items():
        if a.out and len(rows) > 2:  # the finished rows, in case a timeout kills the next
            Path(a.out).write_text(title + "\n".join(rows) + "\n")
        try:
            step_ms, compute_ms, opt_ms, peak = run(name, dtype, kw, a)
        except Exception as err:  # OOM or a failure: a row, not a crash, so the other rows still run
            rows.append(f"| {name} | {type(err).__name__}: {str(err)[:80]} | | | | | |")
            print(rows[-1], flush=True)
            continue
        if kw.get("fused_backward"):  # optimizer-alone cost: the same states and master mode, not fused
            twin = {k: v for k, v in kw.items() if k != "fused_backward"}
            opt_ms = run(name, dtype, twin, a)[2]
        overhead = step_ms - compute_ms
        hidden = max(0.0, 1 - overhead / opt_ms) if opt_ms == opt_ms and opt_ms > 0 else float("nan")
        alone[name] = opt_ms
        rows.append(f"| {name} | {step_ms:.1f} | {compute_ms:.1f} | {overhead:.1f} | {opt_ms:.1f} | "
                    f"{hidden:.0%} | {peak:.1f} |")
        print(rows[-1], flush=True)
    table = title + "\n".join(rows)
    print("\n" + table)
    if a.out:
        Path(a.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
