"""Krea 2 (Krea's 2026 text-to-image model: a 12B single-stream MMDiT with grouped-query attention and gated
attention outputs) through diffusers' own Krea2Transformer2DModel and Krea2Pipeline.

Prompts are the pipeline's own encode_prompt: each prompt in Qwen-Image's system template, padded to a fixed length in
the middle (prefix, prompt, padding, then the 5-token assistant suffix), run through Qwen3-VL (Qwen3VLModel of
Qwen3-VL-4B-Instruct) with positions that skip the padding, and the hidden states of 12 of its layers (2, 5, ..., 35)
stacked per token; the template's first 34 tokens are dropped, leaving max_sequence_length tokens [L, 12, 2560] and
a bool mask (prompt and suffix tokens). The transformer fuses the 12 layers itself (its text_fusion blocks). Images
go through Qwen-Image's causal 3-D autoencoder (one frame; 16 channels, 8x down), normalised per channel by the VAE's
latents_mean and latents_std, patched 2x2 (64 channels) and packed into tokens; position ids are the pipeline's
prepare_position_ids (text at the origin, image tokens at their grid cells). The model sees the noise level t in
[0, 1] (the pipeline passes sigma) and predicts noise - x.

Training follows diffusers' Krea 2 DreamBooth LoRA example (examples/dreambooth/train_dreambooth_lora_krea2.py):
x_t = (1 - t) x + t noise, timestep t, target noise - x, plain MSE (its default weighting "none"). Sampling goes
through the pipeline's guidance, cond + g (cond - uncond) whenever g > 0: --cfg_scale keeps opendit's convention
(1: off) and the pipeline's guidance_scale is cfg_scale - 1.

The release size is the class's defaults (28 blocks 6144 wide, 48 query / 12 key-value heads, a 16384-wide SwiGLU,
2 + 2 text-fusion blocks 2560 wide): about 12.8B parameters, the "12B DiT" of the technical report; Krea 2 Raw and
Krea 2 Turbo share it (Turbo samples in 8 steps without guidance and with a fixed shift, mu = 1.15, which the
pipeline takes from its constructor's is_distilled: opendit samples with the Raw schedule). The scheduler settings
are those the pipeline documents (dynamic exponential shift, mu from 0.5 at 256 tokens to 1.15 at 6400), not read
from the published scheduler_config.json.

No sequence parallelism: diffusers' class declares no _cp_plan, and opendit gives it none yet (the text fusion runs on
the text tokens alone before the joint sequence exists, so a plan would have to split the joint blocks only).
"""
from opendit.families.wrapped.declared import Declared, Feed, Size, Streams
from opendit.families.wrapped.glue import pack
from opendit.families.wrapped.qwenimage import to_model

KREA2 = dict(in_channels=64, num_layers=28, attention_head_dim=128, num_attention_heads=48, num_key_value_heads=12,
             intermediate_size=16384, timestep_embed_dim=256, text_hidden_dim=2560, num_text_layers=12,
             text_num_attention_heads=20, text_num_key_value_heads=20, text_intermediate_size=6912,
             num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(32, 48, 48), rope_theta=1000.0,
             norm_eps=1e-5)
# the CPU-sized model of tests (64 wide, 2 blocks, 1 + 1 text-fusion blocks); a tiny random Qwen3-VL (16 wide, 36
# layers, tapped at the pipeline's 12 layers) conditions it
KREA2_DEBUG = dict(KREA2, num_layers=2, attention_head_dim=16, num_attention_heads=4, num_key_value_heads=1,
                   intermediate_size=128, timestep_embed_dim=32, text_hidden_dim=16, text_num_attention_heads=2,
                   text_num_key_value_heads=2, text_intermediate_size=32, num_layerwise_text_blocks=1,
                   num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6))
# the pipeline's documented schedule: sigmas shifted by mu, from 0.5 at 256 image tokens to 1.15 at 6400
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=6400, time_shift_type="exponential")


def encode(text, captions, device) -> dict:
    """The pipeline's own encode_prompt: [B, L, 12, D] tapped hidden states and the bool mask, L fixed."""
    embeds, mask = text.pipeline.encode_prompt(captions, device=device, max_sequence_length=text.max_length)
    return {"embeds": embeds.float(), "mask": mask.bool()}


