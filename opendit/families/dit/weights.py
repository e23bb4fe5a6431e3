"""DiT weights to/from diffusers' `DiTTransformer2DModel` (the layout of e.g. facebook/DiT-XL-2-256 on the Hub).

The two layouts hold the same numbers, renamed and reshaped:

    ours (official DiT release)             diffusers
    x_embedder.proj                         pos_embed.proj
    pos_embed [1, N, D] (frozen sin-cos)    none: diffusers recomputes the same sin-cos table
    t_embedder.mlp.{0,2}                    transformer_blocks.{i}.norm1.emb.timestep_embedder.linear_{1,2}
    y_embedder.embedding_table [K+1, D]     transformer_blocks.{i}.norm1.emb.class_embedder.embedding_table
    blocks.{i}.attn.qkv [3D, D]             transformer_blocks.{i}.attn1.to_{q,k,v} [D, D] each
    blocks.{i}.attn.proj                    transformer_blocks.{i}.attn1.to_out.0
    blocks.{i}.mlp.fc{1,2}                  transformer_blocks.{i}.ff.net.{0.proj,2}
    blocks.{i}.adaLN_modulation.1 [6D, D]   transformer_blocks.{i}.norm1.linear
    final_layer.adaLN_modulation.1 [2D, D]  proj_out_1
    final_layer.linear                      proj_out_2

diffusers keeps one copy of the timestep/class embedders per block (each block embeds (t, y) itself; the final
layer uses block 0's); ours has one. Chunk orders agree: both split adaLN rows as (shift_msa, scale_msa, gate_msa,
shift_mlp, scale_mlp, gate_mlp) and the final layer's as (shift, scale), so no rows are permuted.

Not a naming matter, so not converted: diffusers computes slightly different math with the same weights. Its
timestep frequencies are exp(-ln(1e4) * i / (128 - 1)) (`downscale_freq_shift=1`) where DiT uses i / 128, and the
LayerNorm before its MLP uses `norm_eps` (default 1e-5) where DiT uses 1e-6. Our model run on converted weights
computes what the official DiT code computes (tests/test_convert_diffusers.py measures both differences).
"""
import logging
import re

import torch

from opendit.families.base import WeightAdapter
from opendit.models.pos_embed import sincos_2d

log = logging.getLogger(__name__)

DIT_CLASSES = ("DiTTransformer2DModel", "Transformer2DModel")  # the diffusers classes that hold a DiT
_EMB = "norm1.emb."
# (ours, diffusers) full keys of the shared embedders (diffusers': under each block's norm1.emb), then the
# one-to-one renames of layers with a weight and a bias
_EMBEDDERS = [(f"t_embedder.mlp.{a}.{p}", f"timestep_embedder.linear_{b}.{p}") for a, b in ((0, 1), (2, 2))
              for p in ("weight", "bias")]
_EMBEDDERS.append(("y_embedder.embedding_table.weight", "class_embedder.embedding_table.weight"))
_TOP = [("x_embedder.proj", "pos_embed.proj"), ("final_layer.adaLN_modulation.1", "proj_out_1"),
        ("final_layer.linear", "proj_out_2")]
_BLOCK = [("attn.proj", "attn1.to_out.0"), ("mlp.fc1", "ff.net.0.proj"), ("mlp.fc2", "ff.net.2"),
          ("adaLN_modulation.1", "norm1.linear")]
_PARAMS = ("weight", "bias")


def _depth_of(state_dict: dict, pattern: str) -> int:
    found = {int(m.group(1)) for k in state_dict if (m := re.match(pattern, k))}
    if not found or found != set(range(max(found) + 1)):
        raise KeyError(f"state_dict block indices {sorted(found)} are not 0..N-1 (pattern {pattern!r}); "
                       "pass a complete DiT state_dict")
    return len(found)


def _take(state_dict: dict, key: str, side: str):
    if key not in state_dict:
        raise KeyError(f"{side} state_dict has no {key!r} (of {len(state_dict)} keys); is it a DiT with "
                       "adaLN-Zero blocks and biases? a prefix such as 'module.' or 'transformer.' left on?")
    return state_dict[key]


