"""Memory of one flux-dev 1024x1024 full fine-tune step, by part and by option set: GPU and host bytes of the
weights, gradients, master weights, optimizer states, activations, EMA and frozen encoders.

    python benchmarks/flux_memory.py                       # flux-dev, 1024 px, batch 1 (no memory used)
    python benchmarks/flux_memory.py --image_size 512 --out flux_memory.md

Every number is the memory planner's (opendit.plan.account for each option set, from real tensor shapes on the
meta device: no storage, so a 12B model fits a laptop; docs/memory_planner.md):
- weights, gradients, master and optimizer bytes: FLUX.1-dev built from its official config; states as
  opendit's optimizer allocates them (fp32 8 B, u16 2 x 2.03 B per parameter for AdamW's two moments).
- activations: what autograd saves for backward in a bf16 forward at the run's token counts (512 T5 + 4096
  image tokens at 1024 px), by block, not the weights, with attention as FlashAttention keeps it (no L x L
  scores); the reference RMSNorm and RoPE keep fp32 intermediates, which the fused kernels would not. Without
  checkpointing all of them live at the peak; with --grad_checkpoint 1 only each block's inputs plus the
  largest block's saved tensors (it is recomputed during its backward) and what the root keeps.
- lean rows: the states and master on the host, and on the GPU the offloaded optimizer's working set for a
  block's largest tensor (the "states" column); with the fused backward one block's gradients.
- block swap N: the last N blocks' weights live on the host and stream in one block ahead, so the GPU holds
  the others plus two of the swapped blocks in flight.
- EMA: fp32 beside the weights, in host memory (--ema_on_host), or none (--ema_decay 0).
- encoders: T5-XXL (4.76B) and CLIP-L text (0.12B) in bf16, and FLUX's autoencoder (84M) in fp32, when
  encoding on the fly; training on a preprocess.py cache loads none of them.
- LoRA (rank 16 by default, --lora_rank): the frozen base with its Linear weights in bf16 (or, --base_dtype fp8,
  those of its blocks in float8_e4m3fn, 1 byte each), fp32 adapters with their gradients, AdamW states and EMA;
  activations measured on the whole adapted model (a frozen Linear keeps no input for a weight gradient, the
  adapters keep their rank-r intermediates).
Not in the columns: the planner's backward workspace and autocast weight copies (the note under the table gives
them), kernel workspaces and the allocator's fragmentation: the GPU runs in benchmarks/gpu_check.sh measure
real peaks (flux_lean_step.py under torch.cuda.set_per_process_memory_fraction, plan_check.py against the plan).
"""
import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opendit import config as cfglib  # noqa: E402
from opendit.families import family_of  # noqa: E402
from opendit.lora.run import adapt_model  # noqa: E402
from opendit.families.flux.model import FLUX_CONFIGS  # noqa: E402
from opendit.plan.account import Run, account  # noqa: E402
from opendit.plan.planner import Options  # noqa: E402
from opendit.plan.report import build_run  # noqa: E402

GB = 1e9
COLUMNS = {"weights": "weights", "grads": "gradients", "master": "master copy", "states": "optimizer states",
           "activations": "activations", "ema": "EMA"}  # table column: the planner's part
USUAL = Options(master_weights="fp32_copy", grad_checkpoint=1)
LEAN = Options(grad_checkpoint=1, optimizer_offload=True, optimizer_state_dtype="u16", master_weights="bf16_exact",
               fused_backward=True)


def flux_run(a, **cfg) -> Run:
    """The planner's Run of a flux training config: batch 1, bf16 compute, encoding captions on the fly."""
    family = family_of(a.model)
    base = cfglib.TrainConfig(model=a.model, dataset="captions", vae="usual", image_size=a.image_size,
                              t5_max_length=a.t5_tokens, batch_size=1, mixed_precision="bf16", **cfg)
    return build_run(family.fill_defaults(base), 1, torch.device("cuda"))


def without_ema(run: Run) -> Run:
    return Run(run.facts, run.encoders, dataclasses.replace(run.cfg, ema_decay=0.0), run.world)


def row(name: str, run: Run, o: Options) -> dict:
    """The planner's bytes of `o` in the table's columns, GPU and host."""
    parts = account(run, o)
    return dict(name=name, **{side: {c: parts[side][p] for c, p in COLUMNS.items()} for side in ("gpu", "host")},
                extra=parts["gpu"]["buffers / workspace"])


