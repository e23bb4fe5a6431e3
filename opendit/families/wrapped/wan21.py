"""Wan2.1 (text-to-video) through diffusers' own WanTransformer3DModel and WanPipeline: the same weights as opendit's
native Wan family (opendit.families.wan; WAN_WEIGHTS converts them both ways), trained by the diffusers video kind,
so the two can be compared side by side (tests/test_wan21_wrapped.py: equal losses).

Prompts are the pipeline's own UMT5 encoding (each prompt's tokens, zero-padded to max_sequence_length). Clips go
through AutoencoderKLWan (8x down, 4x in time after the first frame, 16 channels), normalised per channel by its
latents_mean and latents_std. Training: the flow the pipeline samples (x_t = (1 - t) x + t noise, the model sees
1000 t and predicts noise - x, plain MSE) as the native family trains it (there unshifted: --timestep_sampling).
Sampling: the pipeline's classifier-free guidance (--cfg_scale is its guidance_scale; 1: off) with the flow-matching
Euler scheduler at the release's shift.
"""
import torch

from opendit.families.wrapped.context_parallel import diffusers_plan
from opendit.families.wrapped.glue import ModelGlue, TextEncoder, WrappedSpec, load_text_encoder
from opendit.perf import matmul_macs

WAN21_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                  out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", eps=1e-6)
# the native Wan-debug's architecture (128 wide, 4 blocks, 4x4 patches) for a tiny UMT5 32 wide
WAN_DEBUG = dict(WAN21_1_3B, patch_size=(1, 4, 4), num_attention_heads=4, attention_head_dim=32, text_dim=32,
                 freq_dim=64, ffn_dim=512, num_layers=4)
WAN21_MODELS = {
    "wan2.1-t2v-1.3b-diffusers": WrappedSpec("wan2.1-t2v-1.3b-diffusers", "wan21", None, WAN21_1_3B,
                                             dict(max_sequence_length=512, steps=50, cfg_scale=5.0,
                                                  text_params=5.68e9)),  # UMT5-XXL's encoder
    "wan-debug-diffusers": WrappedSpec("wan-debug-diffusers", "wan21", None, WAN_DEBUG,
                                       dict(max_sequence_length=16, steps=20, cfg_scale=3.0, text_params=0,
                                            tiny_text="umt5")),
}
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)  # Wan2.1's flow shift at 480p


def _pipeline():
    from diffusers import WanPipeline
    return WanPipeline


class Wan21Glue(ModelGlue):
    title = "Wan2.1 (diffusers)"
    transformer_class = "WanTransformer3DModel"
    pipeline_class = "WanPipeline"
    scheduler_config = SCHEDULER
    vae_class = "AutoencoderKLWan"
    vae_channels, vae_params = 16, 126.9e6
    models = WAN21_MODELS
    run_keys = ("in_channels", "out_channels")  # both from the latent channels
    parallel_plan = diffusers_plan(split=("video tokens", "their RoPE tables"))
    outside_patch = 1  # the model patches its latents itself
    fps = 16
    lora_targets = r"blocks\.\d+\.(attn[12]\.(to_[qkv]|to_out\.0)|ffn\.net\.(0\.proj|2))"
    recipe = "the flow its pipeline samples: x_t = (1 - t) x + t noise, model time 1000 t, target noise - x, plain MSE"

    def __call__(self, **config):
        model = super().__call__(**{**config, "out_channels": config["in_channels"]})
        rope = model.rope  # its frequency tables are non-persistent buffers: built on the meta device (a model a file
        if rope.freqs_cos.is_meta:  # fills), nothing would fill them; they are computed on the host
            with torch.device("cpu"):
                model.rope = type(rope)(rope.attention_head_dim, rope.patch_size, rope.max_seq_len)
        return model

    def patch_of(self, model: str) -> int:
        return self.models[model].arch["patch_size"][-1]  # Wan-debug patches 4x4, the releases 2x2

    def text_encoder(self, path, device, dtype, model) -> TextEncoder:
        encoder = load_text_encoder(path, device, dtype, self.models[model].constants["max_sequence_length"])
        if "T5" not in type(encoder.model).__name__:
            raise ValueError(f"--text_encoder {path}: a {type(encoder.model).__name__}, not the UMT5 encoder Wan2.1 "
                             f"reads (a Wan pipeline folder, or for {model}: python -m opendit.families.wan.tiny_umt5 "
                             f"DIR)")
        encoder.pipeline = _pipeline()(tokenizer=encoder.tokenizer, text_encoder=encoder.model, vae=None,
                                       scheduler=None)
        return encoder

    def encode_prompts(self, encoder: TextEncoder, captions, device) -> dict:
        """The pipeline's own _get_t5_prompt_embeds: each prompt's tokens, zero-padded."""
        return {"embeds": encoder.pipeline._get_t5_prompt_embeds(list(captions), max_sequence_length=encoder.max_length,
                                                                 device=device, dtype=torch.float32)}

    def random_conditions(self, spec, batch, device) -> dict:
        length, width = spec.constants["max_sequence_length"], spec.arch["text_dim"]
        return {"embeds": torch.randn(batch, length, width, device=device)}

    def vae_geometry(self, vae) -> tuple[int, int]:
        if not hasattr(vae.config, "scale_factor_spatial"):  # the memory planner's stand-in
            return super().vae_geometry(vae)
        return vae.config.scale_factor_spatial, vae.config.z_dim

    def temporal_downsampling(self, vae) -> int:
        return getattr(vae.config, "scale_factor_temporal", 1)

    def to_model_space(self, vae, z):
        """(z - latents_mean) / latents_std per channel: the inverse of the pipeline's decoding."""
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
        return (z - mean) / std

    def forward_kwargs(self, model, x, t, cond, cfg) -> dict:
        return dict(hidden_states=x, timestep=t * 1000, encoder_hidden_states=cond["embeds"], return_dict=False)

    def from_output(self, out, shape):
        return out

    def forward_macs(self, model, txt_tokens, img_tokens) -> int:
        """Cross-attention keys / values and the text embedder cost txt_tokens * in * out, the time embedding and
        modulations one row, the rest img_tokens; each block's self-attention 2 * L^2 * inner, its cross-attention
        2 * L * txt * inner."""
        def rows_of(name: str) -> int:
            if name.startswith("condition_embedder.text_embedder") or ".attn2.to_k" in name or ".attn2.to_v" in name:
                return txt_tokens
            if name.startswith(("condition_embedder.time", "time_proj")):
                return 1
            return img_tokens
        inner = model.config.num_attention_heads * model.config.attention_head_dim
        attention = 2 * inner * (img_tokens ** 2 + img_tokens * txt_tokens)
        return matmul_macs(model, rows_of) + len(model.blocks) * attention

    def pipeline_call(self, loaded, sample_cfg, cond, negative) -> dict:
        return dict(prompt_embeds=cond["embeds"], negative_prompt_embeds=negative["embeds"],
                    guidance_scale=sample_cfg.cfg_scale,
                    max_sequence_length=self.models[loaded.cfg.model].constants["max_sequence_length"])
