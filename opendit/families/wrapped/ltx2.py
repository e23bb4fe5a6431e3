"""LTX-2 (Lightricks' joint audio-video DiT, 2026: a 48-block video stream 4096 wide beside an audio stream 2048 wide,
bridged in every block by audio-to-video and video-to-audio cross-attention) through diffusers'
LTX2VideoTransformer3DModel and LTX2Pipeline, trained here as a text-to-video model.

Prompts are the pipeline's own encoding: _get_gemma_prompt_embeds (Gemma 3's hidden states of every layer, stacked,
the prompt padded on the left to max_sequence_length) through the pipeline's own text connectors (LTX2TextConnectors,
frozen, as the official trainer keeps its embeddings processor frozen), which give the video stream's and the audio
stream's prompt embeddings and their mask (all True with the release's learnable registers, which fill the padding).
Those three are the prompt's conditions; --text_encoder is a pipeline folder holding text_encoder/, tokenizer/ and
connectors/. Clips go through LTX-2's video autoencoder (AutoencoderKLLTX2Video: 4x4 patches, then 8x down in space and
in time after the first frame, 128 channels), normalised by the pipeline's own _normalize_latents (its per-channel
mean and std); the model takes them packed as tokens (the pipeline's _pack_latents; its patches are 1x1x1), with RoPE
positions from the frame count, size and 24 fps (the official trainer's default frame rate, in training and sampling).

Training follows the official trainer (Lightricks/LTX-2, packages/ltx-trainer: training_strategies/text_to_video.py)
in its video-only mode (with_audio false, its default for text-to-video): x_t = (1 - sigma) x + sigma noise, target
noise - x, plain MSE over the video tokens; the model sees time 1000 sigma (ltx-core multiplies sigma by the model's
timestep_scale_multiplier, 1000; diffusers' forward takes it multiplied, as the pipeline passes the scheduler's
timesteps, also as `sigma`). There the audio modality is absent, so the blocks run no audio-video cross-attention;
diffusers' forward always runs an audio stream, so it is handed one zero audio token and isolate_modalities (both
cross-modal attentions off): the video prediction is then the official video-only forward's, independent of anything
the audio stream is fed. The audio branch (the audio stream, both cross-modal attentions and their modulations,
5.8B of the release's 18.9B parameters) gets no gradient and is frozen (`unused`); the run's log says so with its
recipe. Not done: training the audio branch on a clip's audio (the official with_audio mode), which needs an audio
data path opendit does not have; nor the trainer's first-frame conditioning (first_frame_conditioning_p 0.1) or its
shifted, stretched logit-normal timesteps (opendit's --timestep_sampling: logit-normal or uniform, unshifted).

Sampling runs the pipeline's own loop, which generates audio with the video: the audio stream starts from noise the
pipeline draws (from a generator of --seed, the same for every batch: opendit's sampler hands it only the video noise)
and the video attends to it at every step through the frozen audio-to-video attention, as the official trainer's
validation samples with audio after video-only training (a release's cross-modal attention is trained; a model trained
from scratch here, as the debug model, samples through one it never trained). The pipeline's audio output is not decoded
and is dropped (opendit writes the video): its audio autoencoder and vocoder are stand-ins that hand the latents back,
with the release audio autoencoder's geometry (8 channels over 64 mel bins, 4x down in time and in mel) for the noise it
draws. Its connectors are handed the prompts' conditions, which went through the real connectors when encoded. In pixel
space (--vae none) the pipeline decodes through a stand-in of the video autoencoder's interface. Guidance is plain
classifier-free guidance of both streams at --cfg_scale (the pipeline's [negative; prompt] batch; 1 off); the official
sampler's extra terms (audio guidance 7, STG at block 29, guidance rescale 0.7, modality guidance 3) are turned off, as
no opendit option reaches them. The pipeline takes heights and widths that are multiples of 32.

Sizes: "ltx2-19b" is the LTX-2 (2.0) release as diffusers' conversion script writes it (scripts/
convert_ltx2_to_diffusers.py, version 2.0: the class defaults but for rope_type "split"): 48 blocks, video 32 heads of
128 over Gemma 3 12B's 3840 channels, audio 32 heads of 64, 18.9B parameters. Unsure: that the hub's folder spells
every key as that script does. LTX-2.3 and later (gated attention, cross-attention modulation, no caption projection,
per-modality connector projections) are not registered. Its scheduler: the script's (dynamic shifting between 0.95
and 2.05, terminal shift 0.1); sampling defaults the official LTX-2 pipelines' (40 steps, video guidance 3).

Sequence parallelism: opendit's plan is the class's `_cp_plan` changed in two ways. That plan splits the video RoPE
tables along dim 1, their token axis only for the "interleaved" RoPE; the release's "split" RoPE tables are [B, heads,
tokens, r], which it leaves whole (its expected_dims is 3): here they are split along dim 2, for the self-attention and
the cross-modal attention. It also splits the prompt and its mask, which diffusers' Ulysses attention cannot take: the
processor hands it the key mask repeated per head ([B, heads, 1, L], while a rank holds some of the heads), and its
backward assumes queries and keys of one length. Here the prompt stays whole on every rank, and only the video
self-attention (and, sampling, the video-to-audio attention, whose keys are the split video tokens) runs through
Ulysses; the prompt cross-attentions, the audio stream's attention and the audio-to-video attention attend on each
rank to keys it holds whole, as diffusers' Wan plan does for its cross-attention. The audio stream runs whole on every
rank.

LoRA targets the video stream's Linears as the official trainer names them (attn1, attn2: to_q, to_k, to_v, to_out.0;
ff.net.0.proj, ff.net.2); not the audio ones it also offers, which are frozen here. The official single file's
transformer converts through diffusers' convert_ltx2_transformer_to_diffusers; a combined file also holding the
autoencoders, the vocoder and the connectors' projection keeps those keys through that converter, which opendit's
strict loading refuses (a file of the transformer alone loads).

    python -m opendit.families.wrapped.tiny_text ltx2-debug outputs/tiny_ltx2   # its tiny Gemma 3 and connectors
"""
import types

