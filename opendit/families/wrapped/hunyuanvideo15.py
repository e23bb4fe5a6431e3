"""HunyuanVideo-1.5 (text-to-video) through diffusers' own HunyuanVideo15Transformer3DModel and HunyuanVideo15Pipeline.

Its prompt conditions are the pipeline's own encode_prompt: each prompt in the pipeline's video-description system
template through Qwen2.5-VL's text model (hidden states three layers from the top, the template's tokens cropped,
padded with a mask), and the quoted text of the prompt ("...") through ByT5 (zeros with an empty mask when there is
none). The model also takes 729 SigLIP image tokens, which text-to-video zeroes (and masks), as the pipeline does.
Clips go through its autoencoder (16x down, 4x in time after the first frame, 32 channels), scaled by its
scaling_factor; the model's input is [latents, conditioning latents (zeros for text-to-video), mask (zeros)], 65
channels, and it predicts noise - x from time t * 1000 (the pipeline passes sigma * 1000).

Sequence parallelism (diffusers' class has no context-parallel plan; opendit gives it one): each rank keeps a slice of
the video tokens with their RoPE tables and a slice of the joint text sequence (729 image tokens, ByT5's, Qwen's)
with its mask; the Qwen tokens are padded with masked zeros up to a length the group divides, and the blocks'
attention masks keys only (`_key_masked_attention`), which Ulysses gathers. The video outputs equal the unsplit
model's: padded and masked text tokens reach no video token, and masking whole rows of them only changed outputs
that are never read.

Training: the flow the pipeline samples (x_t = (1 - t) x + t noise, target noise - x, plain MSE), text-to-video
only (the image-to-video pipeline's first-frame conditioning is not trained here). Sampling: the pipeline with its
classifier-free guider (--cfg_scale is its guidance_scale; 1: off).

    python -m opendit.families.wrapped.tiny_text hunyuanvideo1.5-debug outputs/tiny_hv15   # its tiny text encoders
"""
import types

import torch
import torch.nn.functional as F

from opendit.distributed import unwrap_model
from opendit.families.wrapped.context_parallel import diffusers_plan, masked_padding
from opendit.families.wrapped.declared import Declared, Feed, Size, Streams
from opendit.families.wrapped.glue import PixelSpace

HV15_480P_T2V = dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=54,
                     num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm",
                     text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152, rope_theta=256.0,
                     rope_axes_dim=(16, 56, 56), target_size=640, task_type="t2v", use_meanflow=False)
# the CPU-sized model of tests and the demo (64 wide, 2 blocks, 1 refiner block); tiny Qwen2.5-VL and T5 (16 wide)
HV15_DEBUG = dict(HV15_480P_T2V, num_attention_heads=4, attention_head_dim=16, num_layers=2, num_refiner_layers=1,
                  text_embed_dim=16, text_embed_2_dim=16, image_embed_dim=16, rope_axes_dim=(4, 6, 6), target_size=64)
# max_sequence_length: Qwen2.5-VL tokens kept per prompt; template_tokens: the system template's tokens the pipeline
# crops (108 with Qwen's tokenizer; 95 with the tiny word-level one); sampling defaults: the pipeline's (50 steps,
# guidance 6); text_params: Qwen2.5-VL-7B's and ByT5-small's
MODELS = {
    "hunyuanvideo1.5-t2v": Size(HV15_480P_T2V, dict(max_sequence_length=1000, template_tokens=108, steps=50,
                                                    cfg_scale=6.0, text_params=8.29e9 + 0.22e9)),
    "hunyuanvideo1.5-debug": Size(HV15_DEBUG, dict(max_sequence_length=16, template_tokens=95, steps=20, cfg_scale=6.0,
                                                   text_params=0, tiny_text="hunyuanvideo1.5")),
}
SCHEDULER = dict(num_train_timesteps=1000, shift=5.0)  # the 480p release's flow shift
GLYPH_TOKENS, IMAGE_TOKENS = 256, 729  # the pipeline's ByT5 length and SigLIP token count


def _context_parallel_plan() -> dict:
    from diffusers.models._modeling_parallel import ContextParallelInput as Split
    from diffusers.models._modeling_parallel import ContextParallelOutput as Gather
    return {"rope": {0: Split(split_dim=0, expected_dims=2, split_output=True),
                     1: Split(split_dim=0, expected_dims=2, split_output=True)},
            "transformer_blocks.0": {"hidden_states": Split(split_dim=1, expected_dims=3),
                                     "encoder_hidden_states": Split(split_dim=1, expected_dims=3)},
            "transformer_blocks.*": {"attention_mask": Split(split_dim=1, expected_dims=2)},
            "proj_out": Gather(gather_dim=1, expected_dims=3)}


def _prepare_split(model, size: int) -> None:
    """The blocks attend with key masks (_key_masked_attention); the Qwen tokens are padded so that the joint text
    sequence splits evenly over `size` ranks."""
    for block in model.transformer_blocks:
        processor = _key_masked_attention()
        processor._parallel_config = model._parallel_config
        block.attn.set_processor(processor)

    def glyph_and_image_tokens(kwargs) -> int:
        return kwargs["encoder_hidden_states_2"].shape[1] + kwargs["image_embeds"].shape[1]
    model.register_forward_pre_hook(masked_padding(size, "encoder_hidden_states", "encoder_attention_mask",
                                                   glyph_and_image_tokens), with_kwargs=True)


