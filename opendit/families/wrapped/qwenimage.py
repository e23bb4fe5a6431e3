"""Qwen-Image through diffusers' own QwenImageTransformer2DModel and QwenImagePipeline.

Its prompt embedding is the pipeline's: each prompt in Qwen-Image's system template, the last hidden states of
Qwen2.5-VL at the prompt's own tokens (the template's first 34 tokens dropped), padded with a mask. Images go through
its causal 3-D autoencoder (one frame; 16 channels, 8x down), normalised per channel by the VAE's latents_mean and
latents_std, patched 2x2 (64 channels) and packed into tokens; the model's RoPE takes the grid from `img_shapes`.

Training follows diffusers' Qwen-Image DreamBooth LoRA example (train_dreambooth_lora_qwen_image.py): x_t = (1 - t) x +
t noise, the model sees t (the pipeline passes sigma) and predicts noise - x, plain MSE. Sampling
goes through the pipeline's true classifier-free guidance (--cfg_scale is its true_cfg_scale; 1: off), which
rescales the guided prediction to the conditional one's norm.
"""
import torch

from opendit.families.wrapped.context_parallel import diffusers_plan, masked_padding
from opendit.families.wrapped.declared import Declared, Feed, Size, Streams
from opendit.families.wrapped.glue import pack, patchify

QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
# the CPU-sized model of tests (64 wide, 2 blocks); a tiny random Qwen2.5-VL (16 wide) conditions it
QWEN_IMAGE_DEBUG = dict(QWEN_IMAGE, num_layers=2, attention_head_dim=16, num_attention_heads=4, joint_attention_dim=16,
                        axes_dims_rope=(4, 6, 6))
# Qwen-Image's scheduler settings: resolution-dependent shift between 0.5 and 0.9 up to 8,192 tokens, stretched to
# end at 0.02
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                 base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")


def _pad_text(model, size: int) -> None:
    """Prompts of any length split evenly: the text tokens padded with masked ones (the pipeline trims its prompts
    to the batch's longest, e.g. 5 tokens)."""
    model.register_forward_pre_hook(masked_padding(size, "encoder_hidden_states", "encoder_hidden_states_mask"),
                                    with_kwargs=True)


def encode(text, captions, device) -> dict:
    """The pipeline's own _get_qwen_prompt_embeds, padded to max_sequence_length, with the mask."""
    found, mask = text.pipeline._get_qwen_prompt_embeds(captions, device, dtype=torch.float32)
    length = text.max_length
    embeds = torch.zeros(len(found), length, found.shape[-1], device=device)
    padded = torch.zeros(len(found), length, dtype=torch.bool, device=device)
    embeds[:, :found.shape[1]], padded[:, :found.shape[1]] = found[:, :length], mask[:, :length].bool()
    return {"embeds": embeds * padded[..., None], "mask": padded}


def to_model(vae, z):
    """(z - latents_mean) / latents_std per channel (the inverse of the pipeline's decoding), then 2x2 patches."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1).to(z)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1).to(z)
    return patchify((z - mean) / std)


def forward(model, x, t, cond) -> dict:
    b, _, h, w = x.shape
    return dict(hidden_states=pack(x), encoder_hidden_states=cond["embeds"], encoder_hidden_states_mask=cond["mask"],
                timestep=t, img_shapes=[[(1, h, w)]] * b, return_dict=False)


def call(constants, sample_cfg, cond, negative) -> dict:
    """The embeddings cut to the longest prompt of the batch, as the pipeline pads them itself."""
    def trimmed(c):
        n = int(c["mask"].sum(1).max())
        return c["embeds"][:, :n], c["mask"][:, :n].long()
    (embeds, mask), (neg, neg_mask) = trimmed(cond), trimmed(negative)
    return dict(prompt_embeds=embeds, prompt_embeds_mask=mask, negative_prompt_embeds=neg,
                negative_prompt_embeds_mask=neg_mask, true_cfg_scale=sample_cfg.cfg_scale,
                max_sequence_length=constants["max_sequence_length"])


def _repair_rope(model):
    """Its RoPE frequency tables are plain tensors, not buffers: built on the meta device (a model a file fills),
    nothing would fill them; they are computed on the host."""
    rope = model.pos_embed
    if rope.pos_freqs.is_meta:
        with torch.device("cpu"):
            model.pos_embed = type(rope)(theta=rope.theta, axes_dim=rope.axes_dim, scale_rope=rope.scale_rope)
    return model


# sampling defaults: the pipeline's (50 steps, true_cfg_scale 4); text_params: Qwen2.5-VL-7B's
MODEL = Declared(
    family="qwenimage", title="Qwen-Image", transformer="QwenImageTransformer2DModel", pipeline="QwenImagePipeline",
    models={"qwen-image": Size(QWEN_IMAGE, dict(max_sequence_length=1024, steps=50, cfg_scale=4.0,
                                                text_params=8.29e9)),
            "qwen-image-debug": Size(QWEN_IMAGE_DEBUG, dict(max_sequence_length=32, steps=20, cfg_scale=4.0,
                                                            text_params=0, tiny_text="qwen2.5-vl"))},
    feed=Feed(encode, to_model, forward, call),
    text={"text_encoder": "text_encoder", "tokenizer": "tokenizer"},
    conditions={"embeds": ("L", "joint_attention_dim"), "mask": ("L",)},
    scheduler=SCHEDULER, vae="AutoencoderKLQwenImage", vae_kind="frame", vae_size=(16, 126.9e6),
    derived={"out_channels": lambda arch: arch["in_channels"] // 4},  # both from the latent channels
    repair=_repair_rope,
    parallel_plan=diffusers_plan(split=("image tokens", "text tokens and their mask (padded with masked ones to a "
                                        "multiple of the group)", "RoPE tables"), prepare=_pad_text),
    # attention of both streams and the image MLP; not the text stream's outputs (to_add_out, txt_mlp), which the
    # last block computes for nothing (its text tokens are dropped): adapters there would never get a gradient
    lora_targets=r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj)|img_mlp\.net\.(0\.proj|2))",
    unused=("transformer_blocks", ("attn.to_add_out", "txt_mlp")),
    recipe="diffusers' Qwen-Image DreamBooth LoRA example: x_t = (1 - t) x + t noise, target noise - x, plain MSE",
    streams=Streams(one=r"_mod\.|^(time_text_embed|norm_out)", text=r"^txt_in|\.add_|to_add_out|txt_mlp",
                    attention={"transformer_blocks": "joint"}),
)


def save_tiny_qwen25vl(folder, words="digits", hidden_size: int = 16, layers: int = 2, seed: int = 0) -> str:
    """Write a tiny random Qwen2_5_VLForConditionalGeneration (hidden_size wide, `layers` deep, a one-block vision
    tower it never uses) and a word-level chat tokenizer over `words` to `folder`: qwen-image-debug's text encoder.
    The tokenizer splits Qwen-Image's system template into 34 tokens, as Qwen's own does (its words unknown to the
    vocabulary are one token each)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from opendit.encoders.word_tokenizer import chat_word_tokenizer

    tokenizer = chat_word_tokenizer(words, 64)
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, pad_token_id=tokenizer.pad_token_id)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden_size,
                  fullatt_block_indexes=[0])
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
