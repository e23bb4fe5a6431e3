"""Host memory of reading, merging, exporting and saving weights: each path's peak RSS growth over the bytes it
handles.

    python benchmarks/host_memory.py --out host_memory.md        # a 2.1 GB bf16 base; about 2 min on 2 cores

The base is FLUX.1 [dev] at its full widths (hidden 3072, T5 4096) cut to 2 double and 2 single blocks: 1.04B
parameters, written as zeros in bf16 by the benchmarks' own bench_common.write_zero_base. Every path runs in its own
fresh process, through the entry point the command line uses: --init_weights and sample.py read a file with the
family's load_weights and fill a meta-device model with load_into_meta_model; the sharded official layout goes
through opendit.checkpoint.folders.read_safetensors (what Wan's and the diffusers-backed kinds' loaders call);
`python -m opendit.lora merge` merges; the Trainer exports with export_ema and saves with save_checkpoint.

growth: the process's peak RSS during the path (VmHWM, reset through /proc/self/clear_refs just before it starts,
so what its set-up held earlier does not count) minus its RSS just before. bytes handled: the weights the path
reads or writes, the larger side (a bf16 file read into an fp32 model handles the fp32 bytes). A load ends by
reading every page of the model's weights, as its first step will (a mapped file counts once read). A path that
keeps the weights in memory grows by 1.0x, one that writes them tensor by tensor by about its largest tensor; a
second copy of the weights shows as 2x.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

MODEL = "flux-dev"
ARCH = dict(depth=2, depth_single_blocks=2)  # tests/test_host_memory.py narrows it (--arch)
SHARD_BYTES = 600 * 2 ** 20  # shards of the sharded and diffusers folders, as save_pretrained splits them
GB = 1e9


# ---- measuring ---------------------------------------------------------------------------------------------------
def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def peak_growth(run) -> int:
    """Bytes the process's resident set grew by at its peak while `run()` ran (VmHWM after minus VmRSS before);
    where /proc/self/clear_refs cannot reset the peak, the process's lifetime peak stands in for it."""
    import gc

    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak RSS (VmHWM) starts again from the current RSS
    except OSError:
        pass
    before = _status_bytes("VmRSS")
    run()
    return _status_bytes("VmHWM") - before