def _key_masked_attention():
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    class KeyMaskedAttention(HunyuanVideo15AttnProcessor2_0):
        """diffusers' joint attention of a HunyuanVideo-1.5 block with the text mask applied to keys only ([B, 1, 1,
        L], which Ulysses all-gathers beside the keys), where diffusers' also masks the padded text tokens' own rows
        ([B, 1, L, L], which a split query sequence cannot take)."""

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                     image_rotary_emb=None):
            def heads(x):
                return x.unflatten(2, (attn.heads, -1))
            query, key = attn.norm_q(heads(attn.to_q(hidden_states))), attn.norm_k(heads(attn.to_k(hidden_states)))
            query, key = (apply_rotary_emb(x, image_rotary_emb, sequence_dim=1) for x in (query, key))
            text_query = attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states)))
            text_key = attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states)))
            query, key = torch.cat([query, text_query], dim=1), torch.cat([key, text_key], dim=1)
            value = torch.cat([heads(attn.to_v(hidden_states)), heads(attn.add_v_proj(encoder_hidden_states))], dim=1)
            video = hidden_states.shape[1]
            mask = F.pad(attention_mask.bool(), (video, 0), value=True)[:, None, None, :]
            out = dispatch_attention_fn(query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False,
                                        backend=self._attention_backend, parallel_config=self._parallel_config)
            out = out.flatten(2, 3).to(query.dtype)
            return attn.to_out[1](attn.to_out[0](out[:, :video])), attn.to_add_out(out[:, video:])
    return KeyMaskedAttention()


def text_pipeline(pipeline_class, parts: dict, constants):
    """The pipeline holding both encoders, whose encode_prompt runs them: a stand-in autoencoder (its constructor
    reads one's channels), the prompt length and the template's tokens it crops set as the model's."""
    pipe = pipeline_class(**parts, transformer=None, vae=PixelSpace(1), scheduler=None, guider=None)
    pipe.tokenizer_max_length = constants["max_sequence_length"]
    pipe.prompt_template_encode_start_idx = constants["template_tokens"]
    return pipe


def encode(text, captions, device) -> dict:
    """The pipeline's own encode_prompt: both encoders' embeddings with their masks."""
    embeds, mask, glyphs, glyph_mask = text.pipeline.encode_prompt(captions, device=device, dtype=torch.float32,
                                                                   batch_size=len(captions))
    return {"embeds": embeds, "mask": mask.bool(), "embeds_2": glyphs, "mask_2": glyph_mask.bool()}


def to_model(vae, z):
    return z * vae.config.scaling_factor  # the pipeline decodes latents / scaling_factor


def forward(model, x, t, cond) -> dict:
    """Text-to-video: zero conditioning latents and mask beside x, zero (masked) image tokens."""
    b, _, frames, h, w = x.shape
    width = unwrap_model(model).config.image_embed_dim  # model: as boosted (DDP wraps it)
    image = torch.zeros(b, IMAGE_TOKENS, width, device=x.device, dtype=x.dtype)
    return dict(hidden_states=torch.cat([x, torch.zeros_like(x), x.new_zeros(b, 1, frames, h, w)], dim=1),
                timestep=t * 1000, encoder_hidden_states=cond["embeds"], encoder_attention_mask=cond["mask"],
                encoder_hidden_states_2=cond["embeds_2"], encoder_attention_mask_2=cond["mask_2"],
                image_embeds=image, return_dict=False)


def call(constants, sample_cfg, cond, negative) -> dict:
    return dict(prompt_embeds=cond["embeds"], prompt_embeds_mask=cond["mask"], prompt_embeds_2=cond["embeds_2"],
                prompt_embeds_mask_2=cond["mask_2"], negative_prompt_embeds=negative["embeds"],
                negative_prompt_embeds_mask=negative["mask"], negative_prompt_embeds_2=negative["embeds_2"],
                negative_prompt_embeds_mask_2=negative["mask_2"])


def guider(sample_cfg) -> dict:
    """The pipeline's classifier-free guider at --cfg_scale (1: off, as opendit's)."""
    from diffusers import ClassifierFreeGuidance
    return dict(guider=ClassifierFreeGuidance(guidance_scale=sample_cfg.cfg_scale))


