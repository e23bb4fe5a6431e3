"""Sana (NVIDIA / MIT Han Lab's efficient text-to-image DiT: linear self-attention, a Mix-FFN with a depthwise
convolution, a 32x deep-compression autoencoder) through diffusers' SanaTransformer2DModel and SanaPipeline.

Prompts are the pipeline's own encode_prompt: Gemma-2 (2B, instruction-tuned) last hidden states of the lower-cased
prompt, BOS first, padded on the right to max_sequence_length (300) with the tokenizer's mask, which the model's
cross-attention turns into a bias. The pipeline by default prefixes prompts with NVIDIA's "complex human instruction"
(a prompt-enhancing preamble whose last tokens it keeps); diffusers' training example does not (its
--complex_human_instruction is None by default, for training and validation), and neither does opendit: captions,
the empty caption of caption dropout and the negative prompt are all encoded plainly, so the sampling pipeline is
handed exactly what training saw. Images go through the deterministic AutoencoderDC (DC-AE f32c32: 32 channels,
32x downsampling), its latent times scaling_factor; the model patches (1x1) and embeds the latent grid itself and
returns a grid.

Training follows diffusers' examples/dreambooth/train_dreambooth_lora_sana.py: x_t = (1 - sigma) x + sigma noise, the
transformer sees the scheduler's timesteps 1000 sigma (the pipeline multiplies by timestep_scale, 1 for these models),
target noise - x, plain MSE. Sampling uses FlowMatchEulerDiscreteScheduler with the release's flow shift 3 (the
release ships a flow DPM-Solver with flow_shift 3.0; --scheduler takes a folder of another). SanaPipeline guides on
one batch [negative; prompt] with guidance_scale as opendit's --cfg_scale (1 off); opendit calls it without
resolution binning (its sizes are the run's) and needs heights and widths that are multiples of 32, as the
pipeline checks.

The release size is the published Sana_1600M_1024px diffusers config (the class defaults: 20 blocks 2240 wide, 70
linear heads of 32, cross-attention 20 heads of 112 over Gemma-2's 2304 channels, Mix-FFN ratio 2.5). Unsure:
sample_size 32 and interpolation_scale None (no positional embedding) are what diffusers' conversion script writes for
1024 px, not read from the hub's file. SANA 1.5 1.6B is the same but for qk_norm="rms_norm_across_heads" (its
folders name no registered model; the single-file converter does not convert its q/k norms either).

No sequence parallelism: diffusers' class has no `_cp_plan`, and a split is not a matter of gathering keys and values
(what its context-parallel hooks do): the linear self-attention would all-reduce each head's key-value sums, and
the Mix-FFN's 3x3 depthwise convolution needs the neighbouring ranks' rows of the image grid.
"""
from opendit.families.wrapped.declared import Declared, Feed, Size, Streams

SANA_1600M_1024 = dict(in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
                       num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
                       caption_channels=2304, mlp_ratio=2.5, attention_bias=False, sample_size=32, patch_size=1,
                       norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None, guidance_embeds=False,
                       qk_norm=None, timestep_scale=1.0)  # the last three: where SANA 1.5 and Sprint differ
# 64 wide (2 linear heads of 32, as the release's), 2 blocks; a tiny Gemma-2 (16 wide) conditions it
SANA_DEBUG = dict(SANA_1600M_1024, num_attention_heads=2, num_layers=2, num_cross_attention_heads=2,
                  cross_attention_head_dim=32, cross_attention_dim=64, caption_channels=16)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)  # the release's flow_shift


def encode(text, captions, device) -> dict:
    """The pipeline's own encode_prompt, without the complex human instruction (as the training example)."""
    embeds, mask, _, _ = text.pipeline.encode_prompt(captions, do_classifier_free_guidance=False, device=device,
                                                     max_sequence_length=text.max_length,
                                                     complex_human_instruction=None)
    return {"embeds": embeds.float(), "mask": mask.bool()}


def to_model(vae, z):
    """z * scale, as the training example scales DC-AE latents (the pipeline divides by it before decoding)."""
    return z * vae.config.scaling_factor


def forward(model, x, t, cond) -> dict:
    return dict(hidden_states=x, encoder_hidden_states=cond["embeds"], encoder_attention_mask=cond["mask"],
                timestep=1000 * t, return_dict=False)


def output(out, shape):
    return out  # the model returns the velocity noise - x as a latent grid


def call(constants, sample_cfg, cond, negative) -> dict:
    return dict(prompt_embeds=cond["embeds"], prompt_attention_mask=cond["mask"], negative_prompt=None,
                negative_prompt_embeds=negative["embeds"], negative_prompt_attention_mask=negative["mask"],
                guidance_scale=sample_cfg.cfg_scale, max_sequence_length=constants["max_sequence_length"],
                use_resolution_binning=False)


def _attention_macs(model, txt_tokens: int, img_tokens: int) -> int:
    """One block's attention products: the linear self-attention's key-value sums and their read-out, 2 N x width x
    (head_dim + 1) (each head's values carry a row of ones, the normaliser), and the cross-attention over the prompt,
    2 N L x its width."""
    c = model.config
    linear = 2 * img_tokens * c.num_attention_heads * c.attention_head_dim * (c.attention_head_dim + 1)
    return linear + 2 * img_tokens * txt_tokens * c.num_cross_attention_heads * c.cross_attention_head_dim


# sampling defaults: the pipeline's (20 steps, guidance_scale 4.5); text_params: Gemma-2 2B's; the VAE: DC-AE f32c32
MODEL = Declared(
    family="sana", title="Sana", transformer="SanaTransformer2DModel", pipeline="SanaPipeline",
    models={"sana-1.6b-1024": Size(SANA_1600M_1024, dict(max_sequence_length=300, steps=20, cfg_scale=4.5,
                                                         text_params=2.61e9)),
            "sana-debug": Size(SANA_DEBUG, dict(max_sequence_length=16, steps=20, cfg_scale=4.5, text_params=0,
                                                tiny_text="gemma2"))},
    feed=Feed(encode, to_model, forward, call, output),
    text={"text_encoder": "text_encoder", "tokenizer": "tokenizer"},
    conditions={"embeds": ("L", "caption_channels"), "mask": ("L",)},
    scheduler=SCHEDULER, vae="AutoencoderDC", vae_kind="dc", vae_size=(32, 312_250_275), vae_downsampling=32,
    outside_patch=1, patch=1, packed_latents=False,  # the model embeds its latent grid itself
    derived={"out_channels": lambda config: config["in_channels"]},  # it predicts the velocity of what it is given
    cfg_calls="batched",  # SanaPipeline calls the model once on [negative; prompt]
    # the attention Linears (both attentions' to_q/k/v/out.0: SimpleTuner's default, a superset of diffusers'
    # example's to_q/k/v); the Mix-FFN is convolutions, which opendit's LoRA does not adapt
    lora_targets=r"transformer_blocks\.\d+\.attn[12]\.(to_[qkv]|to_out\.0)",
    official_key=("blocks.0.cross_attn.q_linear.weight", "blocks.0.cross_attn.kv_linear.weight"),
    official_converter="convert_sana_transformer_to_diffusers",
    recipe=("diffusers' train_dreambooth_lora_sana.py: x_t = (1 - t) x + t noise, timesteps 1000 t, target noise - x, "
            "plain MSE, Gemma-2 prompts without the complex human instruction"),
    # the time embedding runs once, the caption projection and the cross-attention's keys and values on the prompt
    streams=Streams(one=r"^time_embed", text=r"^caption_projection|\.attn2\.to_[kv]$",
                    attention={"transformer_blocks": _attention_macs}),
)
