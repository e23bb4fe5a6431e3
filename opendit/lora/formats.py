"""LoRA files in the layouts other tools share, to and from an adapter set {official module name: Adapter}.

    layout     keys (one module)                                                      alpha
    diffusers  transformer.<diffusers module>.lora_A.weight [r, in], .lora_B.weight   metadata lora_adapter_metadata
               (diffusers' load_lora_weights / load_lora_adapter, PEFT)               (r, lora_alpha, *_pattern)
    kohya      lora_unet_<official module, . -> _>.lora_down.weight, .lora_up.weight  <module>.alpha (a scalar)
               (kohya sd-scripts, ComfyUI, musubi-tuner)

A model whose kohya/ComfyUI files name other modules than its own (FLUX.2 through diffusers' class: BFL's fused
`double_blocks.N.img_attn.qkv` for diffusers' to_q, to_k, to_v) gives a `kohya_map` of the same form as the diffusers
map below (stacked_map of its family's kohya_lora_names); its adapters are fused to those names on export and split
back on import.

A file is applied in full or not at all (load_adapters): a tensor that is no adapter's down/A, up/B or alpha (LoKr,
LoHa, DoRA scales, an up without its down) refuses the file, naming it; text encoders' adapters are left out and
counted in the log. diffusers' older key names (X.lora.down.weight / X.lora.up.weight) read as lora_A / lora_B.

A family with a diffusers converter (FLUX, Wan) gives the diffusers module names: the map from each official
Linear to the diffusers Linears holding its rows is read off the converter itself (`module_map`), so a fused
official layer (FLUX's qkv, or linear1 = q, k, v and the MLP input) exports as one adapter per diffusers layer
(the same A, its rows of B: exact) and imports back fused (A shared when the pieces share it, as after an
export; otherwise stacked A and block-diagonal B, which is exact too). A family without one (DiT, the video
DiTs) writes the diffusers/PEFT layout under its official module names.
"""
import json
import logging
from collections.abc import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from opendit.lora.layer import Adapter

logger = logging.getLogger("opendit")

DIFFUSERS_PREFIX = "transformer."
KOHYA_PREFIX = "lora_unet_"
METADATA_KEY = "lora_adapter_metadata"  # diffusers' key for the adapter's LoraConfig
LAYOUTS = ("diffusers", "kohya")

# {official Linear name: [(diffusers Linear name, the official rows it holds, in its row order)]}
ModuleMap = dict[str, list[tuple[str, torch.Tensor]]]


def module_map(to_diffusers: Callable[[dict], dict] | None, shapes: dict[str, tuple],
               linears: list[str]) -> ModuleMap:
    """Where each official Linear's rows go in the diffusers model, found by converting a probe state dict (one
    column per tensor, each Linear weight row holding its own number) with the family's converter. Without a
    converter (None, or one that returns None: a family without a diffusers model) every Linear keeps its
    official name."""
    wanted = {f"{n}.weight": n for n in linears}
    probe, starts, owners, next_id = {}, [], [], 0
    for key, shape in shapes.items():
        rows = shape[0] if len(shape) else 1
        if key in wanted:
            probe[key] = torch.arange(next_id, next_id + rows, dtype=torch.float64)[:, None]
            starts.append(next_id)
            owners.append(wanted[key])
            next_id += rows
        else:
            probe[key] = torch.full((rows, 1), -1.0, dtype=torch.float64)
    converted = to_diffusers(probe) if to_diffusers is not None else None
    if converted is None:
        return {name: [(name, torch.arange(shapes[f"{name}.weight"][0]))] for name in linears}
    starts_t = torch.tensor(starts, dtype=torch.float64)
    found: ModuleMap = {}
    for key, t in converted.items():
        ids = t.flatten()
        if not key.endswith(".weight") or ids.numel() == 0 or ids[0] < 0:
            continue
        which = torch.searchsorted(starts_t, ids, right=True) - 1
        if (which != which[0]).any():  # a diffusers layer mixing rows of two official layers: no single adapter
            raise ValueError(f"diffusers layer {key[:-7]} holds rows of several official layers; cannot map "
                             "adapters onto it")
        rows = (ids - starts_t[which[0]]).long()
        found.setdefault(owners[int(which[0])], []).append((key[:-len(".weight")], rows))
    return found


# ---- the diffusers / PEFT layout -------------------------------------------------------------------------------
def stacked_map(stacks: dict[str, tuple[str, ...]], rows_of: Callable[[str], int]) -> ModuleMap:
    """{name: the Linears whose rows it stacks, in order} -> a ModuleMap; rows_of(Linear) is its output rows."""
    found: ModuleMap = {}
    for name, parts in stacks.items():
        start = 0
        for part in parts:
            rows = rows_of(part)
            found.setdefault(name, []).append((part, torch.arange(start, start + rows)))
            start += rows
    return found