def _grid_size(num_tokens: int) -> int:
    grid = round(num_tokens ** 0.5)
    if grid * grid != num_tokens:
        raise ValueError(f"pos_embed has {num_tokens} tokens, not a square grid; diffusers' DiT is square only")
    return grid


def _dit_to_diffusers(state_dict: dict, depth: int | None = None) -> dict:
    """Our (official DiT) state_dict -> DiTTransformer2DModel's. `depth` defaults to the number of blocks found.

    The frozen pos_embed is dropped (diffusers recomputes it); it must be the standard sin-cos table, since a
    learned one would be lost silently.
    """
    n_blocks = _depth_of(state_dict, r"blocks\.(\d+)\.")
    if depth is not None and depth != n_blocks:
        raise ValueError(f"depth={depth} but the state_dict holds {n_blocks} blocks; pass depth={n_blocks} or None")
    pos = _take(state_dict, "pos_embed", "our")
    expected = sincos_2d(pos.shape[-1], _grid_size(pos.shape[1])).to(pos.dtype)
    if not torch.allclose(pos[0].float().cpu(), expected.float(), atol=1e-3):
        raise ValueError("pos_embed differs from the fixed 2-D sin-cos table; diffusers' DiT has no slot for a "
                         "learned position embedding, so these weights cannot be converted")
    out = {}
    for ours, theirs in _TOP:
        for p in _PARAMS:
            out[f"{theirs}.{p}"] = _take(state_dict, f"{ours}.{p}", "our")
    for i in range(n_blocks):
        src, dst = f"blocks.{i}.", f"transformer_blocks.{i}."
        for ours, theirs in _EMBEDDERS:
            # clone: safetensors refuses tensors that share storage, and each block owns its copy in diffusers
            out[dst + _EMB + theirs] = _take(state_dict, ours, "our").clone()
        for ours, theirs in _BLOCK:
            for p in _PARAMS:
                out[dst + f"{theirs}.{p}"] = _take(state_dict, src + f"{ours}.{p}", "our")
        for p in _PARAMS:  # qkv rows are [q; k; v], each [D(, D)]
            q, k, v = _take(state_dict, src + f"attn.qkv.{p}", "our").chunk(3, dim=0)
            out[dst + f"attn1.to_q.{p}"], out[dst + f"attn1.to_k.{p}"], out[dst + f"attn1.to_v.{p}"] = q, k, v
    return out


def _shared_embedders(state_dict: dict, n_blocks: int) -> dict:
    """Block 0's timestep/class embedders under our names, after checking every block holds the same copy."""
    out = {}
    for ours, theirs in _EMBEDDERS:
        first = _take(state_dict, f"transformer_blocks.0.{_EMB}{theirs}", "diffusers")
        for i in range(1, n_blocks):
            key = f"transformer_blocks.{i}.{_EMB}{theirs}"
            if not torch.equal(_take(state_dict, key, "diffusers"), first):
                raise ValueError(f"{key} differs from block 0's copy; our DiT shares one timestep/class embedder "
                                 "across blocks, so it cannot hold these weights")
        out[ours] = first
    return out


