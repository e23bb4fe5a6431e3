"""Per-rank bytes of parameters, gradients, optimizer states and EMA under each plugin, at several world sizes.

    python benchmarks/memory.py                                  # DiT-XL/2 at 256px, world sizes 1 2 4 8
    python benchmarks/memory.py --model DiT-B/2 --world_sizes 1 2 --materialize

Each world size is a spawned gloo group on the CPU. Every rank builds the model on the meta device, boosts
it with the plugin's real transforms (fully_shard on the real mesh), gives every trainable parameter a zero
gradient shaped like it, takes one AdamW step (which creates the real optimizer states) and builds the
opendit.ema.ShardedEMA; the bytes are numel x itemsize of this rank's local tensors (DTensor shards).
Meta tensors have real shapes and dtypes but no storage, so 8 ranks x DiT-XL/2 fit in a laptop's RAM;
--materialize allocates the sharded plugins' tensors (to_empty on the CPU) to show the numbers are the same.

ddp is measured on the plain (unwrapped) model: its parameters, gradients (DDP's buckets, with
gradient_as_bucket_view) and optimizer states are full replicas, the same at every world size; only its EMA
is partitioned. `gathered` is the most parameter memory FSDP unshards at once during forward/backward, in the
compute dtype: zero2 keeps every parameter gathered for the step; zero3/hsdp/gemini gather the root's own
parameters plus two blocks (the running one and the prefetched next). gemini keeps params, grads, optimizer
states and EMA on the CPU, so its accelerator memory is the `gathered` column alone.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from opendit.booster import Booster, build_plugin  # noqa: E402
from opendit.distributed import local_tensor, spawn_gloo  # noqa: E402
from opendit.booster import parallelize as par  # noqa: E402
from opendit.booster.precision import PRECISIONS, compute_dtype  # noqa: E402
from opendit.ema import ShardedEMA  # noqa: E402
from opendit.families import build_model  # noqa: E402
from opendit.plan.account import gathered_bytes  # noqa: E402

GiB = 2 ** 30
COLUMNS = ("params", "grads", "optim", "ema")


def local_bytes(tensors) -> int:
    return sum(local_tensor(t).numel() * t.element_size() for t in tensors)


def measure(plugin: str, model_name: str, model_kwargs: dict, precision: str, materialize: bool) -> dict:
    """This rank's bytes under `plugin` (model built on meta; see the module docstring)."""
    world = dist.get_world_size()
    booster = Booster(build_plugin(plugin, mixed_precision=precision, dp_replicate=2 if plugin == "hsdp" else 1,
                                   device="cpu"))
    with torch.device("meta"):
        model = build_model(model_name, **model_kwargs)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    if plugin != "ddp":
        names = par.parameter_names(model)
        model = booster.plugin.parallelize(model, booster.mesh)
        if materialize:
            model.to_empty(device="cpu")
        par.rebind_optimizer(optimizer, names, model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates exp_avg / exp_avg_sq (sharded like the params) and the step counters
    out = {"params": local_bytes(model.parameters()), "grads": local_bytes(p.grad for p in trainable),
           "optim": local_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)),
           "gathered": gathered_bytes(plugin, sum(p.numel() for p in model.parameters()), block_numels(model),
                                      compute_dtype(precision).itemsize), "world": world}
    out["ema"] = ema_bytes(model, booster)
    return out


def block_numels(model: torch.nn.Module) -> list[int]:
    return [sum(p.numel() for p in b.parameters()) for b in par.iter_blocks(model)]


def ema_bytes(model, booster) -> int:
    return ShardedEMA(model, decay=0.9999, dp_group=booster.dp_mesh).local_bytes()


def _rank_main(rank, world, plugins, model_name, model_kwargs, precision, materialize) -> dict:
    rows = {}
    for plugin in plugins:
        if plugin == "hsdp" and world % 2:
            continue  # needs dp_replicate=2 to differ from zero3
        mine = measure(plugin, model_name, model_kwargs, precision, materialize)
        every = [None] * world
        dist.all_gather_object(every, mine)
        rows[plugin] = {k: max(r[k] for r in every) for k in mine}  # the heaviest rank
    return rows


def run_world(world: int, plugins, model_name, model_kwargs, precision, materialize) -> dict:
    return spawn_gloo(_rank_main, world, plugins, model_name, model_kwargs, precision, materialize)[0]


def format_table(results: dict, plugins) -> str:
    """Markdown: one row per (plugin, world size); GiB per rank, the heaviest rank."""
    lines = ["| plugin | ranks | params | grads | optimizer | EMA | total | gathered in step | held on |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for plugin in plugins:
        for world, rows in results.items():
            if plugin not in rows:
                continue
            r = rows[plugin]
            total = sum(r[c] for c in COLUMNS)
            cells = [f"{r[c] / GiB:.2f}" for c in COLUMNS] + [f"{total / GiB:.2f}", f"{r['gathered'] / GiB:.2f}"]
            where = "CPU (+ gathered on GPU)" if plugin == "gemini" else "GPU"
            lines.append(f"| {plugin} | {world} | " + " | ".join(cells) + f" | {where} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="DiT-XL/2")
    ap.add_argument("--image_size", type=int, default=256, help="pixels; the latent is image_size / 8")
    ap.add_argument("--num_classes", type=int, default=1000)
    ap.add_argument("--world_sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--plugins", nargs="+", default=["ddp", "zero2", "zero3", "hsdp", "gemini"])
    ap.add_argument("--mixed_precision", default="bf16", choices=PRECISIONS)
    ap.add_argument("--materialize", action="store_true", help="allocate the sharded tensors (needs RAM)")
    args = ap.parse_args()
    if args.image_size % 8:
        raise SystemExit(f"--image_size {args.image_size} must be a multiple of 8 (the VAE downsamples by 8)")
    model_kwargs = dict(input_size=args.image_size // 8, in_channels=4, num_classes=args.num_classes)
    results = {}
    for world in args.world_sizes:
        print(f"measuring {len(args.plugins)} plugins at {world} rank(s)...", flush=True)
        results[world] = run_world(world, args.plugins, args.model, model_kwargs, args.mixed_precision,
                                   args.materialize)
    print(f"\n{args.model} at {args.image_size}px, AdamW, fp32 master weights and EMA, "
          f"{args.mixed_precision} compute; GiB per rank (heaviest rank)\n")
    print(format_table(results, args.plugins))


if __name__ == "__main__":
    main()