def split_adapters(adapters: dict[str, Adapter], mapping: ModuleMap, layout: str = "diffusers") -> dict[str, Adapter]:
    """Adapters of mapped names -> one per Linear holding their rows (the same A, its rows of B: exact)."""
    out = {}
    for name, a in adapters.items():
        if name not in mapping:
            raise ValueError(f"{name} has no {layout} counterpart; it cannot be exported in the {layout} layout")
        for target, rows in mapping[name]:
            out[target] = Adapter(a.A, a.B[rows], a.alpha)
    return out


def to_diffusers(adapters: dict[str, Adapter], mapping: ModuleMap) -> tuple[dict, dict]:
    """-> (state dict, safetensors metadata) of the diffusers layout."""
    state, ranks, alphas = {}, {}, {}
    for target, a in split_adapters(adapters, mapping).items():
        state[f"{DIFFUSERS_PREFIX}{target}.lora_A.weight"] = a.A.clone()  # one copy per layer: shared is refused
        state[f"{DIFFUSERS_PREFIX}{target}.lora_B.weight"] = a.B.contiguous()
        ranks[target], alphas[target] = a.rank, a.alpha
    return state, {"format": "pt", METADATA_KEY: json.dumps(_lora_config(ranks, alphas), sort_keys=True)}


def _lora_config(ranks: dict[str, int], alphas: dict[str, float]) -> dict:
    """The LoraConfig fields diffusers builds the adapter from: the most common rank and alpha, and patterns for
    modules that differ (PEFT matches a pattern against the end of a module name)."""
    def most_common(values):
        values = list(values)
        return max(set(values), key=values.count) if values else 0
    r, alpha = most_common(ranks.values()), most_common(alphas.values())
    config = {"r": r, "lora_alpha": alpha, "target_modules": sorted(ranks),
              "rank_pattern": {n: v for n, v in ranks.items() if v != r},
              "alpha_pattern": {n: v for n, v in alphas.items() if v != alpha}}
    return {f"{DIFFUSERS_PREFIX}{k}": v for k, v in config.items()}


def from_diffusers(state: dict, metadata: dict | None, mapping: ModuleMap, source: str) -> dict[str, Adapter]:
    """A diffusers/PEFT-layout state dict -> adapters under official names (fused layers re-fused)."""
    config = _read_config(metadata)
    pieces = {}  # diffusers module -> (A, B, alpha)
    for key in state:
        if key.endswith(".lora_A.weight"):
            target = key[:-len(".lora_A.weight")]
            B = state.get(target + ".lora_B.weight")
            if B is None:
                raise ValueError(f"{source}: {key} has no matching lora_B")
            short = target.removeprefix(DIFFUSERS_PREFIX)
            rank = state[key].shape[0]
            alpha = state.get(target + ".alpha")
            alpha = float(alpha) if alpha is not None else _alpha_for(config, short, rank)
            pieces[short] = (state[key], B, alpha)
    if not pieces:
        raise ValueError(f"{source} holds no lora_A / lora_B weights (of {len(state)} keys, e.g. "
                         f"{sorted(state)[:2]}); it is not a LoRA in the diffusers/PEFT layout")
    where = {target: (name, rows) for name, parts in mapping.items() for target, rows in parts}
    unknown = sorted(t for t in pieces if t not in where)
    if unknown:
        raise ValueError(f"{source} adapts {len(unknown)} layers this model does not have (e.g. {unknown[0]}); is "
                         "it for another model (or a text encoder's adapter)?")
    return fuse_adapters({t: Adapter(*piece) for t, piece in pieces.items()}, mapping, source)


def fuse_adapters(adapters: dict[str, Adapter], mapping: ModuleMap, source: str) -> dict[str, Adapter]:
    """Adapters of the Linears a mapping's names stack -> one per name (split_adapters' inverse); an adapter of a
    Linear no name holds is a ValueError."""
    where = {target: (name, rows) for name, parts in mapping.items() for target, rows in parts}
    grouped: dict[str, list] = {}
    for target, a in adapters.items():
        if target not in where:
            raise ValueError(f"{source}: {target} has no counterpart in the file's layout (its layers: e.g. "
                             f"{next(iter(mapping), '-')}); it cannot be written there")
        name, rows = where[target]
        grouped.setdefault(name, []).append((rows, a.A, a.B, a.alpha))
    # the official layer's rows are those of all its diffusers layers, adapted or not (a piece left out is refused)
    return {name: _fuse(parts, sum(len(r) for _, r in mapping[name]), name, source)
            for name, parts in grouped.items()}