def _dit_from_diffusers(state_dict: dict, sample_size: int) -> dict:
    """DiTTransformer2DModel's state_dict -> ours. `sample_size` (the latent height = width, diffusers' config
    field of that name) sets the pos_embed table, which diffusers does not store.

    Every block's copy of the timestep/class embedders must be equal (true of converted official weights): our
    model has one copy, so weights fine-tuned with diverged copies cannot be represented and are refused.
    """
    n_blocks = _depth_of(state_dict, r"transformer_blocks\.(\d+)\.")
    patch = _take(state_dict, "pos_embed.proj.weight", "diffusers").shape[-1]
    if sample_size % patch:
        raise ValueError(f"sample_size={sample_size} is not divisible by the patch size {patch}")
    out = _shared_embedders(state_dict, n_blocks)
    for ours, theirs in _TOP:
        for p in _PARAMS:
            out[f"{ours}.{p}"] = _take(state_dict, f"{theirs}.{p}", "diffusers")
    for i in range(n_blocks):
        src, dst = f"transformer_blocks.{i}.", f"blocks.{i}."
        for ours, theirs in _BLOCK:
            for p in _PARAMS:
                out[dst + f"{ours}.{p}"] = _take(state_dict, src + f"{theirs}.{p}", "diffusers")
        for p in _PARAMS:
            qkv = [_take(state_dict, src + f"attn1.to_{n}.{p}", "diffusers") for n in "qkv"]
            out[dst + f"attn.qkv.{p}"] = torch.cat(qkv, dim=0)
    hidden = out["x_embedder.proj.weight"].shape[0]
    out["pos_embed"] = sincos_2d(hidden, sample_size // patch).unsqueeze(0).to(out["x_embedder.proj.weight"].dtype)
    return out


def _config_to_kwargs(config: dict, folder: str = "config.json") -> dict:
    """diffusers' config.json -> DiT constructor kwargs; refuses variants our DiT does not compute."""
    need = {"norm_type": "ada_norm_zero", "activation_fn": "gelu-approximate", "attention_bias": True,
            "norm_elementwise_affine": False}
    wrong = {k: config.get(k) for k, v in need.items() if config.get(k, v) != v}
    if wrong or not config.get("num_embeds_ada_norm") or not config.get("patch_size"):
        raise ValueError(f"{folder!r}/config.json describes a transformer our DiT cannot compute: {wrong or config}; "
                         f"needs {need}, a patch_size and num_embeds_ada_norm (the class count)")
    in_ch = config.get("in_channels", 4)
    out_ch = config.get("out_channels") or in_ch
    if out_ch not in (in_ch, 2 * in_ch):
        raise ValueError(f"{folder!r}: out_channels={out_ch} is neither in_channels={in_ch} nor twice it "
                         "(learned sigma); our DiT has no other output width")
    heads, head_dim = config.get("num_attention_heads", 16), config.get("attention_head_dim", 72)
    return {"input_size": config.get("sample_size", 32), "patch_size": config["patch_size"], "in_channels": in_ch,
            "hidden_size": heads * head_dim, "depth": config.get("num_layers", 28), "num_heads": heads,
            "num_classes": config["num_embeds_ada_norm"], "learn_sigma": out_ch == 2 * in_ch}


class DiTWeights(WeightAdapter):
    """DiT's weights: official (ours) <-> diffusers' DiTTransformer2DModel, its folders and pipeline folders."""
    diffusers_classes = DIT_CLASSES
    diffusers_lora = False  # DiT LoRA files name the official modules

    def to_diffusers(self, state, depth: int | None = None):
        return _dit_to_diffusers(state, depth)

    def from_diffusers(self, state, arch=None):
        """arch: our constructor kwargs; its input_size sizes the position table diffusers does not store."""
        return _dit_from_diffusers(state, (arch or {}).get("input_size", 32))

    def arch_from_diffusers(self, config: dict) -> dict:
        return _config_to_kwargs(config)

    def arch_from_weights(self, kwargs, converted, config, folder) -> dict:
        """The MLP ratio, which diffusers' config does not hold, from the weights; `DiT(**kwargs)` then loads the
        converted state_dict with strict=True."""
        width = converted["blocks.0.mlp.fc1.weight"].shape[0]
        kwargs["mlp_ratio"] = width / kwargs["hidden_size"]
        if converted["blocks.0.adaLN_modulation.1.weight"].shape[1] != kwargs["hidden_size"]:
            raise ValueError(f"{folder!r}: config.json says hidden size {kwargs['hidden_size']} (heads x head dim) "
                             f"but the weights are {converted['blocks.0.adaLN_modulation.1.weight'].shape[1]} wide")
        if config.get("norm_eps", 1e-5) != 1e-6:
            log.info("%s: diffusers runs its MLP LayerNorm with eps=%s; our DiT uses DiT's 1e-6 (tiny output change)",
                     folder, config.get("norm_eps", 1e-5))
        return kwargs


DIT_WEIGHTS = DiTWeights()
