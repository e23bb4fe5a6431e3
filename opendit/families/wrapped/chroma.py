"""Chroma (lodestones' Chroma1-HD: FLUX.1-schnell's architecture with T5 prompts alone, its modulations computed by
a small "distilled guidance" network from the time) through diffusers' ChromaTransformer2DModel and ChromaPipeline.

Prompts are the pipeline's own _get_t5_prompt_embeds: T5's tokens padded to max_sequence_length, and the mask that
keeps the prompt's tokens and its first padding token (Chroma's rule). The mask reaches the transformer as booleans,
as the official trainer (lodestone-rock/flow, train_chroma.py) masks: diffusers' pipeline casts its own mask to the
embeddings' float dtype, which SDPA adds to the logits instead of masking (diffusers issues #12116, #13619); opendit
hands the pipeline the boolean mask, so sampling masks as training did. Images go through FLUX.1's AutoencoderKL,
(z - shift) * scale, patched 2x2 and packed into tokens with FLUX.1's position ids. Training follows the official
trainer and diffusers' FLUX examples: x_t = (1 - t) x + t noise, the model sees t and predicts noise - x, plain MSE;
no guidance embedding (Chroma samples with true classifier-free guidance: --cfg_scale, 1 off).
"""
import torch

from opendit.families.wrapped.declared import Declared, Feed, Size, Streams
from opendit.families.wrapped.flux1 import SCHEDULER, to_model
from opendit.families.wrapped.glue import pack

CHROMA1_HD = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56),
                  approximator_num_channels=64, approximator_hidden_dim=5120, approximator_layers=5)
# 64 wide, 2 + 2 blocks, a one-layer approximator; a tiny T5 (32 wide) conditions it
CHROMA_DEBUG = dict(CHROMA1_HD, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4,
                    joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_num_channels=16,
                    approximator_hidden_dim=64, approximator_layers=1)


def encode(text, captions, device) -> dict:
    """The pipeline's own T5 encoding and Chroma's mask (the prompt and its first padding token)."""
    embeds, mask = text.pipeline._get_t5_prompt_embeds(captions, max_sequence_length=text.max_length, device=device)
    return {"embeds": embeds.float(), "mask": mask.bool()}


def _ids(b: int, h: int, w: int, length: int, x):
    from diffusers import FluxPipeline
    return (FluxPipeline._prepare_latent_image_ids(b, h, w, x.device, x.dtype),
            torch.zeros(length, 3, device=x.device, dtype=x.dtype))


def forward(model, x, t, cond) -> dict:
    b, _, h, w = x.shape
    img_ids, txt_ids = _ids(b, h, w, cond["embeds"].shape[1], x)
    mask = torch.cat([cond["mask"], torch.ones(b, h * w, dtype=torch.bool, device=x.device)], dim=1)
    return dict(hidden_states=pack(x), encoder_hidden_states=cond["embeds"], timestep=t, img_ids=img_ids,
                txt_ids=txt_ids, attention_mask=mask, return_dict=False)


def call(constants, sample_cfg, cond, negative) -> dict:
    return dict(prompt_embeds=cond["embeds"], prompt_attention_mask=cond["mask"],
                negative_prompt_embeds=negative["embeds"], negative_prompt_attention_mask=negative["mask"],
                guidance_scale=sample_cfg.cfg_scale, max_sequence_length=constants["max_sequence_length"])


def _repair_mod_proj(model):
    """The time embedding's table of modulation indices is a non-persistent buffer computed at construction: built on
    the meta device (a model a file fills), nothing would fill it; it is computed on the host (it has no weights)."""
    embed = model.time_text_embed
    if embed.mod_proj.is_meta:
        out_dim, channels = embed.mod_proj.shape
        with torch.device("cpu"):
            model.time_text_embed = type(embed)(num_channels=channels // 2, out_dim=out_dim)
    return model


# sampling defaults: the pipeline's (35 steps, guidance_scale 5); text_params: T5-XXL's encoder
MODEL = Declared(
    family="chroma", title="Chroma", transformer="ChromaTransformer2DModel", pipeline="ChromaPipeline",
    models={"chroma1-hd": Size(CHROMA1_HD, dict(max_sequence_length=512, steps=35, cfg_scale=5.0, text_params=4.76e9)),
            "chroma-debug": Size(CHROMA_DEBUG, dict(max_sequence_length=16, steps=20, cfg_scale=5.0, text_params=0,
                                                    tiny_text="t5"))},
    feed=Feed(encode, to_model, forward, call), repair=_repair_mod_proj,
    text={"text_encoder": "text_encoder", "tokenizer": "tokenizer"},
    conditions={"embeds": ("L", "joint_attention_dim"), "mask": ("L",)},
    scheduler=SCHEDULER, vae_size=(16, 83_819_683),  # FLUX.1's autoencoder and schedule
    # FLUX.1's Linears (diffusers' names), as ai-toolkit and SimpleTuner target them
    lora_targets=(r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out)|"
                  r"ff(_context)?\.net\.(0\.proj|2))|single_transformer_blocks\.\d+\.(attn\.to_[qkv]|proj_mlp|"
                  r"proj_out)"),
    # lodestones' single files: FLUX.1's block names with Chroma's approximator (diffusers' names neither)
    official_key=("double_blocks.0.img_attn.qkv.weight", "distilled_guidance_layer.in_proj.bias"),
    official_converter="convert_chroma_transformer_checkpoint_to_diffusers",
    recipe=("Chroma's official trainer (lodestone-rock/flow): x_t = (1 - t) x + t noise, target noise - x, plain MSE, "
            "T5 padding masked but for its first token"),
    # the approximator runs once per modulation index of a sample; attention spans both streams
    streams=Streams(rows={r"^distilled_guidance_layer": lambda model: len(model.time_text_embed.mod_proj)},
                    one=r"^(time_text_embed|norm_out)|\.norm",
                    joint=r"^single_transformer_blocks", text=r"^context_embedder|\.add_|to_add_out|ff_context",
                    attention={"transformer_blocks": "joint", "single_transformer_blocks": "joint"}),
)
