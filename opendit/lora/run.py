"""What training and sampling runs need of LoRA: the adapted model of a run's flags, its exports, the base
weights' fingerprint, and adapters applied at sampling (sample.py --lora FILE[:STRENGTH])."""
import hashlib
import logging
import os
from pathlib import Path

import torch
import torch.nn as nn

from opendit.lora.formats import ModuleMap, load_adapters, module_map, save_adapters, stacked_map
from opendit.lora.lycoris import load_lycoris, merge_deltas
from opendit.booster.parallelize import iter_blocks
from opendit.booster import precision
from opendit.distributed import current_rank
from opendit.lora.layer import (add_lora, attach_adapters, cast_frozen_linears, linear_names, load_trained_adapters,
                                quantize_frozen_linears, trained_adapters)

logger = logging.getLogger("opendit")

EXPORTS = {"diffusers": "lora.safetensors", "kohya": "lora_kohya.safetensors"}  # beside each LoRA checkpoint
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".distcp")


def check_lora_flags(cfg) -> None:
    """The LoRA flags no run can use, before anything is built."""
    if not cfg.lora_rank:
        given = [f for f in ("lora_alpha", "lora_targets", "init_lora") if getattr(cfg, f) is not None]
        if cfg.base_dtype != "auto":
            raise ValueError(f"--base_dtype {cfg.base_dtype} stores frozen base weights, never trained ones: add "
                             "--lora_rank R (e.g. 16), or leave it out")
        if given or cfg.lora_dropout:
            raise ValueError(f"--{(given or ['lora_dropout'])[0]} applies to LoRA runs: add --lora_rank R (e.g. 16)")
        return
    if cfg.base_dtype == "fp8" and cfg.plugin != "ddp":
        raise ValueError(f"--base_dtype fp8 with --plugin {cfg.plugin}: the sharding plugins keep one dtype per "
                         "sharded group; use --plugin ddp (an fp8 base is for fitting one GPU)")
    if not cfg.init_weights:
        raise ValueError(f"--lora_rank {cfg.lora_rank} trains adapters on frozen base weights: pass them with "
                         "--init_weights (an official checkpoint, a diffusers folder, an EMA export)")


def _shapes(model: nn.Module) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if ".lora_" not in k}


def family_module_map(family, model: nn.Module) -> ModuleMap:
    """The family's official -> diffusers Linear map for `model` (meta tensors are fine)."""
    return module_map(family.weights and family.weights.lora_converter(), _shapes(model), linear_names(model))


def family_kohya_map(family, model: nn.Module) -> ModuleMap | None:
    """The module names of the family's kohya/ComfyUI files for `model`, where they are not its own (else None)."""
    return kohya_map(family, _shapes(model))


def kohya_map(family, shapes: dict[str, tuple]) -> ModuleMap | None:
    """family_kohya_map for a model of state-dict `shapes`."""
    stacks = family.kohya_lora_names(shapes.keys())
    return None if stacks is None else stacked_map(stacks, lambda name: shapes[f"{name}.weight"][0])


def adapt_model(model: nn.Module, family, cfg, compute_dtype: torch.dtype) -> list[str]:
    """Add the run's trainable adapters (frozen base) and start them from --init_lora; the frozen Linear
    weights are stored in the compute dtype (bf16 under --mixed_precision bf16). Returns the adapted names."""
    targets = cfg.lora_targets or family.lora_targets
    if not targets:
        raise ValueError(f"model family {family.name!r} names no default LoRA targets: pass --lora_targets REGEX "
                         f"(the Linear layers to adapt, e.g. 'blocks\\.\\d+\\.attn\\.qkv')")
    full_run = [p for p in model.parameters() if p.requires_grad]  # what a run without LoRA would train
    deltas = cfg.init_lora and load_lycoris(cfg.init_lora, linear_names(model), family_kohya_map(family, model))
    if deltas:  # a LoKr / LoHa file: into the frozen base, the run's adapters start from zero on top
        merge_deltas(model, deltas, 1.0, f"--init_lora {cfg.init_lora}")
        logger.info("--init_lora %s: a LoKr / LoHa file, merged into the frozen base weights of %d layers",
                    cfg.init_lora, len(deltas))
    names = add_lora(model, cfg.lora_rank, cfg.lora_alpha, targets, cfg.lora_dropout)
    if cfg.init_lora and not deltas:
        adapters = load_adapters(cfg.init_lora, family_module_map(family, model), linear_names(model),
                                 family_kohya_map(family, model))
        load_trained_adapters(model, adapters, f"--init_lora {cfg.init_lora}")
    cast = cast_frozen_linears(model, compute_dtype) if compute_dtype != torch.float32 else 0
    if cfg.master_weights != "fp32":  # bf16 weights run without autocast (the ddp plugin casts the inputs): the
        for p in full_run:  # rest of the base (patch embedding, embedding tables) is bf16 too, as in a full run
            if p.is_floating_point() and p.dtype != compute_dtype:
                p.data = p.data.to(compute_dtype)
                cast += 1
    stored = f"; frozen Linear weights stored in {compute_dtype}" if cast or compute_dtype != torch.float32 else ""
    if cfg.base_dtype == "fp8":  # the blocks' Linears: the bulk of the weights; embedders and final layer as they were
        stored = f"; the frozen weights of {quantize_frozen_linears(iter_blocks(model))} block Linear layers stored " \
                 "in fp8 (e4m3, a scale per row), upcast for each matmul"
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info("LoRA rank %d (alpha %s) on %d layers: %.2fM trainable parameters%s", cfg.lora_rank,
                cfg.lora_alpha or cfg.lora_rank, len(names), trained / 1e6, stored)
    return names