def forward(model, x, t, cond) -> dict:
    from diffusers import Krea2Pipeline
    _, _, h, w = x.shape
    position_ids = Krea2Pipeline.prepare_position_ids(cond["embeds"].shape[1], h, w, x.device)
    return dict(hidden_states=pack(x), encoder_hidden_states=cond["embeds"], timestep=t, position_ids=position_ids,
                encoder_attention_mask=cond["mask"], return_dict=False)


def call(constants, sample_cfg, cond, negative) -> dict:
    if sample_cfg.cfg_scale < 1:
        raise ValueError(f"--cfg_scale {sample_cfg.cfg_scale}: Krea 2's pipeline guides only above 1 (1: off); "
                         "pass 1 or more")
    return dict(prompt_embeds=cond["embeds"], prompt_embeds_mask=cond["mask"],
                negative_prompt_embeds=negative["embeds"], negative_prompt_embeds_mask=negative["mask"],
                guidance_scale=sample_cfg.cfg_scale - 1, max_sequence_length=constants["max_sequence_length"])


def _text_tokens(model) -> int:
    return model.num_tokens[0]  # the run's max_sequence_length (the kind sets num_tokens when it builds the model)


# sampling defaults: the pipeline's (28 steps, guidance_scale 4.5 = --cfg_scale 5.5); text_params: Qwen3-VL-4B's
MODEL = Declared(
    family="krea2", title="Krea 2", transformer="Krea2Transformer2DModel", pipeline="Krea2Pipeline",
    models={"krea2": Size(KREA2, dict(max_sequence_length=512, steps=28, cfg_scale=5.5, text_params=4.44e9)),
            "krea2-debug": Size(KREA2_DEBUG, dict(max_sequence_length=16, steps=20, cfg_scale=5.5, text_params=0,
                                                  tiny_text="qwen3-vl"))},
    feed=Feed(encode, to_model, forward, call),
    text={"text_encoder": "text_encoder", "tokenizer": "tokenizer"},
    conditions={"embeds": ("L", "num_text_layers", "text_hidden_dim"), "mask": ("L",)},
    scheduler=SCHEDULER, vae="AutoencoderKLQwenImage", vae_kind="frame", vae_size=(16, 126.9e6),
    # the default of diffusers' example (the Krea 2 authors' recommendation) within the blocks, text fusion's too:
    # attention (q, k, v, its output gate, out) and the MLP's up and down projections, not its gate; the example
    # also adapts the embedders (img_in, txt_in, time_embed, time_mod_proj, final_layer.linear)
    lora_targets=(r"(transformer_blocks|text_fusion\.(layerwise|refiner)_blocks)\.\d+\."
                  r"(attn\.(to_[qkv]|to_gate|to_out\.0)|ff\.(up|down))"),
    # Krea's single file: its own module names (txtfusion, blocks.N.attn.wq; diffusers' neither)
    official_key=("txtfusion.projector.weight", "blocks.0.attn.wq.weight"),
    official_converter="convert_krea2_transformer_checkpoint_to_diffusers",
    recipe=("diffusers' Krea 2 DreamBooth LoRA example: x_t = (1 - t) x + t noise, target noise - x, plain MSE, the "
            "text padding masked"),
    # single stream: the blocks run on text + image tokens; the text fusion's layerwise blocks on each text token's
    # 12 tapped layers, its projector on each token's channels. Not counted: the text fusion's attention products
    # (L * 12^2 and L^2 at the text width, under 0.1% of the release's count)
    streams=Streams(rows={r"^text_fusion\.layerwise_blocks\.": lambda m: _text_tokens(m) * m.config.num_text_layers,
                          r"^text_fusion\.projector$": lambda m: _text_tokens(m) * m.config.text_hidden_dim},
                    one=r"^(time_embed|time_mod_proj)", joint=r"^transformer_blocks", text=r"^(text_fusion|txt_in)",
                    attention={"transformer_blocks": "joint"}),
)