def option_sets(run: Run, budget: float) -> list[dict]:
    """Rows for each option set (see the module docstring); the last swaps the fewest blocks whose GPU columns fit
    `budget` bytes."""
    bare = without_ema(run)

    def swap(n):
        return row(f"lean, no EMA, --blocks_to_swap {n} (the fewest that fit {budget / 2**30:.0f} GiB)", bare,
                   dataclasses.replace(LEAN, blocks_to_swap=n))

    fits = next((n for n in range(len(run.facts.blocks) + 1) if sum(swap(n)["gpu"].values()) <= budget), None)
    rows = [row("plain mixed precision (fp32 weights + grads, AdamW fp32 states, autocast bf16, fp32 EMA)", run,
                Options()),
            row("bf16 weights + fp32 master copy, fp32 states, fp32 EMA, grad checkpointing (a usual full fine-tune)",
                run, USUAL),
            row("lean: bf16_exact master + u16 states on the host, fused backward, grad checkpointing, --ema_on_host",
                run, dataclasses.replace(LEAN, ema_on_host=True)),
            row("lean, --ema_decay 0 (no EMA, as sd-scripts)", bare, LEAN)]
    return rows + ([swap(fits)] if fits else [])


def lora_run(a) -> tuple[Run, Run, int]:
    """(the planner's Run of the LoRA config with a bf16 base, the same with --base_dtype fp8, adapted layers)."""
    run = flux_run(a, lora_rank=a.lora_rank)
    family, cfg = family_of(a.model), run.cfg
    with torch.device("meta"):
        model = family.memory_model(cfg, family.memory_probe(cfg, torch.device("meta")).latent_shape)
        adapted = adapt_model(model, family, cfg, torch.bfloat16)
    return run, flux_run(a, lora_rank=a.lora_rank, base_dtype="fp8"), len(adapted)


def lora_rows(run: Run, fp8: Run, rank: int) -> list[dict]:
    """Rows of a LoRA run: the frozen base in bf16, then with its adapted Linear weights in fp8 (--base_dtype)."""
    return [row(f"LoRA rank {rank}: bf16 base, fp32 adapters + AdamW + EMA, no checkpointing", run, Options()),
            row(f"LoRA rank {rank}: bf16 base, grad checkpointing", run, Options(grad_checkpoint=1)),
            row(f"LoRA rank {rank}: --base_dtype fp8 (block Linear weights in e4m3, a scale per row), grad "
                "checkpointing", fp8, Options(grad_checkpoint=1))]


def table(rows, label: str, encoders: dict) -> str:
    head = "| option set | " + " | ".join(f"GPU {c}" for c in COLUMNS) + " | GPU total | host total |"
    out = [f"### {label}", "", head, "|---|" + "---:|" * (len(COLUMNS) + 2)]
    for r in rows:
        gpu, host = sum(r["gpu"].values()), sum(r["host"].values())
        cells = [f"{r['gpu'][c] / GB:.1f}" for c in COLUMNS]
        out.append(f"| {r['name']} | " + " | ".join(cells) + f" | **{gpu / GB:.1f}** | {host / GB:.1f} |")
    extra = ", ".join(f"{r['extra'] / GB:.1f}" for r in rows)
    out += ["", f"Encoding on the fly adds the frozen encoders on the GPU (text encoders in bf16, the VAE in fp32): "
                f"{sum(encoders.values()) / GB:.1f} GB ({', '.join(f'{k} {v / GB:.2f}' for k, v in encoders.items())});"
                f" training on a preprocess.py cache loads none of them. The planner also counts backward temporaries "
                f"and autocast's weight copies, row by row: {extra} GB."]
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux-dev", choices=[m for m in FLUX_CONFIGS if m != "flux-debug"])
    p.add_argument("--image_size", type=int, default=1024)
    p.add_argument("--t5_tokens", type=int, default=512)
    p.add_argument("--budget_gib", type=float, default=16.0, help="GPU memory the last row must fit")
    p.add_argument("--lora_rank", type=int, default=16, help="the LoRA rows' rank (the family's default targets)")
    p.add_argument("--out", default=None, help="also write the table to this Markdown file")
    a = p.parse_args()
    run = flux_run(a)
    f = run.facts
    img_tokens = (a.image_size // 16) ** 2  # 8x autoencoder, then 2x2 patches
    label = (f"{a.model}: {f.params / 1e9:.2f}B parameters, {a.image_size}x{a.image_size} ({img_tokens} image + "
             f"{a.t5_tokens} text tokens), batch 1, GB = 1e9 bytes")
    text = table(option_sets(run, a.budget_gib * 2 ** 30), label, run.encoders)
    kept, inputs = sum(b.kept for b in f.acts), sum(b.inputs for b in f.acts)
    text += (f"\n\nActivations (bf16, the planner's meta-device measurement): all saved tensors "
             f"{(f.root_acts + kept) / GB:.1f} GB; with checkpointing every block: block inputs {inputs / GB:.2f} GB "
             f"+ the largest block {max(b.kept for b in f.acts) / GB:.2f} GB + root {f.root_acts / GB:.2f} GB.")
    lora, fp8, layers = lora_run(a)
    label = (f"{a.model} LoRA rank {a.lora_rank} on {layers} layers ({lora.facts.trainable / 1e6:.1f}M adapter "
             f"parameters), {a.image_size}x{a.image_size}, batch 1, GB = 1e9 bytes")
    text += "\n\n" + table(lora_rows(lora, fp8, a.lora_rank), label, run.encoders)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