import torch
import torch.nn as nn

from opendit.distributed import unwrap_model
from opendit.families.wrapped.context_parallel import diffusers_plan
from opendit.families.wrapped.declared import Declared, Feed, Size, Streams
from opendit.families.wrapped.glue import PixelSpace

# diffusers' conversion script's LTX-2 (2.0) transformer
LTX2_19B = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                attention_head_dim=128, cross_attention_dim=4096, vae_scale_factors=(8, 32, 32), pos_embed_max_pos=20,
                base_height=2048, base_width=2048, gated_attn=False, cross_attn_mod=False, audio_in_channels=128,
                audio_out_channels=128, audio_patch_size=1, audio_patch_size_t=1, audio_num_attention_heads=32,
                audio_attention_head_dim=64, audio_cross_attention_dim=2048, audio_scale_factor=4,
                audio_pos_embed_max_pos=20, audio_sampling_rate=16000, audio_hop_length=160, audio_gated_attn=False,
                audio_cross_attn_mod=False, num_layers=48, activation_fn="gelu-approximate",
                qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=3840,
                attention_bias=True, attention_out_bias=True, rope_theta=10000.0, rope_double_precision=True,
                causal_offset=1, timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000,
                rope_type="split", use_prompt_embeddings=True, perturbed_attn=False)
# video 64 wide (4 heads of 16), audio 32 wide (4 heads of 8), 2 blocks; a tiny Gemma 3 (32 wide) and its connectors
LTX2_DEBUG = dict(LTX2_19B, num_attention_heads=4, attention_head_dim=16, cross_attention_dim=64,
                  audio_num_attention_heads=4, audio_attention_head_dim=8, audio_cross_attention_dim=32, num_layers=2,
                  caption_channels=32)
# the conversion script's scheduler of the non-distilled release
SCHEDULER = dict(num_train_timesteps=1000, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                 base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)
FPS = 24.0  # the official trainer's DEFAULT_FPS and the pipeline's frame_rate
# the release audio autoencoder's latent: channels over mel bins (its compression makes 8 x 64 / 4 = 128 features)
AUDIO_LATENT_CHANNELS, AUDIO_MEL_BINS = 8, 64
# what the video-only forward never reaches: the audio stream, both cross-modal attentions, their modulations
AUDIO_BRANCH = (r"^(audio_|av_cross_attn_)|"
                r"^transformer_blocks\.\d+\.(audio_|video_to_audio_|video_a2v_cross_attn_scale_shift_table)")
