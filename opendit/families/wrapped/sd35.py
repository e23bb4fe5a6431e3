"""Stable Diffusion 3.5 (Stability AI's MMDiT: Large; Medium, the MMDiT-X variant; transformers of 8.06B and 2.24B
parameters) through diffusers' own SD3Transformer2DModel and StableDiffusion3Pipeline.

Prompts are the pipeline's own encode_prompt: CLIP-L's and CLIP-G's penultimate hidden states (77 tokens each, side by
side in channels: 768 + 1280), zero-padded to T5-XXL's 4,096 channels and followed by T5's tokens, [B, 77 + T5 length,
4096]; and the two CLIPs' projected pooled embeddings side by side, [B, 2048]. The model takes no mask (padding tokens
attend, as in the release), so there is none. The constant max_sequence_length is the whole joint length, 77 + the T5
length (the recipe's --max_sequence_length 77: 154; the pipeline's own default T5 length is 256). Images go through
SD3's 16-channel AutoencoderKL, (z - shift_factor) * scaling_factor; the model patches 2x2 itself (a cropped sin-cos
table up to pos_embed_max_size patches a side) and gives back the latent grid. That table is a persistent buffer,
which opendit's EMA (parameters only) would not keep: it is made a frozen parameter of the same name. The last
block's text queries (add_q_proj, norm_added_q) feed only the text outputs it drops: they are frozen.

Training follows diffusers' SD3 DreamBooth LoRA example (examples/dreambooth/train_dreambooth_lora_sd3.py): x_t =
(1 - sigma) x + sigma noise, the model sees timestep 1000 sigma (the pipeline passes the scheduler's timesteps, 1000
sigma) and, with --precondition_outputs 0, is trained to predict noise - x, plain MSE. (The script's default,
--precondition_outputs 1, compares x_t - sigma * prediction with x: the same loss weighted by sigma^2. It indexes its
sigmas from the shift-3 schedule; opendit draws t by --timestep_sampling, unshifted.) Sampling: the pipeline's
classifier-free guidance, one model call on [uncond; cond] per step; --cfg_scale is its guidance_scale (it guides
above 1: opendit's convention, 1 off). Skip-layer guidance (Medium's card suggests layers 7-9) is not used.

Sizes: sd3.5-large and sd3.5-medium are the published transformer/config.json values as recalled, checked against
diffusers' scripts/convert_sd3_to_diffusers.py (pos_embed_max_size 192 for Large, 384 for Medium; Medium's second,
image-only attention in blocks 0-12; QK RMSNorm in both). Least sure: sample_size 128 (it only sets the sin-cos
table's base grid). sd3.5-debug is Medium's shape at CPU size (64 wide, 2 blocks, the first with the second
attention), conditioned by tiny CLIP-L (16 wide), CLIP-G (32) and T5 (64) encoders.

Sequence parallelism: none. diffusers' SD3Transformer2DModel declares no context-parallel plan (_cp_plan), and opendit
has not written one: the model takes no key mask, so a plan could split its joint prompt (77 CLIP tokens, then T5's)
only over groups that divide its length.
"""
import torch.nn as nn

from opendit.families.wrapped.declared import Declared, Feed, Size, Streams

SD35_LARGE = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38,
                  attention_head_dim=64, num_attention_heads=38, joint_attention_dim=4096,
                  caption_projection_dim=2432, pooled_projection_dim=2048, pos_embed_max_size=192,
                  dual_attention_layers=(), qk_norm="rms_norm")
SD35_MEDIUM = dict(SD35_LARGE, num_layers=24, num_attention_heads=24, caption_projection_dim=1536,
                   pos_embed_max_size=384, dual_attention_layers=tuple(range(13)))
# Medium's shape, 64 wide, 2 blocks (the first with the second attention); the tiny encoders' widths: CLIP-L 16 +
# CLIP-G 32 = the pooled 48, T5 64
SD35_DEBUG = dict(SD35_MEDIUM, num_layers=2, attention_head_dim=16, num_attention_heads=4, joint_attention_dim=64,
                  caption_projection_dim=64, pooled_projection_dim=48, pos_embed_max_size=32,
                  dual_attention_layers=(0,))
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)  # SD3.5's scheduler_config
# the text encoders' parameters: T5-XXL's encoder, CLIP-G and CLIP-L with their projections
TEXT_PARAMS = 4.76e9 + 0.69e9 + 0.12e9


def encode(text, captions, device) -> dict:
    """The pipeline's own encode_prompt: the joint CLIP + T5 tokens and the pooled CLIP embeddings. T5 gets what the
    joint length leaves after CLIP's (the CLIP tokenizer's model_max_length, 77)."""
    t5_length = text.max_length - text.pipeline.tokenizer_max_length
    embeds, _, pooled, _ = text.pipeline.encode_prompt(captions, None, None, device=device,
                                                       do_classifier_free_guidance=False,
                                                       max_sequence_length=t5_length)
    return {"embeds": embeds.float(), "pooled": pooled.float()}


