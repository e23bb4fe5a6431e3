"""FLUX.1 through diffusers' own FluxTransformer2DModel and FluxPipeline: the same weights as opendit's native FLUX
family (opendit.families.flux; FLUX_WEIGHTS converts them both ways), trained by the diffusers kind, so the two can be
compared side by side (tests/test_flux1_wrapped.py: equal losses; benchmarks/vs_diffusers.py: step times).

Prompts are the pipeline's own encode_prompt: CLIP's pooled embedding and T5's tokens, padded to
max_sequence_length. Images go through FLUX.1's AutoencoderKL, (z - shift) * scale, patched 2x2 and packed into
tokens with the pipeline's position ids. Training follows diffusers' FLUX DreamBooth examples
(train_dreambooth_flux.py): x_t = (1 - t) x + t noise, the model sees t (the pipeline passes sigma) and predicts
noise - x, plain MSE; the dev models' guidance embedding is given TRAIN_GUIDANCE (the native family's --guidance
default). Sampling: the pipeline with the release's embedded guidance (constants "sample_guidance"), --cfg_scale its
true_cfg_scale (1: off). Sequence parallelism: diffusers' own context-parallel plan (Ulysses).

FLUX.1 Kontext (the kontext models) edits: it trains on editing pairs as diffusers' Kontext LoRA example
(train_dreambooth_lora_flux_kontext.py, its image-to-image mode) does: the control encoded as FluxKontextPipeline
encodes its reference image (the posterior's mode, (z - shift) * scale, packed), appended to the noisy target's tokens
with position ids whose first coordinate is 1, the loss on the target's tokens only; it samples through
FluxKontextPipeline with the reference at the sample size (sample.py --image).
"""
import torch

from opendit.distributed import unwrap_model
from opendit.families.wrapped.context_parallel import diffusers_plan
from opendit.families.wrapped.declared import Declared, Feed, Size, Streams
from opendit.families.wrapped.glue import pack, patchify