def _read_config(metadata: dict | None) -> dict:
    raw = (metadata or {}).get(METADATA_KEY)
    if not raw:
        return {}
    config = json.loads(raw) if isinstance(raw, str) else raw
    return {k.removeprefix(DIFFUSERS_PREFIX): v for k, v in config.items()}


def _alpha_for(config: dict, target: str, rank: int) -> float:
    """A module's alpha from the LoraConfig metadata (its alpha_pattern entry, else lora_alpha); no metadata:
    alpha = rank (scale 1), as diffusers loads such a file."""
    for pattern, value in config.get("alpha_pattern", {}).items():
        if target == pattern or target.endswith("." + pattern):
            return float(value)
    return float(config.get("lora_alpha", rank))


def _fuse(parts: list, out_rows: int, name: str, source: str) -> Adapter:
    """The official layer's adapter from the adapters of the diffusers layers holding its rows."""
    for rows, _, Bp, _ in parts:
        if Bp.shape[0] != len(rows):
            raise ValueError(f"{source}: an adapter of {name} makes {Bp.shape[0]} rows where this model's layer has "
                             f"{len(rows)}; it is for another model size")
    covered = torch.cat([rows for rows, *_ in parts])
    if len(set(covered.tolist())) != len(covered):
        raise ValueError(f"{source}: two adapters of {name} write the same rows; the file is inconsistent")
    # rows no adapter covers (diffusers' usual FLUX LoRA adapts attn.to_q/k/v but not proj_mlp, both parts of
    # the single blocks' linear1) get zero rows of B: they change by zero, as in the file
    A0, alpha0 = parts[0][1], parts[0][3]
    if all(torch.equal(A, A0) and alpha == alpha0 for _, A, _, alpha in parts):
        B = torch.zeros(out_rows, A0.shape[0], dtype=parts[0][2].dtype)
        for rows, _, Bp, _ in parts:
            B[rows] = Bp
        return Adapter(A0, B, alpha0)
    rank = sum(A.shape[0] for _, A, _, _ in parts)  # stacked A, block-diagonal B, each piece's scale folded in
    B = torch.zeros(out_rows, rank, dtype=torch.float32)
    start = 0
    for rows, A, Bp, alpha in parts:
        B[rows, start:start + A.shape[0]] = Bp.float() * (alpha / A.shape[0])
        start += A.shape[0]
    return Adapter(torch.cat([A.float() for _, A, _, _ in parts]), B, float(rank))


# ---- the kohya / ComfyUI layout --------------------------------------------------------------------------------
def kohya_name(name: str) -> str:
    return KOHYA_PREFIX + name.replace(".", "_")


def to_kohya(adapters: dict[str, Adapter]) -> dict:
    state = {}
    for name, a in adapters.items():
        key = kohya_name(name)
        state[f"{key}.lora_down.weight"] = a.A.contiguous()
        state[f"{key}.lora_up.weight"] = a.B.contiguous()
        state[f"{key}.alpha"] = torch.tensor(a.alpha, dtype=torch.float32)
    return state


def from_kohya(state: dict, linears: list[str], source: str) -> dict[str, Adapter]:
    """A kohya-layout state dict -> adapters; module names are matched against the model's Linear names."""
    names = {kohya_name(n): n for n in linears}
    out = {}
    for key in state:
        if not key.endswith(".lora_down.weight"):
            continue
        base = key[:-len(".lora_down.weight")]
        if base not in names:
            raise ValueError(f"{source} adapts {base}, which is no Linear layer of this model (its layers are named "
                             f"like {kohya_name(linears[0])}); is it for another model?")
        if f"{base}.lora_up.weight" not in state:
            raise ValueError(f"{source}: {key} has no matching lora_up")
        A, B = state[key], state[f"{base}.lora_up.weight"]
        if A.ndim != 2:
            raise ValueError(f"{source}: {base} is a {A.ndim}-D (convolution) adapter; only Linear adapters load")
        alpha = state.get(f"{base}.alpha")
        out[names[base]] = Adapter(A, B, float(alpha) if alpha is not None else float(A.shape[0]))
    return out


# ---- a file in full or not at all ------------------------------------------------------------------------------
SUFFIXES = {"kohya": (".lora_down.weight", ".lora_up.weight", ".alpha"),
            "diffusers": (".lora_A.weight", ".lora_B.weight", ".alpha")}
TEXT_ENCODER_PREFIXES = ("lora_te", "text_encoder")  # kohya's lora_te1_..., diffusers' text_encoder(_2).
OLDER_DIFFUSERS = {".lora.down.weight": ".lora_A.weight", ".lora.up.weight": ".lora_B.weight"}  # pre-PEFT names