TEXT_PARAMS = 12.19e9 + 1.43e9  # Gemma 3 12B (its vision tower too) and the connectors


def encode(text, captions, device) -> dict:
    """The pipeline's own Gemma encoding through its own text connectors: the video and the audio stream's prompt
    embeddings and the connectors' mask."""
    pipe = text.pipeline
    embeds, mask = pipe._get_gemma_prompt_embeds(captions, max_sequence_length=text.max_length, device=device)
    video, audio, mask = pipe.connectors(embeds, mask, padding_side=pipe.tokenizer.padding_side)
    return {"embeds": video.float(), "audio_embeds": audio.float(), "mask": mask.bool()}


def latent_statistics(vae) -> tuple[torch.Tensor, torch.Tensor]:
    """The autoencoder's per-channel latent mean and std (PixelSpace: zeros and ones, from its config)."""
    if hasattr(vae, "latents_mean"):
        return vae.latents_mean, vae.latents_std
    return torch.tensor(vae.config.latents_mean), torch.tensor(vae.config.latents_std)


def to_model(vae, z):
    """The pipeline's own _normalize_latents: (z - mean) * scaling_factor / std per channel."""
    from diffusers import LTX2Pipeline
    return LTX2Pipeline._normalize_latents(z, *latent_statistics(vae), vae.config.scaling_factor)


def forward(model, x, t, cond) -> dict:
    """x [B, C, T, h, w] packed into tokens as the pipeline packs them, time 1000 t (also as `sigma`, as the pipeline
    passes it), RoPE positions from the latent grid at FPS; one zero audio token with the cross-modal attention off
    (the official video-only forward)."""
    from diffusers import LTX2Pipeline
    b, _, frames, h, w = x.shape
    time = t * 1000
    audio = x.new_zeros(b, 1, unwrap_model(model).config.audio_in_channels)  # model: as boosted (DDP wraps it)
    return dict(hidden_states=LTX2Pipeline._pack_latents(x), audio_hidden_states=audio,
                encoder_hidden_states=cond["embeds"], audio_encoder_hidden_states=cond["audio_embeds"], timestep=time,
                sigma=time, encoder_attention_mask=cond["mask"], audio_encoder_attention_mask=cond["mask"],
                num_frames=frames, height=h, width=w, fps=FPS, audio_num_frames=1, isolate_modalities=True,
                return_dict=False)


def output(out, shape):
    """The video tokens -> [B, C, T, h, w], the pipeline's own _unpack_latents."""
    from diffusers import LTX2Pipeline
    return LTX2Pipeline._unpack_latents(out, *shape[2:])


def call(constants, sample_cfg, cond, negative) -> dict:
    """Each prompt's video and audio embeddings side by side (the stand-in connectors part them), plain guidance of
    both streams at --cfg_scale, the audio noise from a generator of --seed."""
    def embeds(c):
        return torch.cat([c["embeds"], c["audio_embeds"]], dim=-1)
    return dict(prompt_embeds=embeds(cond), prompt_attention_mask=cond["mask"], negative_prompt_embeds=embeds(negative),
                negative_prompt_attention_mask=negative["mask"], guidance_scale=sample_cfg.cfg_scale,
                audio_guidance_scale=sample_cfg.cfg_scale, stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0,
                audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0, frame_rate=FPS,
                generator=torch.Generator().manual_seed(sample_cfg.seed),
                max_sequence_length=constants["max_sequence_length"])


class ConnectedPrompts(nn.Module):
    """LTX2Pipeline's connectors for prompts that went through the real ones when encoded: the pipeline's
    prompt_embeds are the video and the audio embeddings side by side, handed back apart with the mask."""

    def __init__(self, video_width: int):
        super().__init__()
        self.video_width = video_width
        self.register_buffer("anchor", torch.zeros(()), persistent=False)  # its device for the pipeline

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    def forward(self, embeds, mask, padding_side: str = "left", scale_factor: int = 8):
        return embeds[..., :self.video_width], embeds[..., self.video_width:], mask


