"""Kandinsky 5.0 Video Lite (Kandinsky Lab's 2B text-to-video DiT) through diffusers' Kandinsky5Transformer3DModel and
Kandinsky5T2VPipeline. Its image sibling, Kandinsky 5.0 Image Lite (kandinsky5_image.py), shares this file's feed.

Prompts are the pipeline's own encode_prompt: each prompt in the pipeline's video-description system template through
Qwen2.5-VL (its last hidden states, the template's first 128 tokens dropped) and through CLIP ViT-L/14 (its pooled
output over 77 tokens). The Qwen states are padded to max_sequence_length with zeros and a mask (the pipeline's
cu_seqlens, as a mask). diffusers' class takes no text mask (the official DiT does: attention_mask), so the model is
handed a batch's prompts cut to the longest one's length, a shorter prompt followed by zero states that its text blocks
and cross-attention see, as the pipeline itself pads a batch of prompts (there with the pad token's states): one
prompt, or prompts of one length, see no padding, as in the official inference (one prompt at a time).

Clips go through HunyuanVideo's autoencoder (AutoencoderKLHunyuanVideo: 8x down, 4x in time after the first frame, 16
channels), times its scaling_factor (the pipeline divides by it before decoding). The model takes its latents channels
last [B, T, h, w, C] and patches them 1x2x2 itself. The release is also an image-to-video model (visual_cond: the
latents, a conditioning latent and its mask, 33 channels); text-to-video hands it zeros for both, as the pipeline does.
Its 3-D RoPE angles are divided by a resolution-dependent factor, the pipeline's _get_scale_factor of the size in pixels
(2 between 480 and 854 px, else 3.16): training reads it in latent positions x 8 (HunyuanVideo's downsampling), and so
does sampling (identical with that autoencoder; in pixel space, --vae none, the two agree too). Note: diffusers'
attention processor (as the official code) rounds queries and keys to bfloat16 after RoPE, also in float32 runs.

Training: Kandinsky 5's trainer is not public (a LoRA run's config in ai-forever/Kandinsky-5 shows AdamW lr 1e-4,
betas (0.9, 0.95), weight decay 1e-3, 10% empty captions, scheduler_scale 5, RoPE scale (1, 2, 2) at 512 px), so opendit
follows the pipeline's parametrisation: x_t = (1 - t) x + t noise, the model sees time 1000 t (the pipeline passes the
scheduler's sigma * 1000) and predicts noise - x, plain MSE; text-to-video only (that run's first-frame conditioning,
visual_cond_prob 0.2, is not trained). Sampling: the pipeline's Euler steps at the release's flow shift 5 and its
classifier-free guidance (a conditional and an unconditional call a step; --cfg_scale is its guidance_scale, 1 off).
diffusers' pipeline is sampled through a subclass (_sampling_pipeline) that takes opendit's latents [B, C, T, h, w]
(it takes them channels last, with the zero conditioning appended) and, in pixel space, the frame count as it is: its
rounding of num_frames to 1 + 4k adds a frame where the autoencoder keeps every frame.

Sizes: "kandinsky5-t2v-lite" is the 5 s releases' diffusers config (Kandinsky-5.0-T2V-Lite-{pretrain,sft,nocfg,
distilled16steps}-5s-Diffusers share it; from the official configs/config_5s_sft.yaml and the class's arguments:
1792 wide, 2 text and 32 visual blocks of 28 heads of 64, feed-forward 7168), about 2.0B parameters; the nocfg and
distilled checkpoints sample with --cfg_scale 1 (and 16 steps). Unsure: that the diffusers folders spell attention_type
"regular" and the unset attention_* options as the class defaults. The 10 s releases attend through NABLA sparse
attention (attention_type "nabla"), which the training forward does not compute: their folders name no registered model.
max_sequence_length 256 is the official video configs' Qwen length (the pipeline's own default is 512).

No sequence parallelism: diffusers' class has no `_cp_plan`, and its cross-attention runs through the same processor as
its self-attention, so diffusers' Ulysses would exchange the whole prompt's keys as if they were split; opendit has not
written a plan of its own (it would split the video tokens with their RoPE table, keep the text blocks whole and gather
the self-attention's keys alone). LoRA targets
the Linears of the official LoRA config (self- and cross-attention's to_query, to_key, to_value and out_layer, the
feed-forward's in_layer and out_layer) in the text and visual blocks. The official single files already use diffusers'
module names (the class was ported name for name): they load as they are, and diffusers has no converter for them.
"""
import torch
import torch.nn.functional as F

from opendit.distributed import unwrap_model
from opendit.families.wrapped.declared import Declared, Feed, Size, Streams

KANDINSKY5_T2V_LITE = dict(in_visual_dim=16, out_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=512,
                           patch_size=(1, 2, 2), model_dim=1792, ff_dim=7168, num_text_blocks=2, num_visual_blocks=32,
                           axes_dims=(16, 24, 24), visual_cond=True, attention_type="regular")