def current_names(state: dict) -> dict:
    """diffusers' older LoRA key names (X.lora.down.weight / X.lora.up.weight, X.alpha) as the PEFT ones."""
    def renamed(key: str) -> str:
        for old, new in OLDER_DIFFUSERS.items():
            if key.endswith(old):
                return key[:-len(old)] + new
        return key
    return {renamed(k): v for k, v in state.items()}


def unread_keys(state: dict, layout: str) -> list[str]:
    """The keys of a LoRA state dict that `layout`'s reader does not apply: anything but an adapter's down (A), up
    (B) and alpha tensors, and those of an up or alpha without its down (text encoders' keys aside)."""
    down, *_ = suffixes = SUFFIXES[layout]
    adapted = {k[:-len(down)] for k in state if k.endswith(down)}
    if layout == "kohya":
        adapted = {m for m in adapted if m.startswith(KOHYA_PREFIX)}
    return sorted(k for k in state if not k.startswith(TEXT_ENCODER_PREFIXES) and
                  not any(k.endswith(s) and k[:-len(s)] in adapted for s in suffixes))


# ---- files -----------------------------------------------------------------------------------------------------
def detect_layout(keys) -> str:
    keys = list(keys)
    if any(k.endswith(".lora_down.weight") for k in keys):
        return "kohya"
    if any(k.endswith(".lora_A.weight") for k in keys):
        return "diffusers"
    raise ValueError(f"not a LoRA file: none of its {len(keys)} keys (e.g. {keys[:2]}) ends in .lora_A.weight "
                     "(diffusers/PEFT) or .lora_down.weight (kohya/ComfyUI)")


def read_file(path: str) -> tuple[dict, dict]:
    """(tensors, safetensors metadata) of a LoRA .safetensors file."""
    try:
        with safe_open(path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except FileNotFoundError:
        raise FileNotFoundError(f"LoRA file {path} does not exist") from None
    except Exception as e:  # safetensors' own error types differ between versions
        raise ValueError(f"{path} is not a readable .safetensors LoRA file ({e}); export or download it "
                         "again") from None


def load_adapters(path: str, mapping: ModuleMap, linears: list[str],
                  kohya_map: ModuleMap | None = None) -> dict[str, Adapter]:
    """A LoRA file in either layout -> adapters under the model's module names (fp32); kohya_map: the kohya
    layout's names, when they are not the model's."""
    state, metadata = read_file(path)
    state = current_names(state)
    layout = detect_layout(state)
    unread = unread_keys(state, layout)
    if unread:
        raise ValueError(f"{path}: {len(unread)} of its {len(state)} tensors are nothing opendit applies (e.g. "
                         f"{', '.join(unread[:3])}); a LoRA file is applied in full or not at all. It holds "
                         f"{layout}-layout adapters (down/A, up/B, alpha per layer) beside something else "
                         f"(LyCORIS LoKr/LoHa, DoRA, a full-weight diff?): convert it to a plain LoRA, or merge it "
                         f"into the base weights with the tool that made it")
    encoders = [k for k in state if k.startswith(TEXT_ENCODER_PREFIXES)]
    if encoders:
        if len(encoders) == len(state):
            raise ValueError(f"{path} holds only text-encoder adapters ({len(encoders)} tensors, e.g. "
                             f"{encoders[0]}); opendit keeps its text encoders frozen, so nothing would apply")
        logger.info("%s: %d text-encoder tensors left out (opendit keeps its text encoders frozen)", path,
                    len(encoders))
        state = {k: v for k, v in state.items() if not k.startswith(TEXT_ENCODER_PREFIXES)}
    if layout == "diffusers":
        adapters = from_diffusers(state, metadata, mapping, path)
    elif kohya_map is None:
        adapters = from_kohya(state, linears, path)
    else:
        adapters = split_adapters(from_kohya(state, list(kohya_map), path), kohya_map, "kohya")
    return {n: Adapter(a.A.float(), a.B.float(), a.alpha) for n, a in adapters.items()}


def save_adapters(path: str, adapters: dict[str, Adapter], layout: str, mapping: ModuleMap | None = None,
                  metadata: dict | None = None, kohya_map: ModuleMap | None = None) -> None:
    """Write `adapters` in `layout` (diffusers needs `mapping`; kohya takes `kohya_map` where its names are not the
    model's); metadata: extra string fields (e.g. the base weights' name and hash)."""
    if layout == "kohya":
        if kohya_map is not None:
            adapters = fuse_adapters(adapters, kohya_map, path)
        state, meta = to_kohya(adapters), {"format": "pt", "ss_network_module": "networks.lora"}
    else:
        state, meta = to_diffusers(adapters, mapping)
    save_file(state, path, metadata={**meta, **{k: str(v) for k, v in (metadata or {}).items()}})