def to_model(vae, z):
    """(z - shift) * scale, the inverse of the pipeline's decoding (SD3's autoencoder has a shift)."""
    if vae.config.shift_factor is None:
        raise ValueError("--vae: not SD3's autoencoder (a 16-channel AutoencoderKL with a shift_factor); pass the "
                         "release's vae/ folder")
    return (z - vae.config.shift_factor) * vae.config.scaling_factor


def forward(model, x, t, cond) -> dict:
    return dict(hidden_states=x, timestep=1000 * t, encoder_hidden_states=cond["embeds"],
                pooled_projections=cond["pooled"], return_dict=False)


def output(out, shape):
    return out  # the latent grid already


def call(constants, sample_cfg, cond, negative) -> dict:
    return dict(prompt_embeds=cond["embeds"], pooled_prompt_embeds=cond["pooled"],
                negative_prompt_embeds=negative["embeds"], negative_pooled_prompt_embeds=negative["pooled"],
                guidance_scale=sample_cfg.cfg_scale)


def _pos_embed_as_parameter(model):
    """The sin-cos position table is a persistent buffer, in diffusers' files but not in opendit's EMA (parameters
    only), so a checkpoint's EMA would lack it: it becomes a frozen parameter of the same name (as DiT's table is)."""
    embed = model.pos_embed
    if not isinstance(embed.pos_embed, nn.Parameter):
        embed.pos_embed = nn.Parameter(embed.pos_embed, requires_grad=False)
    return model


# sampling defaults: the model cards' (Large 28 steps at 3.5, Medium 40 at 4.5)
MODEL = Declared(
    family="sd35", title="Stable Diffusion 3.5", transformer="SD3Transformer2DModel",
    pipeline="StableDiffusion3Pipeline",
    models={"sd3.5-large": Size(SD35_LARGE, dict(max_sequence_length=77 + 77, steps=28, cfg_scale=3.5,
                                                 text_params=TEXT_PARAMS)),
            "sd3.5-medium": Size(SD35_MEDIUM, dict(max_sequence_length=77 + 77, steps=40, cfg_scale=4.5,
                                                   text_params=TEXT_PARAMS)),
            "sd3.5-debug": Size(SD35_DEBUG, dict(max_sequence_length=77 + 16, steps=20, cfg_scale=4.5, text_params=0,
                                                 tiny_text="clip+clip+t5"))},
    feed=Feed(encode, to_model, forward, call, output),
    text={"text_encoder": "text_encoder", "tokenizer": "tokenizer", "text_encoder_2": "text_encoder_2",
          "tokenizer_2": "tokenizer_2", "text_encoder_3": "text_encoder_3", "tokenizer_3": "tokenizer_3"},
    conditions={"embeds": ("L", "joint_attention_dim"), "pooled": ("pooled_projection_dim",)},
    scheduler=SCHEDULER, vae_size=(16, 83_819_683),  # SD3's autoencoder: FLUX.1's shape
    outside_patch=1, packed_latents=False,  # the model patches its latent grid itself
    derived={"out_channels": lambda arch: arch["in_channels"]}, repair=_pos_embed_as_parameter,
    cfg_calls="batched",  # StableDiffusion3Pipeline calls the model once on [uncond; cond]
    # the last block's text queries: they feed only the text outputs that block drops (context_pre_only), so their
    # gradient is zero
    unused=("transformer_blocks", ("attn.add_q_proj", "attn.norm_added_q")),
    # the diffusers example's default targets (the attention Linears of both streams), plus Medium's second
    # attention and both streams' MLPs: every Linear of a block but its modulations
    lora_targets=(r"transformer_blocks\.\d+\.(attn2?\.(to_[qkv]|to_out\.0)|attn\.(add_[qkv]_proj|to_add_out)|"
                  r"ff(_context)?\.net\.(0\.proj|2))"),
    # Stability AI's single files: MMDiT's fused qkv in both streams of its joint blocks
    official_key=("joint_blocks.0.x_block.attn.qkv.weight", "joint_blocks.0.context_block.attn.qkv.weight"),
    official_converter="convert_sd3_transformer_checkpoint_to_diffusers",
    recipe=("diffusers' SD3 DreamBooth LoRA example without preconditioning: x_t = (1 - t) x + t noise, model time "
            "1000 t, target noise - x, plain MSE"),
    # joint attention over both streams in every block; Medium's second attention over the image tokens alone
    streams=Streams(one=r"\.norm1|^(time_text_embed|norm_out)", text=r"^context_embedder|\.add_|to_add_out|ff_context",
                    attention={"transformer_blocks": "joint", "transformer_blocks.attn2": "image"}),
)