def kept_as_stored(model: nn.Module, cfg) -> set[str]:
    """The state-dict keys of `model` (built for the run, before adapt_model) that --init_weights may fill as the
    file stores them rather than in fp32: every Linear's weight and bias, which adapt_model stores in the bf16 or
    fp16 compute dtype anyway (a file's bf16 or fp16 -> fp32 -> the compute dtype rounds as the direct cast does),
    so a bf16 base is never held in fp32, twice its bytes. None when the Linears stay fp32, or with --init_lora
    (a LoKr / LoHa file is merged into them first, in the dtype they are read in)."""
    if not cfg.lora_rank or cfg.init_lora or precision.compute_dtype(cfg.mixed_precision) == torch.float32:
        return set()
    return {f"{name}.{p}" for name in linear_names(model) for p in ("weight", "bias")}


def export_lora(folder: str, model: nn.Module, ema, mapping: ModuleMap, metadata: dict,
                kohya_map: ModuleMap | None = None) -> list[str]:
    """Write the trained adapters (the EMA's when there is one) in both layouts into `folder` on rank 0; returns
    the file names there ([] elsewhere). A collective: sharded adapters are gathered on every rank."""
    ema_state = ema.full_state_dict(rank0_only=True) if ema is not None else None  # {} on the other ranks
    if current_rank() != 0:
        if ema_state is None:
            trained_adapters(model)  # joins the gathers
        return []
    adapters = trained_adapters(model, ema_state)
    for layout, name in EXPORTS.items():
        save_adapters(os.path.join(folder, name), adapters, layout, mapping, metadata, kohya_map)
    return list(EXPORTS.values())


def weights_fingerprint(path: str) -> str:
    """sha256 over the weight files of `path` (a file, or a folder's weight files in sorted order, with their
    relative names): what a LoRA checkpoint records of its base."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file() and
                                                 f.suffix in _WEIGHT_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"no weight files at {path}")
    digest = hashlib.sha256()
    for f in files:
        digest.update(str(f.relative_to(root) if f != root else f.name).encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def check_same_base(saved: dict | None, path: str, fingerprint: str, checkpoint: str) -> None:
    """Resuming a LoRA run on other base weights is a ValueError naming both."""
    if saved is None:
        raise ValueError(f"checkpoint {checkpoint} holds no LoRA base record (not a LoRA run's checkpoint?); resume "
                         f"it without --lora_rank")
    if saved["sha256"] != fingerprint:
        raise ValueError(f"checkpoint {checkpoint} trained its adapters on base weights {saved['path']} (sha256 "
                         f"{saved['sha256'][:12]}...), but --init_weights {path} is other weights (sha256 "
                         f"{fingerprint[:12]}...); pass the same base weights")


def parse_lora_spec(spec: str) -> tuple[str, float]:
    """'file.safetensors' or 'file.safetensors:0.8' -> (path, strength)."""
    path, sep, strength = spec.rpartition(":")
    if sep and path and not os.path.exists(spec):
        try:
            return path, float(strength)
        except ValueError:
            pass
    return spec, 1.0


def apply_lora_files(model: nn.Module, family, specs: list[tuple[str, float]]) -> None:
    """Attach each LoRA file to the (loaded) model at its strength, unmerged; a LoKr / LoHa file is merged."""
    if not specs:
        return
    mapping, linears, kohya = family_module_map(family, model), linear_names(model), family_kohya_map(family, model)
    for path, strength in specs:
        deltas = load_lycoris(path, linears, kohya)
        if deltas is not None:
            n = merge_deltas(model, deltas, strength, source=path)
            logger.info("LoKr / LoHa %s at strength %g merged into the weights of %d layers", path, strength, n)
            continue
        n = attach_adapters(model, load_adapters(path, mapping, linears, kohya), strength, source=path)
        logger.info("LoRA %s at strength %g on %d layers", path, strength, n)