FLUX1_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                 axes_dims_rope=(16, 56, 56))
# flux-debug's architecture (64 wide, 2 + 2 blocks) for tiny T5 and CLIP encoders 32 wide
FLUX1_DEBUG = dict(FLUX1_DEV, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4,
                   joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
TRAIN_GUIDANCE = 1.0
KONTEXT = dict(pipeline="FluxKontextPipeline", references=1, sample_guidance=2.5, cfg_scale=1.0)
# FLUX.1-dev's scheduler (resolution-dependent shift)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096)
# FLUX.1 pipelines' text components: CLIP (pooled) and T5 (tokens)
FLUX1_TEXT = {"text_encoder": "text_encoder", "tokenizer": "tokenizer", "text_encoder_2": "text_encoder_2",
              "tokenizer_2": "tokenizer_2"}


def encode(text, captions, device) -> dict:
    """The pipeline's own encode_prompt: T5's tokens and CLIP's pooled embedding."""
    txt, pooled, _ = text.pipeline.encode_prompt(captions, None, device=device, max_sequence_length=text.max_length)
    return {"embeds": txt.float(), "pooled": pooled.float()}


def to_model(vae, z):
    """(z - shift) * scale (the inverse of the pipeline's decoding), then 2x2 patches."""
    return patchify((z - vae.config.shift_factor) * vae.config.scaling_factor)


def forward(model, x, t, cond) -> dict:
    """The pipeline's arguments; an editing pair's reference (Kontext) appended to the image tokens without noise,
    its position ids those of a latent grid with the first coordinate 1 (FluxKontextPipeline.prepare_latents)."""
    from diffusers import FluxPipeline
    b, _, h, w = x.shape
    guidance = torch.full((b,), TRAIN_GUIDANCE, device=x.device) if unwrap_model(model).config.guidance_embeds \
        else None
    tokens, ids = pack(x), FluxPipeline._prepare_latent_image_ids(b, h, w, x.device, x.dtype)
    if "references" in cond:
        reference = cond["references"][:, 0]
        reference_ids = FluxPipeline._prepare_latent_image_ids(b, *reference.shape[-2:], x.device, x.dtype)
        reference_ids[..., 0] = 1
        tokens, ids = torch.cat([tokens, pack(reference)], dim=1), torch.cat([ids, reference_ids])
    return dict(hidden_states=tokens, encoder_hidden_states=cond["embeds"], pooled_projections=cond["pooled"],
                timestep=t, img_ids=ids, txt_ids=torch.zeros(cond["embeds"].shape[1], 3, device=x.device,
                                                             dtype=x.dtype), guidance=guidance, return_dict=False)


def reference_call(references, height: int, width: int) -> dict:
    """FluxKontextPipeline's reference arguments: each sample's image as it is (no resizing to Kontext's preferred
    resolutions: training saw its controls at the sample size), the sample's area kept (max_area)."""
    return dict(image=None if references is None else [r[0] for r in references], max_area=height * width,
                _auto_resize=False)


def call(constants, sample_cfg, cond, negative) -> dict:
    return dict(prompt_embeds=cond["embeds"], pooled_prompt_embeds=cond["pooled"],
                negative_prompt_embeds=negative["embeds"], negative_pooled_prompt_embeds=negative["pooled"],
                true_cfg_scale=sample_cfg.cfg_scale, guidance_scale=constants["sample_guidance"],
                max_sequence_length=constants["max_sequence_length"])


MODEL = Declared(
    family="flux1", title="FLUX.1 (diffusers)", transformer="FluxTransformer2DModel", pipeline="FluxPipeline",
    models={"flux1-dev-diffusers": Size(FLUX1_DEV, dict(max_sequence_length=512, sample_guidance=3.5, steps=50,
                                                        cfg_scale=1.0, text_params=4.76e9 + 0.12e9)),
            "flux1-debug-diffusers": Size(FLUX1_DEBUG, dict(max_sequence_length=16, sample_guidance=3.5, steps=20,
                                                            cfg_scale=1.0, text_params=0, tiny_text="clip+t5")),
            # FLUX.1 Kontext [dev]: FLUX.1-dev's architecture, an editing model (one reference image), its pipeline's
            # guidance 2.5 and 28 steps
            "flux1-kontext-dev-diffusers": Size(FLUX1_DEV, dict(KONTEXT, max_sequence_length=512, steps=28,
                                                                text_params=4.76e9 + 0.12e9)),
            # the editing demo's model: 96 wide (6 heads), as the 64-wide debug model draws "the next digit" of
            # held-out inputs 83% of the time at most in the demo's 20 minutes (benchmarks/edit_quality.py)
            "flux1-kontext-debug-diffusers": Size(dict(FLUX1_DEBUG, num_attention_heads=6),
                                                  dict(KONTEXT, max_sequence_length=16, steps=20, text_params=0,
                                                       tiny_text="clip+t5"))},
    feed=Feed(encode, to_model, forward, call), reference_call=reference_call, references_per_sample=True,
    text=FLUX1_TEXT, conditions={"embeds": ("L", "joint_attention_dim"), "pooled": ("pooled_projection_dim",)},
    scheduler=SCHEDULER, vae_size=(16, 83_819_683),  # FLUX.1's autoencoder
    parallel_plan=diffusers_plan(split=("image tokens and their ids", "text tokens and their ids")),
    # attention and feed-forward Linears of both streams and of the single blocks (diffusers' names)
    lora_targets=(r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out)|"
                  r"ff(_context)?\.net\.(0\.proj|2))|single_transformer_blocks\.\d+\.(attn\.to_[qkv]|proj_mlp|"
                  r"proj_out)"),
    recipe=("diffusers' FLUX DreamBooth examples: x_t = (1 - t) x + t noise, target noise - x, plain MSE, the "
            "training guidance embedded"),
    streams=Streams(one=r"\.norm|^(time_text_embed|norm_out)", joint=r"^single_transformer_blocks",
                    text=r"^context_embedder|\.add_|to_add_out|ff_context",
                    attention={"transformer_blocks": "joint", "single_transformer_blocks": "joint"}),
)
