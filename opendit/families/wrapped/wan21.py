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
from opendit.families.wrapped.declared import Declared, Feed, Size, Streams

WAN21_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                  out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", eps=1e-6)
# the native Wan-debug's architecture (128 wide, 4 blocks, 4x4 patches) for a tiny UMT5 32 wide
WAN_DEBUG = dict(WAN21_1_3B, patch_size=(1, 4, 4), num_attention_heads=4, attention_head_dim=32, text_dim=32,
                 freq_dim=64, ffn_dim=512, num_layers=4)
MODELS = {
    "wan2.1-t2v-1.3b-diffusers": Size(WAN21_1_3B, dict(max_sequence_length=512, steps=50, cfg_scale=5.0,
                                                       text_params=5.68e9)),  # UMT5-XXL's encoder
    "wan-debug-diffusers": Size(WAN_DEBUG, dict(max_sequence_length=16, steps=20, cfg_scale=3.0, text_params=0,
                                                tiny_text="umt5")),
}
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)  # Wan2.1's flow shift at 480p


def encode(text, captions, device) -> dict:
    """The pipeline's own _get_t5_prompt_embeds: each prompt's tokens, zero-padded."""
    return {"embeds": text.pipeline._get_t5_prompt_embeds(captions, max_sequence_length=text.max_length,
                                                          device=device, dtype=torch.float32)}


def to_model(vae, z):
    """(z - latents_mean) / latents_std per channel: the inverse of the pipeline's decoding."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
    return (z - mean) / std


def forward(model, x, t, cond) -> dict:
    return dict(hidden_states=x, timestep=t * 1000, encoder_hidden_states=cond["embeds"], return_dict=False)


def call(constants, sample_cfg, cond, negative) -> dict:
    return dict(prompt_embeds=cond["embeds"], negative_prompt_embeds=negative["embeds"],
                guidance_scale=sample_cfg.cfg_scale, max_sequence_length=constants["max_sequence_length"])


def repair_rope(model):
    """Its RoPE frequency tables are non-persistent buffers: built on the meta device (a model a file fills), nothing
    would fill them; they are computed on the host."""
    rope = model.rope
    if rope.freqs_cos.is_meta:
        with torch.device("cpu"):
            model.rope = type(rope)(rope.attention_head_dim, rope.patch_size, rope.max_seq_len)
    return model


def _cross_attention_macs(model, txt_tokens: int, img_tokens: int) -> int:
    """One block's cross-attention products: the video tokens over the prompt's, 2 N L x its width."""
    return 2 * img_tokens * txt_tokens * model.config.num_attention_heads * model.config.attention_head_dim


MODEL = Declared(
    family="wan21", title="Wan2.1 (diffusers)", transformer="WanTransformer3DModel", pipeline="WanPipeline", fps=16,
    models=MODELS, feed=Feed(encode, to_model, forward, call, output=lambda out, shape: out),  # the velocity grid
    text={"text_encoder": "text_encoder", "tokenizer": "tokenizer"},
    text_model=lambda name: ("T5", "UMT5 encoder Wan2.1 reads"),
    conditions={"embeds": ("L", "text_dim")},
    scheduler=SCHEDULER, vae="AutoencoderKLWan", vae_kind="factors", vae_size=(16, 126.9e6), vae_temporal=4,
    patch=lambda arch: arch["patch_size"][-1],  # Wan-debug patches 4x4, the releases 2x2
    outside_patch=1, packed_latents=False,  # the model patches its latents itself
    derived={"out_channels": lambda arch: arch["in_channels"]}, repair=repair_rope,
    parallel_plan=diffusers_plan(split=("video tokens", "their RoPE tables")),
    lora_targets=r"blocks\.\d+\.(attn[12]\.(to_[qkv]|to_out\.0)|ffn\.net\.(0\.proj|2))",
    recipe="the flow its pipeline samples: x_t = (1 - t) x + t noise, model time 1000 t, target noise - x, plain MSE",
    # the cross-attention's keys and values and the text embedder run on the prompt's tokens, the time embedding and
    # modulations once per sample, the rest on the video's; each block's self-attention spans the video, its
    # cross-attention the video over the prompt
    streams=Streams(one=r"^(condition_embedder\.time|time_proj)", text=r"^condition_embedder\.text_embedder|"
                    r"\.attn2\.to_[kv]", attention={"blocks": "image", "blocks.attn2": _cross_attention_macs}),
)