def one_clip_at_a_time(vae):
    """diffusers 0.42's HunyuanVideo-1.5 autoencoder builds its causal attention mask as [B, L, L], which
    scaled_dot_product_attention broadcasts over the heads, not the batch: two clips in one call fail. Each clip alone
    is what it computes; its encode (the posterior of a batch) and decode (the pipeline's) go through this."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
    from diffusers.models.modeling_outputs import AutoencoderKLOutput
    encode, decode = vae.encode, vae.decode

    def encode_each(x, return_dict: bool = True):
        found = DiagonalGaussianDistribution(torch.cat([encode(clip[None]).latent_dist.parameters for clip in x]))
        return (found,) if not return_dict else AutoencoderKLOutput(latent_dist=found)

    def decode_each(z, return_dict: bool = True):
        out = torch.cat([decode(clip[None], return_dict=False)[0] for clip in z])
        return (out,) if not return_dict else types.SimpleNamespace(sample=out)
    vae.encode, vae.decode = encode_each, decode_each
    return vae


# the time embedding and modulations run once per sample, ByT5's projection on its GLYPH_TOKENS, the image
# projection on IMAGE_TOKENS, the token refiner on the prompt's tokens, a block's text-stream Linears (add_*_proj,
# to_add_out, ff_context) on the joint text sequence (the prompt's, ByT5's and the image tokens), the rest on the
# video's; each block's joint attention spans the text sequence and the video, the refiner's the prompt
STREAMS = Streams(rows={r"^context_embedder_2": lambda model: GLYPH_TOKENS,
                        r"^image_embedder": lambda model: IMAGE_TOKENS},
                  one=r"norm1|^(time_embed|norm_out)", text=r"\.add_|to_add_out|ff_context",
                  prompt=r"^context_embedder",
                  attention={"transformer_blocks": "joint", "context_embedder.token_refiner.refiner_blocks": "prompt"},
                  added=lambda model: GLYPH_TOKENS + IMAGE_TOKENS)

MODEL = Declared(
    family="hunyuanvideo15", title="HunyuanVideo-1.5", transformer="HunyuanVideo15Transformer3DModel",
    pipeline="HunyuanVideo15Pipeline", fps=24, models=MODELS,
    feed=Feed(encode, to_model, forward, call, output=lambda out, shape: out),  # its output: the velocity grid
    # Qwen2.5-VL's text model and ByT5 of a pipeline folder
    text={"text_encoder": "text_encoder", "tokenizer": "tokenizer", "text_encoder_2": "text_encoder_2",
          "tokenizer_2": "tokenizer_2"}, text_pipeline=text_pipeline,
    conditions={"embeds": ("L", "text_embed_dim"), "mask": ("L",), "embeds_2": (GLYPH_TOKENS, "text_embed_2_dim"),
                "mask_2": (GLYPH_TOKENS,)},
    scheduler=SCHEDULER, vae="AutoencoderKLHunyuanVideo15", vae_kind="stated", vae_repair=one_clip_at_a_time,
    vae_size=(32, 0.25e9), vae_downsampling=16, vae_temporal=4,  # parameters: about
    patch=1, outside_patch=1, packed_latents=False, sampling_components=guider,
    # the model takes [latents, conditioning latents, mask]: 2c + 1 channels in, c out
    derived={"in_channels": lambda arch: 2 * arch["in_channels"] + 1, "out_channels": lambda arch: arch["in_channels"]},
    # the last block's text-stream outputs: its text tokens are dropped before the output layer
    unused=("transformer_blocks", ("attn.to_add_out", "ff_context")),
    # attention of both streams and the video MLP; not the text stream's outputs (to_add_out, ff_context), which the
    # last block computes for nothing (its text tokens are dropped): adapters there would never get a gradient
    lora_targets=r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj)|ff\.net\.(0\.proj|2))",
    recipe="the flow its pipeline samples: x_t = (1 - t) x + t noise, model time 1000 t, target noise - x, plain MSE",
    parallel_plan=diffusers_plan(split=("video tokens", "their RoPE tables", "the joint text sequence and its mask "
                                        "(Qwen tokens padded to a multiple of the group)"),
                                 cp_plan=_context_parallel_plan, checked=("hidden_states",), prepare=_prepare_split),
    streams=STREAMS,
)


def save_tiny_text_encoders(folder, words="moving_digits", hidden_size: int = 16, seed: int = 0) -> str:
    """A pipeline folder's text encoders for hunyuanvideo1.5-debug: a tiny random Qwen2.5-VL text model (hidden_size
    wide, 3 layers: the pipeline takes the first layer's states) with a word-level chat tokenizer over `words`
    (text_encoder/, tokenizer/), and a tiny random T5 encoder with ByT5's byte tokenizer (text_encoder_2/,
    tokenizer_2/)."""
    from pathlib import Path

    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    from opendit.encoders.word_tokenizer import chat_word_tokenizer

    root = Path(folder)
    tokenizer = chat_word_tokenizer(words, 128)
    torch.manual_seed(seed)
    Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, pad_token_id=tokenizer.pad_token_id,
    )).save_pretrained(root / "text_encoder")
    tokenizer.save_pretrained(root / "tokenizer")
    byte_tokenizer = ByT5Tokenizer()
    T5EncoderModel(T5Config(vocab_size=len(byte_tokenizer), d_model=hidden_size, d_kv=8, d_ff=2 * hidden_size,
                            num_layers=1, num_heads=2)).save_pretrained(root / "text_encoder_2")
    byte_tokenizer.save_pretrained(root / "tokenizer_2")
    return str(root)
