"""Optimizer-state formats: relative L1 error on real Adam states, and bytes per parameter per configuration.

    python benchmarks/optim_states.py                 # both tables (errors: ~300 CPU steps of a small DiT)
    python benchmarks/optim_states.py --table bytes   # bytes/param only (DiT-XL/2 and FLUX.1-dev, no memory)

Error table: a small DiT trains a few hundred steps of noise prediction on synthetic latents with
torch.optim.AdamW (fp32 states); every state tensor of more than 4096 elements is then encoded and decoded
in each format, and sum|x - decode(encode(x))| / sum|x| is reported separately for exp_avg and exp_avg_sq.

Bytes table: the optimizer allocates its states for the real parameter shapes of DiT-XL/2 (the model
itself) and FLUX.1-dev (opendit's FLUX model, whose shapes are the official release's) on the meta device, so
the sizes are those of the tensors it creates, with no memory used; placement decides which column (device or
host) they count in.
"""
import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from opendit.optim.formats import Bf16Format, F24Format, U16Format  # noqa: E402
from opendit.plan.account import optimizer_bytes  # noqa: E402


# ---- error table -------------------------------------------------------------------------------
def train_small_dit(steps, seed=0):
    """Adam states after `steps` of eps-prediction on a DiT (depth 4, width 256) over 16x16x4 latents."""
    from opendit.families.dit.model import DiT
    torch.manual_seed(seed)
    model = DiT(input_size=16, patch_size=2, in_channels=4, hidden_size=256, depth=4, num_heads=4, num_classes=10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    # synthetic latents: a smooth per-class pattern plus noise, so gradients have real structure
    protos = torch.nn.functional.interpolate(torch.randn(10, 4, 4, 4), size=16, mode="bilinear")
    alphas = torch.cumprod(1 - torch.linspace(1e-4, 2e-2, 1000), 0)
    start = time.time()
    for step in range(steps):
        y = torch.randint(0, 10, (8,))
        x0 = protos[y] + 0.3 * torch.randn(8, 4, 16, 16)
        t = torch.randint(0, 1000, (8,))
        noise = torch.randn_like(x0)
        a = alphas[t].view(-1, 1, 1, 1)
        out = model(a.sqrt() * x0 + (1 - a).sqrt() * noise, t, y)
        loss = (out[:, :4] - noise).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 50 == 0 or step + 1 == steps:
            rate = (step + 1) / (time.time() - start)
            print(f"  step {step + 1}/{steps}  loss {loss.item():.4f}  {rate:.1f} it/s  "
                  f"ETA {(steps - step - 1) / rate:.0f}s", file=sys.stderr)
    return [(opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for p in model.parameters()
            if p in opt.state and p.numel() > 4096 and p.dim() >= 2]


def rel_l1(fmt, tensors, per_tensor=False):
    err = total = 0.0
    for x in tensors:
        if per_tensor:  # one min/max for the whole tensor: a single row holding a single block
            x = x.reshape(1, -1)
            fmt = U16Format(x.numel(), fmt.power)
        parts = fmt.empty(x.shape, "cpu")
        fmt.encode(x, parts)
        err += (fmt.decode(parts).double() - x.double()).abs().sum().item()
        total += x.double().abs().sum().item()
    return err / total


def error_table(steps, cache=None):
    if cache and os.path.exists(cache):
        states = torch.load(cache)
    else:
        states = train_small_dit(steps)
        if cache:
            torch.save(states, cache)
    m = [a for a, _ in states]
    v = [b for _, b in states]
    rows = [("bf16", "2", Bf16Format(), False), ("f24", "3", F24Format(), False)]
    for power in (1.0, 2.0, 3.0, 4.0):
        rows.append((f"u16 per tensor, p={power:g}", "2", U16Format(1, power), True))
    for block in (64, 256, 1024):
        for power in (2.0, 3.0, 4.0):
            rows.append((f"u16 block {block}, p={power:g}", f"{2 + 8 / block:.3f}", U16Format(block, power), False))
    print(f"\nRelative L1 error vs fp32 after {steps} AdamW steps of a small DiT "
          f"({sum(x.numel() for x in m) / 1e6:.1f}M state elements per moment, tensors > 4096 elements)\n")
    print("| format | bytes/elem | exp_avg | exp_avg_sq |")
    print("|---|---|---|---|")
    for name, nbytes, fmt, per_tensor in rows:
        print(f"| {name} | {nbytes} | {rel_l1(fmt, m, per_tensor):.2e} | {rel_l1(fmt, v, per_tensor):.2e} |")


# ---- bytes table -------------------------------------------------------------------------------
def dit_xl2_params():
    from opendit.families import build_model
    with torch.device("meta"):
        model = build_model("DiT-XL/2")
    return [p.shape for p in model.parameters() if p.requires_grad]


def flux_dev_params():
    from opendit.families.flux.model import FLUX_CONFIGS, Flux
    with torch.device("meta"):
        model = Flux(**FLUX_CONFIGS["flux-dev"])  # the official release's keys and shapes
    return [p.shape for p in model.parameters()]


def bytes_table(label, shapes):
    n = sum(math.prod(s) for s in shapes)
    print(f"\n{label}: {n / 1e9:.3f}B trainable parameters. Bytes per parameter (persistent; activations "
          "and one in-flight gradient not counted)\n")
    print("| optimizer | weights | master | states | states on GPU: GPU | states on CPU + fused backward: "
          "GPU / CPU |")
    print("|---|---|---|---|---|---|")
    print("| plain mixed precision AdamW (bf16 weights+grads, fp32 master, m, v) | bf16 | fp32 | fp32 | 16.00 | "
          "- |")
    print("| public recipe (f24 states + low-16-bit master on CPU, fused backward) | bf16 | bf16_exact | f24 | - | "
          "2.00 / 8.00 |")
    for name in ("adamw", "adan"):
        for master, dtype in (("fp32", torch.float32), ("fp32_copy", torch.bfloat16), ("bf16_exact", torch.bfloat16),
                              ("bf16_stochastic", torch.bfloat16)):
            wbytes = torch.finfo(dtype).bits // 8
            for fmt in ("fp32", "bf16", "u16", "f24"):
                states, masters = optimizer_bytes(shapes, name, fmt, master)  # weights: `dtype` (the master's rule)
                s = (states + masters) / n
                on_gpu = wbytes * 2 + s  # weights + gradients + every state beside them
                print(f"| {name} | {str(dtype)[6:]} | {master} | {fmt} | {on_gpu:.2f} | {wbytes:.2f} / {s:.2f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", choices=("errors", "bytes", "both"), default="both")
    ap.add_argument("--steps", type=int, default=300, help="AdamW steps before the states are measured")
    ap.add_argument("--cache", default=None, help="save the trained states here / reuse them if the file exists")
    a = ap.parse_args()
    if a.table in ("bytes", "both"):
        bytes_table("DiT-XL/2 (256px)", dit_xl2_params())
        bytes_table("FLUX.1-dev", flux_dev_params())
    if a.table in ("errors", "both"):
        error_table(a.steps, a.cache)


if __name__ == "__main__":
    main()
