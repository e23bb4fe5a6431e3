"""LyCORIS LoKr and LoHa files (as LyCORIS, musubi-tuner and ai-toolkit write them), read as full weight updates
that are merged into the frozen base weights: a Kronecker or Hadamard product has no low-rank form to attach.

    LoKr  <module>.lokr_w1 | lokr_w1_a, lokr_w1_b   delta = kron(w1, w2) * scale
          <module>.lokr_w2 | lokr_w2_a, lokr_w2_b   scale = alpha / rank when a factor is decomposed (rank: its inner
                                                    size), else 1 (both factors full: LyCORIS drops alpha)
    LoHa  <module>.hada_w1_a, hada_w1_b,            delta = (w1_a @ w1_b) * (w2_a @ w2_b) * alpha / rank
          <module>.hada_w2_a, hada_w2_b             (rank: w1_b's rows)
          <module>.alpha (optional: alpha = rank)

Module names: `lycoris_` or `lora_unet_` + the module with `.` -> `_`, or `diffusion_model.` + the dotted module;
the model's own Linear names, or the family's kohya names (FLUX.2: BFL's fused qkv, whose update is split by rows
onto diffusers' to_q, to_k, to_v, which is exact for a full update). Every tensor of the file is used, or the file
is refused naming what is not; text encoders' modules are left out and counted in the log.
"""
import logging
from collections.abc import Mapping

import torch
import torch.nn as nn

from opendit.lora.formats import KOHYA_PREFIX, TEXT_ENCODER_PREFIXES, ModuleMap, read_file

logger = logging.getLogger("opendit")

FACTORS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b",
           "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
UNDERSCORED = ("lycoris_", KOHYA_PREFIX)
DOTTED = "diffusion_model."


def is_lycoris(keys) -> bool:
    return any(k.rpartition(".")[2] in FACTORS for k in keys)


def load_lycoris(path: str, linears: list[str], kohya_map: ModuleMap | None = None) -> "Deltas | None":
    """{the model's Linear: its weight update [out, in] (fp32)} of a LoKr / LoHa file, each update computed when it
    is asked for; None: not such a file. A file that cannot be applied in full is refused here, before any update."""
    state, _ = read_file(path)
    if not is_lycoris(state):
        return None
    encoders = [k for k in state if k.startswith(TEXT_ENCODER_PREFIXES)]
    if encoders:
        logger.info("%s: %d text-encoder tensors left out (opendit keeps its text encoders frozen)", path,
                    len(encoders))
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        base, _, part = key.rpartition(".")
        if not key.startswith(TEXT_ENCODER_PREFIXES):
            modules.setdefault(base, {})[part] = value.float()
    targets = {name: [(name, None)] for name in linears} | dict(kohya_map or {})
    found = {}
    for base, parts in modules.items():
        unknown = sorted(p for p in parts if p not in (*FACTORS, "alpha"))
        if unknown or not set(parts) - {"alpha"}:
            raise ValueError(f"{path}: {base} holds {', '.join(unknown) or 'only an alpha'}, which is no LoKr / LoHa "
                             f"factor; a file is applied in full or not at all")
        name = _module_name(base, targets)
        if name is None:
            raise ValueError(f"{path} adapts {base}, which is no Linear layer of this model (its layers are named like "
                             f"lycoris_{linears[0].replace('.', '_')}); is it for another model?")
        _check_factors(parts, f"{path}: {base}")
        for target, rows in targets[name]:
            found[target] = (base, rows)
    return Deltas(modules, found)


class Deltas(Mapping):
    """{the model's Linear: its weight update [out, in] (fp32)} of a LoKr / LoHa file, each computed when asked for:
    together the updates are full-size fp32 weights, twice a bf16 base. modules: {the file's module: its factors};
    found: {Linear: (its module, the rows of the module's update it takes, or None: all)}."""

    def __init__(self, modules: dict[str, dict[str, torch.Tensor]], found: dict[str, tuple]):
        self._modules, self._found = modules, found
        self._last: tuple[str, torch.Tensor] | None = None  # a fused module's update, for its next Linear

    def __getitem__(self, name: str) -> torch.Tensor:
        base, rows = self._found[name]
        if self._last is None or self._last[0] != base:
            self._last = None  # freed before the next update is made
            self._last = (base, _delta(self._modules[base]))
        delta = self._last[1]
        return delta if rows is None else delta[rows]

    def __iter__(self):
        return iter(self._found)

    def __len__(self) -> int:
        return len(self._found)


def _module_name(base: str, targets: dict) -> str | None:
    if base.startswith(DOTTED):
        name = base[len(DOTTED):]
        return name if name in targets else None
    for prefix in UNDERSCORED:
        if base.startswith(prefix):
            flat = base[len(prefix):]
            return next((n for n in targets if n.replace(".", "_") == flat), None)
    return None


def _pairs(parts: dict) -> list[tuple[str, str, str]]:
    """(the full factor, its two halves) of each side of the product: LoHa's halves only, LoKr's either."""
    if any(p.startswith("hada_") for p in parts):
        return [("-", "hada_w1_a", "hada_w1_b"), ("-", "hada_w2_a", "hada_w2_b")]
    return [("lokr_w1", "lokr_w1_a", "lokr_w1_b"), ("lokr_w2", "lokr_w2_a", "lokr_w2_b")]


def _check_factors(parts: dict, where: str) -> None:
    for full, a, b in _pairs(parts):
        if full not in parts and not (a in parts and b in parts):
            raise ValueError(f"{where} lacks {full} (or {a} and {b})")


def _delta(parts: dict) -> torch.Tensor:
    w1, w2 = (parts[full] if full in parts else parts[a] @ parts[b] for full, a, b in _pairs(parts))
    # in place where the product is ours: the fewest full-size fp32 tensors at once
    if any(p.startswith("hada_") for p in parts):
        rank = parts["hada_w1_b"].shape[0]
        return w1.mul_(w2).mul_(float(parts.get("alpha", rank)) / rank)  # w1 = w1_a @ w1_b, a new tensor
    inner = next((parts[k].shape[0] for k in ("lokr_w2_b", "lokr_w1_b") if k in parts), None)
    scale = float(parts.get("alpha", inner)) / inner if inner is not None else 1.0
    return torch.kron(w1, w2).mul_(scale)


def merge_deltas(model: nn.Module, deltas: dict[str, torch.Tensor], strength: float, source: str) -> int:
    """Add each update (times strength) to its Linear's weight in place; a shape that differs is a ValueError."""
    modules = dict(model.named_modules())
    for name, delta in deltas.items():
        weight = modules[name].weight
        if delta.shape != weight.shape:
            raise ValueError(f"{source}: {name} is {list(weight.shape)} here, the update makes {list(delta.shape)}; "
                             f"it is for another model size")
        with torch.no_grad():
            weight.add_((delta * strength).to(weight.dtype))
        del delta  # freed before the next update is made
    return len(deltas)