# ---- the synthetic files -----------------------------------------------------------------------------------------
def _meta_model(arch: dict | None = None):
    import torch

    from opendit.families import family_of

    with torch.device("meta"):
        return family_of(MODEL).models[MODEL].build(**(arch or ARCH))


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _write_sharded(folder: Path, layout: dict, prefix: str) -> None:
    """Zeros of `layout` ({key: shape}, bf16) as shards of about SHARD_BYTES plus their index, one shard in memory
    at a time."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shards, size = [[]], 0
    for key, shape in layout.items():
        n = 2 * int(torch.Size(shape).numel())
        if size and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    weight_map = {}
    for i, keys in enumerate(shards):
        name = f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: torch.zeros(layout[k], dtype=torch.bfloat16) for k in keys}, str(folder / name))
        weight_map.update(dict.fromkeys(keys, name))
    total = sum(2 * int(torch.Size(s).numel()) for s in layout.values())
    (folder / f"{prefix}.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                         "weight_map": weight_map}, indent=1))


def write_folders(work: Path) -> None:
    """The base as a sharded official folder and as a diffusers pipeline folder (transformer/ with an index)."""
    import torch

    from opendit.families.flux.weights import FLUX_WEIGHTS

    official = {k: tuple(v.shape) for k, v in _meta_model().state_dict().items()}
    _write_sharded(work / "sharded", official, "model")
    meta = {k: torch.empty(s, dtype=torch.bfloat16, device="meta") for k, s in official.items()}
    diffusers = {k: tuple(v.shape) for k, v in FLUX_WEIGHTS.to_diffusers(meta).items()}
    pipeline = work / "diffusers"
    _write_sharded(pipeline / "transformer", diffusers, "diffusion_pytorch_model")
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    heads = ARCH.get("num_heads", 24)
    (pipeline / "transformer" / "config.json").write_text(json.dumps(dict(
        _class_name="FluxTransformer2DModel", num_attention_heads=heads,
        attention_head_dim=ARCH.get("hidden_size", 3072) // heads,
        num_layers=ARCH["depth"], num_single_layers=ARCH["depth_single_blocks"], in_channels=64, patch_size=1,
        pooled_projection_dim=768, joint_attention_dim=4096, guidance_embeds=True, axes_dims_rope=[16, 56, 56])))


def write_adapters(work: Path, arch: dict | None = None) -> None:
    """lora.safetensors (rank 16 on every Linear, kohya layout) and lokr.safetensors (4x4 (x) a rank-16 w2 on every
    Linear) for the base of `arch` (default ARCH)."""
    import torch
    from safetensors.torch import save_file

    linears = {k[:-len(".weight")]: tuple(v.shape) for k, v in _meta_model(arch).state_dict().items()
               if k.endswith(".weight") and v.ndim == 2}
    g = torch.Generator().manual_seed(0)
    lora, lokr = {}, {}
    for name, (out, inp) in linears.items():
        flat = name.replace(".", "_")
        lora[f"lora_unet_{flat}.lora_down.weight"] = torch.randn(16, inp, generator=g, dtype=torch.bfloat16)
        lora[f"lora_unet_{flat}.lora_up.weight"] = torch.randn(out, 16, generator=g, dtype=torch.bfloat16) * 1e-3
        lora[f"lora_unet_{flat}.alpha"] = torch.tensor(16.0)
        lokr[f"lycoris_{flat}.lokr_w1"] = torch.randn(4, 4, generator=g, dtype=torch.bfloat16)
        lokr[f"lycoris_{flat}.lokr_w2_a"] = torch.randn(out // 4, 16, generator=g, dtype=torch.bfloat16) * 1e-3
        lokr[f"lycoris_{flat}.lokr_w2_b"] = torch.randn(16, inp // 4, generator=g, dtype=torch.bfloat16)
        lokr[f"lycoris_{flat}.alpha"] = torch.tensor(16.0)
    save_file(lora, str(work / "lora.safetensors"))
    save_file(lokr, str(work / "lokr.safetensors"))


# ---- the paths, each in its own process ----------------------------------------------------------------------
def _touch(model) -> None:
    """Read a value of every memory page of the model's weights, as its first step will: a mapped file's pages
    count only once they are read."""
    for t in model.state_dict().values():
        t.reshape(-1)[::512].sum()


def _load(source: str, keep_dtype: bool = True, read=None):
    """A meta-device model filled as --init_weights fills it, its weights read -> (model, the path's growth)."""
    from opendit.checkpoint import load_into_meta_model
    from opendit.families import family_of

    model = _meta_model()
    read = read or family_of(MODEL).load_weights

    def load():
        load_into_meta_model(model, read(source), source, keep_dtype=keep_dtype)
        _touch(model)
    return model, peak_growth(load)


def _model_and_ema(work: Path):
    import torch

    from opendit.ema import ShardedEMA

    model, _ = _load(str(work / "base.safetensors"))
    return model, ShardedEMA(model, dtype=torch.bfloat16)  # bf16: the EMA's bytes equal the base's here


def _merge(work: Path, lora: str) -> tuple[int, int]:
    from opendit.lora.__main__ import main

    base = work / "base.safetensors"
    argv = ["merge", "--ckpt", str(base), "--model", MODEL, "--lora", str(work / lora), "--out",
            str(work / "merged.safetensors")]
    codes = []
    growth = peak_growth(lambda: codes.append(main(argv)))
    if codes != [0]:
        raise RuntimeError(f"python -m opendit.lora {' '.join(argv)} failed")
    return base.stat().st_size, growth


def child(name: str, work: Path) -> tuple[int, int]:
    """Run path `name` -> (bytes handled, peak RSS growth)."""
    import torch

    base = work / "base.safetensors"
    if name == "write":
        from benchmarks.bench_common import write_zero_base

        _meta_model()  # its imports, before the measurement as in every other path
        growth = peak_growth(lambda: write_zero_base(base, MODEL, **ARCH))
        return base.stat().st_size, growth
    if name == "fingerprint":
        from opendit.lora.run import weights_fingerprint

        return base.stat().st_size, peak_growth(lambda: weights_fingerprint(str(base)))
    if name in ("single", "single_fp32", "diffusers", "dcp"):
        source = {"diffusers": work / "diffusers", "dcp": work / "checkpoints" / "step-000001"}.get(name, base)
        model, growth = _load(str(source), keep_dtype=name != "single_fp32")
        return _bytes(model.state_dict().values()), growth
    if name == "sharded":
        from opendit.checkpoint.folders import read_safetensors

        model, growth = _load(str(work / "sharded"), read=read_safetensors)
        return _bytes(model.state_dict().values()), growth
    if name == "lora_setup":
        from opendit.checkpoint import load_into_meta_model
        from opendit.families import family_of
        from opendit.lora.run import adapt_model, kept_as_stored

        family, model = family_of(MODEL), _meta_model()
        cfg = types.SimpleNamespace(lora_targets=None, lora_rank=16, lora_alpha=None, lora_dropout=0.0,
                                    init_lora=None, master_weights="fp32", base_dtype="auto", mixed_precision="bf16")
        keep = kept_as_stored(model, cfg)  # as Trainer._build_model under --master_weights fp32

        def setup():  # the Trainer's: the frozen Linears read as stored, the rest in fp32, then the adapters
            load_into_meta_model(model, family.load_weights(str(base)), str(base), keep_dtype=keep)
            adapt_model(model, family, cfg, torch.bfloat16)
            _touch(model)
        return base.stat().st_size, peak_growth(setup)
    if name == "save":
        from opendit.checkpoint import save_checkpoint

        model, ema = _model_and_ema(work)
        growth = peak_growth(lambda: save_checkpoint(str(work / "checkpoints"), 1, model, ema=ema))
        return _bytes(model.state_dict().values()) + ema.local_bytes(), growth
    if name == "export":
        from opendit.checkpoint import export_ema

        _, ema = _model_and_ema(work)
        return ema.local_bytes(), peak_growth(lambda: export_ema(ema, str(work / "ema.safetensors")))
    if name in ("merge_lora", "merge_lokr"):
        return _merge(work, "lora.safetensors" if name == "merge_lora" else "lokr.safetensors")
    raise ValueError(f"unknown path {name!r}")


# in run order: the save writes the step folder the DCP load reads
PATHS = {
    "write": "write the base (bench_common.write_zero_base)",
    "fingerprint": "fingerprint the base (LoRA runs: lora.run.weights_fingerprint)",
    "single": "load an official single file, bf16 (family.load_weights + load_into_meta_model)",
    "single_fp32": "load an official single file into fp32 (--master_weights fp32, the default)",
    "sharded": "load a sharded folder (model.safetensors.index.json; folders.read_safetensors)",
    "diffusers": "load a diffusers folder (transformer/ with an index; converted)",
    "save": "save a checkpoint (save_checkpoint: model + EMA)",
    "dcp": "load a DCP step folder (--init_weights step-XXXXXX: its EMA)",
    "export": "export the EMA (export_ema)",
    "lora_setup": "LoRA run set-up, as the Trainer does it (frozen Linears read as stored: lora.run.kept_as_stored)",
    "merge_lora": "merge a LoRA file (python -m opendit.lora merge)",
    "merge_lokr": "merge a LoKr file (python -m opendit.lora merge)",
}


def run_child(name: str, work: Path, arch: dict | None = None) -> dict:
    """One path in a fresh process (of the base cut to `arch`, default ARCH) -> {"bytes", "growth", "seconds"}."""
    t0 = time.time()
    out = subprocess.run([sys.executable, __file__, "--child", name, "--work", str(work), "--arch",
                          json.dumps(arch or ARCH)], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    if out.returncode:
        raise RuntimeError(f"path {name} failed:\n{out.stderr[-3000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "seconds": time.time() - t0}


def table(results: dict, bound: float) -> str:
    lines = ["| path | bytes handled GB | peak RSS growth GB | ratio | within 1.2x |", "|---|---:|---:|---:|:---:|"]
    for name, r in results.items():
        ratio = r["growth"] / r["bytes"]
        lines.append(f"| {PATHS[name]} | {r['bytes'] / GB:.2f} | {r['growth'] / GB:.2f} | {ratio:.2f} | "
                     f"{'yes' if ratio <= bound else 'no'} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/host_memory", help="where the synthetic files go (about 15 GB)")
    p.add_argument("--paths", nargs="*", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--arch", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    work = Path(a.work)
    if a.child:
        ARCH.clear()
        ARCH.update(json.loads(a.arch))
        if a.child == "prepare":  # the other layouts of the base, not measured
            write_folders(work)
            write_adapters(work)
            print(json.dumps({}))
            return
        handled, growth = child(a.child, work)
        print(json.dumps({"bytes": handled, "growth": growth}))
        return
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in a.paths:
        results[name] = run_child(name, work)
        if name == "write":
            run_child("prepare", work)
        print(f"{name}: {results[name]['growth'] / GB:.2f} GB growth of {results[name]['bytes'] / GB:.2f} GB "
              f"({results[name]['seconds']:.0f} s)", flush=True)
    import torch

    text = (f"# Host memory per path: {MODEL} cut to {ARCH['depth']} double + {ARCH['depth_single_blocks']} single "
            f"blocks, zeros in bf16; torch {torch.__version__}, {os.cpu_count()} CPUs\n\n{table(results, 1.2)}")
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