# 64 wide (4 heads of 16), 2 text and 2 visual blocks; a tiny Qwen2.5-VL (16 wide) and CLIP (32 wide) condition it
KANDINSKY5_T2V_DEBUG = dict(KANDINSKY5_T2V_LITE, in_text_dim=16, in_text_dim2=32, time_dim=32, model_dim=64, ff_dim=128,
                            num_visual_blocks=2, axes_dims=(4, 6, 6))
SCHEDULER = dict(num_train_timesteps=1000, shift=5.0)  # the 5 s releases' flow shift (the official scheduler_scale)
RULE_DOWNSAMPLING = 8  # the pixels per latent position the pipeline's resolution rule is stated in (HunyuanVideo's)
# Qwen2.5-VL-7B's and CLIP ViT-L/14's text model
TEXT_PARAMS = 8.29e9 + 0.12e9
# the Linears of the official LoRA config (ai-forever/Kandinsky-5), in the text and the visual blocks
LORA_TARGETS = (r"(text|visual)_transformer_blocks\.\d+\.((self|cross)_attention\.(to_query|to_key|to_value|out_layer)|"
                r"feed_forward\.(in_layer|out_layer))")


def encode(text, captions, device) -> dict:
    """The pipeline's own encode_prompt: Qwen2.5-VL's states padded to max_sequence_length (zeros past each prompt's
    tokens) with their mask, and CLIP's pooled embedding."""
    found, pooled, cu_seqlens = text.pipeline.encode_prompt(captions, max_sequence_length=text.max_length,
                                                            device=device, dtype=torch.float32)
    lengths = cu_seqlens.diff().to(device)
    mask = torch.arange(text.max_length, device=device) < lengths[:, None]
    embeds = torch.zeros(len(found), text.max_length, found.shape[-1], device=device)
    embeds[:, :found.shape[1]] = found[:, :text.max_length]
    return {"embeds": embeds * mask[..., None], "pooled": pooled, "mask": mask}


def to_model(vae, z):
    """z * scaling_factor: the inverse of the pipeline's decoding (no shift, for FLUX.1's autoencoder too)."""
    return z * vae.config.scaling_factor


def channels_last(x: torch.Tensor) -> torch.Tensor:
    """[B, C, T, h, w] (or an image's [B, C, h, w], one frame) -> the model's [B, T, h, w, C], contiguous (its
    patch embedding views it)."""
    x = x.movedim(1, -1)
    return (x if x.ndim == 5 else x[:, None]).contiguous()


def with_visual_condition(model, latents: torch.Tensor) -> torch.Tensor:
    """Channels-last latents with a zero conditioning latent and a zero mask beside them where the model takes them
    (visual_cond), as the pipeline prepares its text-to-video latents."""
    if not model.config.visual_cond:
        return latents
    return torch.cat([latents, torch.zeros_like(latents), latents.new_zeros(*latents.shape[:-1], 1)], dim=-1)


def longest_prompt(cond) -> int:
    """Tokens of the batch's longest prompt: what the model is handed of the padded conditions."""
    return int(cond["mask"].sum(1).max())


def video_rope_scale(height: int, width: int) -> tuple:
    """The pipeline's _get_scale_factor of a latent grid of height x width positions (in its pixels: x 8)."""
    from diffusers import Kandinsky5T2VPipeline
    return Kandinsky5T2VPipeline._get_scale_factor(None, height * RULE_DOWNSAMPLING, width * RULE_DOWNSAMPLING)