class UndecodedAudio(nn.Module):
    """LTX2Pipeline's audio autoencoder and vocoder when its audio is dropped: the release audio autoencoder's
    geometry for the noise the pipeline draws (the transformer's sample rate and hop, AUDIO_LATENT_CHANNELS over
    AUDIO_MEL_BINS, 4x down in time and in mel), unit statistics, and decoding and vocoding that hand the latents
    back."""

    def __init__(self, transformer):
        from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import LATENT_DOWNSAMPLE_FACTOR
        super().__init__()
        config = transformer.config
        features = AUDIO_LATENT_CHANNELS * AUDIO_MEL_BINS // LATENT_DOWNSAMPLE_FACTOR
        if features != config.audio_in_channels:
            raise ValueError(f"the transformer's audio_in_channels {config.audio_in_channels} is not the release "
                             f"audio autoencoder's {features} latent features the pipeline packs")
        self.config = types.SimpleNamespace(sample_rate=config.audio_sampling_rate,
                                            mel_hop_length=config.audio_hop_length, mel_bins=AUDIO_MEL_BINS,
                                            latent_channels=AUDIO_LATENT_CHANNELS)
        self.temporal_compression_ratio = self.mel_compression_ratio = LATENT_DOWNSAMPLE_FACTOR
        self.register_buffer("latents_mean", torch.zeros(features), persistent=False)
        self.register_buffer("latents_std", torch.ones(features), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.latents_mean.dtype

    @property
    def device(self) -> torch.device:
        return self.latents_mean.device

    def decode(self, z, return_dict: bool = True):
        return (z,) if not return_dict else types.SimpleNamespace(sample=z)

    def forward(self, mel):
        return mel


class PixelClips(PixelSpace):
    """PixelSpace with the video autoencoder's interface LTX2Pipeline reads: unit latent statistics, no timestep
    conditioning, decode(z, timestep, return_dict)."""

    def __init__(self, channels: int):
        super().__init__(channels)
        self.config.timestep_conditioning = False
        self.register_buffer("latents_mean", torch.zeros(channels), persistent=False)
        self.register_buffer("latents_std", torch.ones(channels), persistent=False)

    def decode(self, z, timestep=None, return_dict: bool = True):
        return super().decode(z, return_dict=return_dict)


def _sampling_pipeline():
    """LTX2Pipeline with the stand-ins sampling needs beside the transformer and the video autoencoder (see the
    module's docstring): the connectors, the audio autoencoder and vocoder, and in pixel space the autoencoder."""
    from diffusers import LTX2Pipeline

    class LTX2Sampling(LTX2Pipeline):
        def __init__(self, scheduler, vae, audio_vae, text_encoder, tokenizer, connectors, transformer, vocoder,
                     processor=None, prompt_enhancer=None, duration_head=None):
            if isinstance(vae, PixelSpace) and not isinstance(vae, PixelClips):
                vae = PixelClips(vae.config.latent_channels).to(vae.device)
            audio = UndecodedAudio(transformer).to(transformer.device)
            connectors = ConnectedPrompts(transformer.config.caption_channels) if connectors is None else connectors
            super().__init__(scheduler, vae, audio if audio_vae is None else audio_vae, text_encoder, tokenizer,
                             connectors, transformer, audio if vocoder is None else vocoder, processor,
                             prompt_enhancer, duration_head)
    return LTX2Sampling


def _context_parallel_plan() -> dict:
    """The video tokens split, with their "split" RoPE tables [B, heads, tokens, r] along their tokens (those of the
    self-attention and of the cross-modal attention), the output gathered; the prompt and the audio stream whole."""
    from diffusers.models._modeling_parallel import ContextParallelInput as Split
    from diffusers.models._modeling_parallel import ContextParallelOutput as Gather
    rope = {0: Split(split_dim=2, expected_dims=4, split_output=True),
            1: Split(split_dim=2, expected_dims=4, split_output=True)}
    return {"": {"hidden_states": Split(split_dim=1, expected_dims=3, split_output=False)},
            "rope": rope, "cross_attn_rope": rope, "proj_out": Gather(gather_dim=1, expected_dims=3)}


def _prepare_split(model, size: int) -> None:
    """Only the video self-attention (and the video-to-audio attention, whose keys are the split video tokens) run
    through Ulysses; the prompt cross-attentions, the audio self-attention and the audio-to-video attention attend
    on each rank to keys it holds whole (the prompt, the audio stream)."""
    for block in model.transformer_blocks:
        for attention in (block.attn2, block.audio_attn1, block.audio_attn2, block.audio_to_video_attn):
            attention.processor._parallel_config = None


def _video_cross_and_audio_macs(model, txt_tokens: int, img_tokens: int) -> int:
    """One block's attention products beyond the video self-attention: the video tokens over the prompt's, and the
    one audio token over itself and over the prompt's (the cross-modal attention is off)."""
    config = model.config
    video, audio = config.num_attention_heads * config.attention_head_dim, \
        config.audio_num_attention_heads * config.audio_attention_head_dim
    return 2 * img_tokens * txt_tokens * video + 2 * (1 + txt_tokens) * audio


# the time embeddings and modulations run once per sample, the caption projections and the prompt's keys and values
# on its tokens, the audio stream on its one token, the cross-modal attentions not at all; attention: the video
# self-attention over the video tokens, the rest (_video_cross_and_audio_macs) per block
STREAMS = Streams(rows={r"\.(audio_to_video|video_to_audio)_attn\.": lambda model: 0,
                        r"^audio_proj_(in|out)|\.audio_(attn1|ff)\.|\.audio_attn2\.to_(q|out)": lambda model: 1},
                  one=r"^(audio_)?time_embed|^av_cross_attn_|^(audio_)?prompt_adaln",
                  text=r"caption_projection|\.(audio_)?attn2\.to_[kv]",
                  attention={"transformer_blocks": "image",
                             "transformer_blocks.attn2": _video_cross_and_audio_macs})

# sampling defaults: the official LTX-2 pipelines' (40 steps, video guidance 3)
MODEL = Declared(
    family="ltx2", title="LTX-2", transformer="LTX2VideoTransformer3DModel", pipeline="LTX2Pipeline", fps=FPS,
    models={"ltx2-19b": Size(LTX2_19B, dict(max_sequence_length=1024, steps=40, cfg_scale=3.0,
                                            text_params=TEXT_PARAMS)),
            "ltx2-debug": Size(LTX2_DEBUG, dict(max_sequence_length=16, steps=20, cfg_scale=3.0, text_params=0,
                                                tiny_text="gemma3+connectors"))},
    feed=Feed(encode, to_model, forward, call, output),
    text={"text_encoder": "text_encoder", "tokenizer": "tokenizer", "connectors": "connectors"},
    conditions={"embeds": ("L", "caption_channels"), "audio_embeds": ("L", "caption_channels"), "mask": ("L",)},
    scheduler=SCHEDULER, vae="AutoencoderKLLTX2Video", vae_kind="stated", vae_size=(128, 1_222_479_601),
    vae_downsampling=32, vae_temporal=8,
    patch=1, outside_patch=1, packed_latents=True, cfg_calls="batched",  # one call on [negative; prompt]
    parallel_plan=diffusers_plan(split=("video tokens", "their RoPE tables"), cp_plan=_context_parallel_plan,
                                 checked=("hidden_states",), prepare=_prepare_split),
    derived={"out_channels": lambda arch: arch["in_channels"]}, unused=AUDIO_BRANCH,
    sampling_pipeline=_sampling_pipeline,
    lora_targets=r"transformer_blocks\.\d+\.(attn[12]\.(to_[qkv]|to_out\.0)|ff\.net\.(0\.proj|2))",
    official_key="av_ca_a2v_gate_adaln_single.emb.timestep_embedder.linear_1.weight",
    official_converter="convert_ltx2_transformer_to_diffusers",
    recipe=("the official trainer's video-only text-to-video (Lightricks/LTX-2 ltx-trainer): x_t = (1 - sigma) x + "
            "sigma noise, model time 1000 sigma, target noise - x, plain MSE; the audio branch frozen (the audio "
            "stream, fed one zero token, and the cross-modal attention, off): the data has no audio"),
    streams=STREAMS,
)
