"""FLUX.1 weights to/from diffusers' `FluxTransformer2DModel` (the transformer/ folder of black-forest-labs/FLUX.1-*).

Our keys are the official release's (opendit.families.flux.model.Flux). The two layouts hold the same numbers:

    ours (official)                            diffusers
    img_in / txt_in                            x_embedder / context_embedder
    time_in.{in,out}_layer                     time_text_embed.timestep_embedder.linear_{1,2}
    vector_in.{in,out}_layer                   time_text_embed.text_embedder.linear_{1,2}
    guidance_in.{in,out}_layer (dev only)      time_text_embed.guidance_embedder.linear_{1,2}
    double_blocks.{i}.                         transformer_blocks.{i}.
      img_mod.lin / txt_mod.lin                  norm1.linear / norm1_context.linear
      img_attn.qkv [3D, D]                       attn.to_q, attn.to_k, attn.to_v [D, D] each
      txt_attn.qkv [3D, D]                       attn.add_q_proj, attn.add_k_proj, attn.add_v_proj
      img_attn.norm.{query,key}_norm.scale       attn.norm_q.weight, attn.norm_k.weight
      txt_attn.norm.{query,key}_norm.scale       attn.norm_added_q.weight, attn.norm_added_k.weight
      img_attn.proj / txt_attn.proj              attn.to_out.0 / attn.to_add_out
      img_mlp.{0,2} / txt_mlp.{0,2}              ff.net.{0.proj,2} / ff_context.net.{0.proj,2}
    single_blocks.{i}.                         single_transformer_blocks.{i}.
      linear1 [3D + M, D]                        attn.to_q, attn.to_k, attn.to_v [D, D], proj_mlp [M, D]
      linear2 / modulation.lin                   proj_out / norm.linear
      norm.{query,key}_norm.scale                attn.norm_q.weight, attn.norm_k.weight
    final_layer.linear                         proj_out
    final_layer.adaLN_modulation.1 [2D, D]     norm_out.linear, its two halves swapped: the official final layer
                                               splits rows as (shift, scale), diffusers' AdaLayerNormContinuous as
                                               (scale, shift)

The block modulations keep their row order (both split (shift, scale, gate) x 1 or 2). diffusers computes the
same math (timesteps and guidance x1000, the same sinusoid, float64 RoPE tables): tests/test_flux_model.py
compares the two forwards.
"""
import re

import torch

from opendit.families.base import WeightAdapter

