"""A training step of a diffusers-transformer model (FLUX.2 [klein], Z-Image, Qwen-Image, HunyuanVideo-1.5) under
opendit's layers of the step: the family's model (diffusers' class, random weights), LoRA adapters or a full
fine-tune, activation checkpointing per block, bf16 autocast, AdamW; the loss is the family's own (its glue's
forward arguments and velocity) on synthetic latents and prompt embeddings of the release's shapes (no weights or
text encoder are read).

    python benchmarks/wrapped_step.py --device cuda --model flux2-klein-4b --image_size 1024 --lora_rank 16
    python benchmarks/wrapped_step.py --device cuda --model z-image --image_size 1024
    python benchmarks/wrapped_step.py --device cuda --model ltx2-19b --image_size 512 --num_frames 25 --lora_rank 16
    python benchmarks/wrapped_step.py --device cuda --model qwen-image-edit-2511 --image_size 1024 --lora_rank 16 \
        --references 1                          # an editing step: the reference's tokens join the target's
    python benchmarks/wrapped_step.py --model flux2-klein-debug --image_size 16 --steps 2      # CPU smoke run

Prints (and writes to --out as a markdown row): seconds per step (median after the first), peak device memory,
parameters and trainable parameters.
"""
import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opendit import config as cfglib  # noqa: E402
from opendit.booster.parallelize import apply_activation_checkpointing  # noqa: E402
from opendit.diffusion.flow import RectifiedFlow  # noqa: E402
from opendit.families import family_of  # noqa: E402
from opendit.lora.run import adapt_model  # noqa: E402


def reference_shape(family, cfg, device) -> tuple[int, ...]:
    """The model-space shape of one reference image of an editing model at the run's size: at that size, or at the
    size its pipeline resizes references to (glue.reference_pixels: Qwen-Image-Edit's 1024 x 1024 area)."""
    from PIL import Image
    side = cfg.image_size
    if family.glue.reference_pixels is not None:
        side = family.glue.reference_pixels([Image.new("RGB", (side, side))]).shape[-1]
    return tuple(family.memory_probe(dataclasses.replace(cfg, image_size=side), device).latent_shape)


def step_figures(a) -> dict:
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    family = family_of(a.model)
    pairs = bool(getattr(a, "references", 0))  # an editing step: its data are pairs
    files = next(name for name, spec in family.datasets.items() if not spec.built_in and spec.pairs == pairs)
    frames = {"num_frames": a.num_frames} if getattr(a, "num_frames", None) else {}  # a video model's clip length
    cfg = family.resolve_config(cfglib.TrainConfig(model=a.model, image_size=a.image_size, lora_rank=a.lora_rank,
                                                   dataset=files, vae="auto", **frames))
    shape = family.memory_probe(cfg, device).latent_shape
    torch.manual_seed(0)
    with torch.device(device):
        model = family.build_model(cfg, shape)
    if a.lora_rank:
        model.to(torch.bfloat16 if cuda else torch.float32)
        adapt_model(model, family, cfg, torch.bfloat16 if cuda else torch.float32)
    apply_activation_checkpointing(model, 1 if a.grad_checkpoint else 0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    glue, flow = family.glue, RectifiedFlow()
    x = torch.randn(a.batch_size, *shape, device=device)
    cond = glue.random_conditions(family.models[a.model], a.batch_size, device)
    if getattr(a, "references", 0):
        cond["references"] = torch.randn(a.batch_size, a.references, *reference_shape(family, cfg, device),
                                         device=device)
    times = []
    for _ in range(a.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        t, noise = torch.rand(a.batch_size, device=device), torch.randn_like(x)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            x_t = flow.noisy(x, t, noise)
            out = model(**glue.forward_kwargs(model, x_t, t, cond, cfg))
            velocity = glue.from_output(out[0] if isinstance(out, tuple) else out, x.shape)
        loss = flow.mse(velocity, flow.target(x, noise))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return dict(model=a.model, image_size=a.image_size, lora_rank=a.lora_rank, batch=a.batch_size,
                references=getattr(a, "references", 0),
                params=sum(p.numel() for p in model.parameters()), trainable=sum(p.numel() for p in trainable),
                step_s=statistics.median(times[1:] or times), loss=float(loss.detach()),
                peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux2-klein-debug")
    p.add_argument("--image_size", type=int, default=16)
    p.add_argument("--num_frames", type=int, default=None, help="a video model's frames (default: the run's)")
    p.add_argument("--lora_rank", type=int, default=0)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--references", type=int, default=0, help="an editing model's reference images per sample")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--grad_checkpoint", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="append the markdown row to this file")
    a = p.parse_args()
    f = step_figures(a)
    model = f"{f['model']} + {f['references']} ref." if f["references"] else f["model"]
    row = (f"| {model} | {f['image_size']} | {'LoRA ' + str(f['lora_rank']) if f['lora_rank'] else 'full'} | "
           f"{f['params'] / 1e9:.2f}B | {f['trainable'] / 1e6:.1f}M | {f['step_s']:.3f} | {f['peak_gib']:.1f} |")
    print("| model | px | trains | params | trainable | s / step | peak GiB |\n|---|---:|---|---:|---:|---:|---:|\n"
          + row)
    if f["loss"] != f["loss"]:
        raise SystemExit("the loss is NaN")
    if a.out:
        with open(a.out, "a") as out:
            out.write(row + "\n")


if __name__ == "__main__":
    main()
