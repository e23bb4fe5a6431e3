"""Where a training step's time goes: a few steps under torch.profiler, device time grouped by kind of kernel.

Used by train_throughput.py --profile KEY (on the already warmed-up variant, so no compilation is profiled).
On CUDA it sums the kernels' own device time; on CPU (smoke runs) the operators' own CPU time.
"""
import re

import torch
from torch.profiler import ProfilerActivity, profile

# first match wins: matmul templates are Triton kernels too, so they are tested before "triton"
CATEGORIES = (
    ("matmul", r"gemm|matmul|cutlass|xmma|nvjet|cublas|aten::(add)?mm\b|aten::bmm|aten::linear|_mm_|addmm|bmm"),
    ("attention", r"flash|fmha|attention|scaled_dot_product|sdpa|cudnn"),
    ("optimizer", r"adam"),
    ("triton (inductor + ours)", r"triton"),
    ("copies / fills", r"memcpy|memset|copy|fill|cat\b|aten::to\b"),
)


def category(name: str) -> str:
    low = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, low):
            return label
    return "other"


def profile_step(step, x, cond, steps: int = 2) -> dict:
    """Run `step(x, cond)` `steps` times under the profiler -> {"per_category": {label: us per step},
    "top": [(name, us per step, calls per step)], "total_us": us per step, "clock": "device" | "cpu"}."""
    cuda = x.is_cuda
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(x, cond)
        if cuda:
            torch.cuda.synchronize(x.device)
    rows = []
    for evt in prof.key_averages():
        if cuda:
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = evt.self_device_time_total
        else:
            us = evt.self_cpu_time_total
        if us > 0:
            rows.append((evt.key, us / steps, evt.count / steps))
    rows.sort(key=lambda r: -r[1])
    per_category = {}
    for name, us, _ in rows:
        per_category[category(name)] = per_category.get(category(name), 0.0) + us
    return {"per_category": dict(sorted(per_category.items(), key=lambda kv: -kv[1])), "top": rows,
            "total_us": sum(us for _, us, _ in rows), "clock": "device" if cuda else "cpu"}


def format_profile(result: dict, title: str, top: int = 15) -> str:
    total = result["total_us"] or 1.0
    out = [f"## {title}", "", f"{result['clock']} time per step: {total / 1e3:.2f} ms (kernels' own time, summed)",
           "", "| kind | ms/step | share |", "|---|---:|---:|"]
    out += [f"| {k} | {us / 1e3:.2f} | {us / total:.1%} |" for k, us in result["per_category"].items()]
    out += ["", f"Top {top}:", "", "| kernel / op | kind | ms/step | calls/step | share |", "|---|---|---:|---:|---:|"]
    for name, us, calls in result["top"][:top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        out.append(f"| `{short.replace('|', '/')}` | {category(name)} | {us / 1e3:.3f} | {calls:.0f} "
                   f"| {us / total:.1%} |")
    return "\n".join(out) + "\n"