_WB = ("weight", "bias")
# (ours, diffusers) prefixes of linear layers renamed one to one (weight and bias)
_TOP = [("img_in", "x_embedder"), ("txt_in", "context_embedder"),
        ("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
        ("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
        ("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
        ("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
        ("final_layer.linear", "proj_out")]
_GUIDANCE = [("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"),
             ("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2")]
_DOUBLE = [("img_mod.lin", "norm1.linear"), ("txt_mod.lin", "norm1_context.linear"),
           ("img_attn.proj", "attn.to_out.0"), ("txt_attn.proj", "attn.to_add_out"),
           ("img_mlp.0", "ff.net.0.proj"), ("img_mlp.2", "ff.net.2"),
           ("txt_mlp.0", "ff_context.net.0.proj"), ("txt_mlp.2", "ff_context.net.2")]
_DOUBLE_NORMS = [("img_attn.norm.query_norm.scale", "attn.norm_q.weight"),
                 ("img_attn.norm.key_norm.scale", "attn.norm_k.weight"),
                 ("txt_attn.norm.query_norm.scale", "attn.norm_added_q.weight"),
                 ("txt_attn.norm.key_norm.scale", "attn.norm_added_k.weight")]
# fused layers of ours -> the diffusers layers holding their row blocks, in order
_DOUBLE_FUSED = [("img_attn.qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
                 ("txt_attn.qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"))]
_SINGLE = [("modulation.lin", "norm.linear"), ("linear2", "proj_out")]
_SINGLE_NORMS = [("norm.query_norm.scale", "attn.norm_q.weight"), ("norm.key_norm.scale", "attn.norm_k.weight")]
_SINGLE_FUSED = [("linear1", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"))]
_FINAL_MOD = ("final_layer.adaLN_modulation.1", "norm_out.linear")


def _block_count(state_dict: dict, prefix: str) -> int:
    found = {int(m.group(1)) for k in state_dict if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    if found != set(range(len(found))):
        raise KeyError(f"state_dict block indices {sorted(found)} under {prefix!r} are not 0..N-1; pass a complete "
                       "FLUX transformer state_dict")
    return len(found)


def _plan(n_double: int, n_single: int, guidance: bool) -> list:
    """[(kind, our key, diffusers key or keys)]: kind "same" (renamed), "split" (our rows = the diffusers tensors
    concatenated) or "swap" (the two row halves swapped)."""
    plan = [("same", f"{o}.{p}", f"{t}.{p}") for o, t in _TOP + (_GUIDANCE if guidance else []) for p in _WB]
    plan += [("swap", f"{_FINAL_MOD[0]}.{p}", f"{_FINAL_MOD[1]}.{p}") for p in _WB]
    for i in range(n_double):
        o, t = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        plan += [("same", f"{o}{a}.{p}", f"{t}{b}.{p}") for a, b in _DOUBLE for p in _WB]
        plan += [("same", o + a, t + b) for a, b in _DOUBLE_NORMS]
        plan += [("split", f"{o}{a}.{p}", [f"{t}{x}.{p}" for x in b]) for a, b in _DOUBLE_FUSED for p in _WB]
    for i in range(n_single):
        o, t = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        plan += [("same", f"{o}{a}.{p}", f"{t}{b}.{p}") for a, b in _SINGLE for p in _WB]
        plan += [("same", o + a, t + b) for a, b in _SINGLE_NORMS]
        plan += [("split", f"{o}{a}.{p}", [f"{t}{x}.{p}" for x in b]) for a, b in _SINGLE_FUSED for p in _WB]
    return plan


def _take(state_dict: dict, key: str, side: str):
    if key not in state_dict:
        raise KeyError(f"{side} state_dict has no {key!r} (of {len(state_dict)} keys); is it a FLUX.1 transformer "
                       "with biases on its qkv (qkv_bias=True, as released)? a prefix such as 'model.diffusion_model.' "
                       "or 'transformer.' left on? strip it first")
    return state_dict[key]


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def _check_all_used(state_dict: dict, used: set, side: str) -> None:
    extra = sorted(set(state_dict) - used)
    if extra:
        raise ValueError(f"{len(extra)} keys of the {side} state_dict have no counterpart, e.g. {extra[:5]}; it is not "
                         "a plain FLUX.1 transformer (LoRA or ControlNet weights, IP-adapter projections, a wrapper "
                         "prefix?); remove them before converting")


def _flux_to_diffusers(state_dict: dict) -> dict:
    """Our (official FLUX.1) state_dict -> FluxTransformer2DModel's. The guidance embedder is converted when
    present (FLUX.1-dev), as diffusers' guidance_embeds=True expects."""
    hidden = _take(state_dict, "img_in.weight", "our").shape[0]
    plan = _plan(_block_count(state_dict, "double_blocks."), _block_count(state_dict, "single_blocks."),
                 "guidance_in.in_layer.weight" in state_dict)
    out, used = {}, set()
    for kind, ours, theirs in plan:
        t = _take(state_dict, ours, "our")
        used.add(ours)
        if kind == "same":
            out[theirs] = t
        elif kind == "swap":
            out[theirs] = _swap_halves(t)
        else:  # q, k, v rows of width `hidden` each, then (single blocks) the MLP input rows
            sizes = [hidden] * 3 + ([t.shape[0] - 3 * hidden] if len(theirs) == 4 else [])
            if sum(sizes) != t.shape[0] or sizes[-1] <= 0:
                raise ValueError(f"{ours} has {t.shape[0]} rows, which do not split into q, k, v of {hidden} rows"
                                 f"{' and MLP rows' if len(theirs) == 4 else ''} (hidden size from img_in.weight)")
            out.update(zip(theirs, t.split(sizes, dim=0)))
    _check_all_used(state_dict, used, "our")
    return out


def _flux_from_diffusers(state_dict: dict) -> dict:
    """FluxTransformer2DModel's state_dict -> ours; `Flux(**_flux_arch(config))` loads it with
    strict=True. The diffusers tensors fused into one of ours (q, k, v and the MLP input: 30% of FLUX.1) are
    replaced in `state_dict` by views of the fused tensor, the same values: a folder read for the conversion
    frees them as it goes instead of holding them beside their fused copies until the end."""
    plan = _plan(_block_count(state_dict, "transformer_blocks."),
                 _block_count(state_dict, "single_transformer_blocks."),
                 "time_text_embed.guidance_embedder.linear_1.weight" in state_dict)
    out, used = {}, set()
    for kind, ours, theirs in plan:
        if kind == "split":
            pieces = [_take(state_dict, k, "diffusers") for k in theirs]
            out[ours] = torch.cat(pieces, dim=0)
            state_dict.update(zip(theirs, out[ours].split([len(p) for p in pieces], dim=0)))
            used.update(theirs)
            continue
        t = _take(state_dict, theirs, "diffusers")
        out[ours] = t if kind == "same" else _swap_halves(t)
        used.add(theirs)
    _check_all_used(state_dict, used, "diffusers")
    return out


def _flux_arch(config) -> dict:
    """A FluxTransformer2DModel config (dict or model.config) -> our Flux constructor kwargs."""
    config = dict(config)
    FLUX_WEIGHTS.check_class({"_class_name": "FluxTransformer2DModel", **config}, "the config")
    heads, head_dim = config.get("num_attention_heads", 24), config.get("attention_head_dim", 128)
    in_channels, patch = config.get("in_channels", 64), config.get("patch_size", 1)
    # diffusers' x_embedder takes in_channels whatever patch_size says; its proj_out emits patch^2 x out_channels
    out_channels = patch * patch * (config.get("out_channels") or in_channels)
    return dict(in_channels=in_channels, out_channels=out_channels,
                vec_in_dim=config.get("pooled_projection_dim", 768),
                context_in_dim=config.get("joint_attention_dim", 4096), hidden_size=heads * head_dim, mlp_ratio=4.0,
                num_heads=heads, depth=config.get("num_layers", 19),
                depth_single_blocks=config.get("num_single_layers", 38),
                axes_dim=tuple(config.get("axes_dims_rope", (16, 56, 56))), theta=10000, qkv_bias=True,
                guidance_embed=bool(config.get("guidance_embeds", False)))


class FluxWeights(WeightAdapter):
    """FLUX.1's weights: official (ours) <-> diffusers' FluxTransformer2DModel, its folders and pipeline folders."""
    diffusers_classes = ("FluxTransformer2DModel",)

    def to_diffusers(self, state):
        return _flux_to_diffusers(state)

    def from_diffusers(self, state, arch=None):
        return _flux_from_diffusers(state)

    def arch_from_diffusers(self, config: dict) -> dict:
        return _flux_arch(config)


FLUX_WEIGHTS = FluxWeights()
