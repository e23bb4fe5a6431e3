"""LoRA files from the command line.

    python -m opendit.lora merge --ckpt BASE --lora FILE[:STRENGTH] ... --out merged.safetensors
    python -m opendit.lora merge --ckpt outputs/001-flux-debug/checkpoints/step-001000 --out merged.safetensors
    python -m opendit.lora convert --ckpt BASE --lora FILE --layout kohya --out file_kohya.safetensors

merge: the base weights (any checkpoint sample.py takes; a LoRA run's checkpoint brings its base and its own
adapters) with the adapters folded in, written in the official layout with the run's settings beside it
(merged.json), so sample.py and --init_weights read it like an EMA export. convert: one LoRA file into the other
layout (--ckpt names the model it is for).
"""
import argparse
import logging
import sys
from pathlib import Path

import torch

from opendit.checkpoint import export_weights
from opendit.families import family_of
from opendit.lora.formats import LAYOUTS, load_adapters, module_map, read_file, save_adapters
from opendit.lora.lycoris import is_lycoris, load_lycoris
from opendit.lora.layer import Adapter
from opendit.lora.run import kohya_map, parse_lora_spec
from opendit.run_files import weights_and_adapters

logger = logging.getLogger("opendit")


def _base(ckpt: str, model: str | None, loras: list[str]):
    """(family, official base state, training settings, [(file, strength)]) of --ckpt and --lora."""
    weights, trained, state, adapters = weights_and_adapters(Path(ckpt), model)
    adapters += [parse_lora_spec(s) for s in loras]
    name = model or trained.get("model")
    if name is None:
        raise ValueError(f"cannot tell the model of {ckpt}; pass --model")
    family = family_of(name)
    if state is None:
        state = family.load_weights(weights)
    return family, state, {**trained, "model": name, "lora_rank": 0, "init_weights": weights}, adapters


def _mapping(family, state: dict):
    """(diffusers map, the Linears, kohya map) of the base weights (opendit.lora.formats)."""
    linears = [k[:-len(".weight")] for k, v in state.items() if k.endswith(".weight") and v.ndim == 2]
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    converter = family.weights and family.weights.lora_converter()
    return module_map(converter, shapes, linears), linears, kohya_map(family, shapes)


def add_update(w: torch.Tensor, delta: torch.Tensor, strength: float) -> None:
    """w = (w.float() + delta * strength).to(w.dtype), in w itself a block of rows at a time: no full-size fp32
    copy of w (the same rounding: each element's arithmetic is unchanged)."""
    rows = max(1, (1 << 20) // max(1, w[0].numel()))  # 4 MB of fp32 per block
    for i in range(0, w.shape[0], rows):
        w[i:i + rows] = (w[i:i + rows].float() + delta[i:i + rows] * strength).to(w.dtype)


def merge(args) -> None:
    family, state, settings, adapters = _base(args.ckpt, args.model, args.lora)
    if not adapters:
        raise ValueError("nothing to merge: pass --lora FILE (or a LoRA run's checkpoint as --ckpt)")
    mapping, linears, kohya = _mapping(family, state)
    for path, strength in adapters:
        # one full fp32 update at a time (together they outweigh the base): a LoKr / LoHa file's, else a LoRA's
        deltas = load_lycoris(path, linears, kohya)
        pairs = deltas.items() if deltas is not None else \
            ((name, a.delta()) for name, a in load_adapters(path, mapping, linears, kohya).items())
        for name, delta in pairs:
            key = f"{name}.weight"
            if delta.shape != state[key].shape:
                raise ValueError(f"{path}: {name} makes {list(delta.shape)}, the base has {list(state[key].shape)}")
            add_update(state[key], delta, strength)
            del delta  # freed before the next update is made
        logger.info("merged %s at strength %g", path, strength)
    export_weights(args.out, state, metadata={"config": settings})  # written tensor by tensor
    print(f"wrote {args.out} ({len(state)} tensors, official layout)")


def convert(args) -> None:
    family, state, _, _ = _base(args.ckpt, args.model, [])
    mapping, linears, kohya = _mapping(family, state)
    path, _ = parse_lora_spec(args.lora[0])
    if is_lycoris(read_file(path)[0]):
        raise ValueError(f"{path} is a LoKr / LoHa file, which has no low-rank layout to convert to; merge it into "
                         f"the base weights instead: python -m opendit.lora merge --ckpt BASE --lora {path} ...")
    adapters: dict[str, Adapter] = load_adapters(path, mapping, linears, kohya)
    save_adapters(args.out, adapters, args.layout, mapping, kohya_map=kohya)
    print(f"wrote {args.out} ({len(adapters)} adapted layers, {args.layout} layout)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opendit.lora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("merge", "fold adapters into the base weights"),
                            ("convert", "write a LoRA file in the other layout")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--ckpt", required=True, help="the base weights (or a LoRA run's checkpoint)")
        p.add_argument("--lora", nargs="*", default=[], help="LoRA files, FILE or FILE:STRENGTH")
        p.add_argument("--model", default=None, help="model name when the checkpoint does not say")
        p.add_argument("--out", required=True, help="the file to write (.safetensors)")
        if name == "convert":
            p.add_argument("--layout", choices=LAYOUTS, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        with torch.no_grad():
            (merge if args.command == "merge" else convert)(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