def forward_with(rope_scale):
    """The feed's forward for a RoPE scale rule (latent height, width) -> the forward's scale_factor: x [B, C, T, h, w]
    or [B, C, h, w] channels last (with the zero visual condition), the batch's prompts cut to the longest, model time
    1000 t, RoPE positions as the pipeline makes them."""
    def forward(model, x, t, cond) -> dict:
        config = unwrap_model(model).config  # model: as boosted (DDP wraps it)
        latents = channels_last(x)
        _, frames, h, w, _ = latents.shape
        _, patch_h, patch_w = config.patch_size
        n = longest_prompt(cond)
        positions = [torch.arange(frames, device=x.device), torch.arange(h // patch_h, device=x.device),
                     torch.arange(w // patch_w, device=x.device)]
        return dict(hidden_states=with_visual_condition(unwrap_model(model), latents),
                    encoder_hidden_states=cond["embeds"][:, :n], pooled_projections=cond["pooled"],
                    timestep=t * 1000, visual_rope_pos=positions, text_rope_pos=torch.arange(n, device=x.device),
                    scale_factor=rope_scale(h, w), return_dict=False)
    return forward


def output(out, shape):
    """The model's channels-last prediction -> the velocity noise - x of `shape`."""
    return out.movedim(-1, 1).reshape(shape)


def call(constants, sample_cfg, cond, negative) -> dict:
    """The embeddings cut to the batch's longest prompt, with the pipeline's cu_seqlens of the prompts' lengths."""
    def parts(c):
        lengths = c["mask"].sum(1)
        return c["embeds"][:, :longest_prompt(c)], c["pooled"], F.pad(lengths.cumsum(0), (1, 0)).int()
    (embeds, pooled, cu_seqlens), (neg, neg_pooled, neg_cu_seqlens) = parts(cond), parts(negative)
    return dict(prompt_embeds_qwen=embeds, prompt_embeds_clip=pooled, prompt_cu_seqlens=cu_seqlens,
                negative_prompt_embeds_qwen=neg, negative_prompt_embeds_clip=neg_pooled,
                negative_prompt_cu_seqlens=neg_cu_seqlens, guidance_scale=sample_cfg.cfg_scale,
                max_sequence_length=constants["max_sequence_length"])


def repair_tables(model):
    """The RoPE angle tables are non-persistent buffers and the time embedding's frequencies a plain tensor, all
    computed at construction: built on the meta device (a model a file fills), nothing would fill them; they are
    computed on the host (they have no weights)."""
    from diffusers.models.transformers.transformer_kandinsky import get_freqs
    text_rope, video_rope, time = model.text_rope_embeddings, model.visual_rope_embeddings, model.time_embeddings
    if text_rope.args.is_meta:
        with torch.device("cpu"):
            model.text_rope_embeddings = type(text_rope)(text_rope.dim, text_rope.max_pos, text_rope.max_period)
            model.visual_rope_embeddings = type(video_rope)(video_rope.axes_dims, video_rope.max_pos,
                                                            video_rope.max_period)
            time.freqs = get_freqs(time.model_dim // 2, time.max_period)
    return model


def _sampling_pipeline():
    """Kandinsky5T2VPipeline taking opendit's latents [B, C, T, h, w] and frame count (see the module's docstring),
    its resolution rule read in latent positions x 8."""
    from diffusers import Kandinsky5T2VPipeline

    class Kandinsky5T2VSampling(Kandinsky5T2VPipeline):
        def __call__(self, *, latents, num_frames, **kwargs):
            if self.vae_scale_factor_temporal == 1:  # it rounds num_frames to 1 + k, adding one: given one fewer
                num_frames -= 1
            return super().__call__(latents=with_visual_condition(self.transformer, channels_last(latents)),
                                    num_frames=num_frames, **kwargs)

        def _get_scale_factor(self, height, width):
            return video_rope_scale(height // self.vae_scale_factor_spatial, width // self.vae_scale_factor_spatial)
    return Kandinsky5T2VSampling


def _cross_attention_macs(model, txt_tokens: int, img_tokens: int) -> int:
    """One visual block's cross-attention products: the video tokens over the prompt's, 2 N L x its width."""
    return 2 * img_tokens * txt_tokens * model.config.model_dim


# both text encoders in a pipeline folder
TEXT = {"text_encoder": "text_encoder", "tokenizer": "tokenizer", "text_encoder_2": "text_encoder_2",
        "tokenizer_2": "tokenizer_2"}
CONDITIONS = {"embeds": ("L", "in_text_dim"), "pooled": ("in_text_dim2",), "mask": ("L",)}
DERIVED = {"in_visual_dim": lambda arch: arch["in_channels"], "out_visual_dim": lambda arch: arch["in_channels"]}
# the modulations, time and pooled-prompt embeddings run once per sample; the text blocks and the cross-attention's
# keys and values on the prompt's tokens; the visual blocks' self-attention spans the video tokens, their
# cross-attention the video tokens over the prompt's
STREAMS = Streams(one=r"^(time_embeddings|pooled_text_embeddings)|modulation\.",
                  text=r"^(text_embeddings|text_transformer_blocks)|cross_attention\.to_(key|value)",
                  attention={"text_transformer_blocks": "text", "visual_transformer_blocks": "image",
                             "visual_transformer_blocks.cross_attention": _cross_attention_macs},
                  width=("model_dim",))

# sampling defaults: the official sft config's (50 steps, guidance 5)
MODEL = Declared(
    family="kandinsky5", title="Kandinsky 5 (video)", transformer="Kandinsky5Transformer3DModel",
    pipeline="Kandinsky5T2VPipeline", fps=24.0,
    models={"kandinsky5-t2v-lite": Size(KANDINSKY5_T2V_LITE, dict(max_sequence_length=256, steps=50, cfg_scale=5.0,
                                                                  text_params=TEXT_PARAMS)),
            "kandinsky5-t2v-debug": Size(KANDINSKY5_T2V_DEBUG, dict(max_sequence_length=16, steps=20, cfg_scale=5.0,
                                                                    text_params=0, tiny_text="kandinsky5"))},
    feed=Feed(encode, to_model, forward_with(video_rope_scale), call, output),
    text=TEXT, conditions=CONDITIONS, scheduler=SCHEDULER,
    vae="AutoencoderKLHunyuanVideo", vae_size=(16, 246_478_803), vae_temporal=4,
    patch=2, outside_patch=1, packed_latents=False, derived=DERIVED, repair=repair_tables,
    sampling_pipeline=_sampling_pipeline, lora_targets=LORA_TARGETS,
    recipe=("the pipeline's parametrisation (the official trainer is not public): x_t = (1 - t) x + t noise, model "
            "time 1000 t, target noise - x, plain MSE; text-to-video (zero visual condition)"),
    streams=STREAMS,
)
