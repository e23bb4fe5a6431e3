"""Wan2.1 weights to/from diffusers' `WanTransformer3DModel` (the transformer/ folder of Wan-AI/Wan2.1-T2V-*-Diffusers).

Our keys are the official release's (model.WanModel). The two layouts hold the same tensors, renamed:

    ours (official)                  diffusers
    patch_embedding                  patch_embedding
    text_embedding.{0,2}             condition_embedder.text_embedder.linear_{1,2}
    time_embedding.{0,2}             condition_embedder.time_embedder.linear_{1,2}
    time_projection.1                condition_embedder.time_proj
    blocks.{i}.                      blocks.{i}.
      modulation                       scale_shift_table
      self_attn.{q,k,v,o}              attn1.{to_q,to_k,to_v,to_out.0}
      self_attn.norm_{q,k}             attn1.norm_{q,k}
      cross_attn.*                     attn2.* (as self_attn)
      norm3 (the cross-attention's)    norm2
      ffn.{0,2}                        ffn.net.{0.proj,2}
    head.head                        proj_out
    head.modulation                  scale_shift_table

The modulation rows keep their order (shift, scale, gate, ...). diffusers computes the same math except for its
fp32 timestep sinusoid and fp32 RoPE application (ours: float64, as released), ~1e-5 apart: tests/test_wan_model.py
compares the two forwards.
"""
import re
from pathlib import Path

from opendit.checkpoint.folders import read_config, read_safetensors
from opendit.families.base import WeightAdapter

_TOP = [("patch_embedding", "patch_embedding"),
        ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
        ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
        ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
        ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
        ("time_projection.1", "condition_embedder.time_proj"),
        ("head.head", "proj_out"), ("head.modulation", "scale_shift_table")]
_ATTN = [("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"), ("norm_q", "norm_q"), ("norm_k", "norm_k")]
_BLOCK = [("modulation", "scale_shift_table"), ("norm3", "norm2"), ("ffn.0", "ffn.net.0.proj"), ("ffn.2", "ffn.net.2")]
_BLOCK += [(f"{ours}.{a}", f"{theirs}.{b}") for ours, theirs in (("self_attn", "attn1"), ("cross_attn", "attn2"))
           for a, b in _ATTN]


def _rename(state: dict, to_diffusers: bool) -> dict:
    side = "our" if to_diffusers else "diffusers"
    out = {}
    for key, value in state.items():
        block = re.match(r"blocks\.(\d+)\.(.*)", key)
        prefix, rest, table = (f"blocks.{block[1]}.", block[2], _BLOCK) if block else ("", key, _TOP)
        for ours, theirs in table:
            src, dst = (ours, theirs) if to_diffusers else (theirs, ours)
            if rest.startswith(src) and rest[len(src):] in ("", ".weight", ".bias"):
                out[prefix + dst + rest[len(src):]] = value
                break
        else:
            raise ValueError(f"the {side} state_dict's key {key!r} has no counterpart; it is not a plain Wan2.1 "
                             f"text-to-video transformer (image-to-video projections, LoRA weights, a wrapper prefix "
                             f"such as 'model.'?); remove those keys first")
    return out


def _wan_to_diffusers(state: dict) -> dict:
    """Our (official Wan2.1) state_dict -> WanTransformer3DModel's."""
    return _rename(state, to_diffusers=True)


def _diffusers_to_wan(state: dict) -> dict:
    """WanTransformer3DModel's state_dict -> ours; WanModel(**_wan_arch(config)) loads it strictly."""
    return _rename(state, to_diffusers=False)


def _wan_arch_to_diffusers(wan_config: dict) -> dict:
    """Our WanModel constructor kwargs -> WanTransformer3DModel's."""
    cfg = dict(wan_config)
    if not cfg.get("qk_norm", True):
        raise ValueError("only models with q/k norms (qk_norm=True) convert: diffusers' WanTransformer3DModel always "
                         "normalises q and k")
    return dict(patch_size=tuple(cfg.get("patch_size", (1, 2, 2))), num_attention_heads=cfg["num_heads"],
                attention_head_dim=cfg["dim"] // cfg["num_heads"], in_channels=cfg.get("in_dim", 16),
                out_channels=cfg.get("out_dim", 16), text_dim=cfg.get("text_dim", 4096),
                freq_dim=cfg.get("freq_dim", 256), ffn_dim=cfg["ffn_dim"], num_layers=cfg["num_layers"],
                cross_attn_norm=cfg.get("cross_attn_norm", True), qk_norm="rms_norm_across_heads",
                eps=cfg.get("eps", 1e-6), image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024)


def _wan_arch(config) -> dict:
    """A WanTransformer3DModel config (dict or model.config) -> our WanModel kwargs. text_len is the pipelines'
    umT5 length, 512 (diffusers' config does not hold it)."""
    config = dict(config)
    WAN_WEIGHTS.check_class({"_class_name": "WanTransformer3DModel", **config}, "the config")
    if config.get("image_dim") or config.get("added_kv_proj_dim"):
        raise ValueError("this WanTransformer3DModel takes CLIP image embeddings (Wan2.1's image-to-video); Wan2.1 "
                         "text-to-video and the Wan2.2 models (no image embedder) convert")
    heads, head_dim = config.get("num_attention_heads", 40), config.get("attention_head_dim", 128)
    in_dim = config.get("in_channels", 16)
    out_dim = config.get("out_channels") or in_dim
    # Wan2.2 I2V takes the noisy latent, a 4-channel mask and the first frame's latent; t2v and ti2v are one network
    i2v = in_dim == 2 * out_dim + 4
    return dict(model_type="i2v" if i2v else "t2v", patch_size=tuple(config.get("patch_size", (1, 2, 2))),
                text_len=512, in_dim=in_dim,
                dim=heads * head_dim, ffn_dim=config.get("ffn_dim", 13824), freq_dim=config.get("freq_dim", 256),
                text_dim=config.get("text_dim", 4096), out_dim=out_dim, num_heads=heads,
                num_layers=config.get("num_layers", 40), window_size=(-1, -1), qk_norm=True,
                cross_attn_norm=config.get("cross_attn_norm", True), eps=config.get("eps", 1e-6))


class WanWeights(WeightAdapter):
    """Wan2.1's and Wan2.2's weights: official (ours; a release folder or its safetensors, sharded with an index)
    <-> diffusers' WanTransformer3DModel, its folders and pipeline folders."""
    diffusers_classes = ("WanTransformer3DModel",)

    def to_diffusers(self, state):
        return _wan_to_diffusers(state)

    def from_diffusers(self, state, arch=None):
        return _diffusers_to_wan(state)

    def arch_from_diffusers(self, config: dict) -> dict:
        return _wan_arch(config)

    def arch_to_diffusers(self, arch: dict) -> dict:
        return _wan_arch_to_diffusers(arch)

    @staticmethod
    def is_official_folder(path) -> bool:
        """An official Wan2.1 folder: config.json with "dim" beside diffusion_pytorch_model*.safetensors."""
        p = Path(path)
        return p.is_dir() and (p / "config.json").is_file() and "dim" in read_config(p) and \
            any(p.glob("diffusion_pytorch_model*.safetensors"))

    def load_official(self, path):
        """An official Wan2.1 folder or one of its diffusion_pytorch_model* files (a .safetensors, or the shards'
        .index.json)."""
        official = self.is_official_folder(path) or Path(path).name.startswith("diffusion_pytorch_model")
        return read_safetensors(path) if official else None


WAN_WEIGHTS = WanWeights()
