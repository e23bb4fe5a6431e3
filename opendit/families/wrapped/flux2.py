"""FLUX.2 [klein] and [dev] through diffusers' own Flux2Transformer2DModel and Flux2KleinPipeline / Flux2Pipeline.

Their prompt embedding is the pipeline's: each prompt in the text encoder's chat template ([klein]: Qwen3's; [dev]:
Mistral3's, with the pipeline's system message), padded to max_sequence_length, the hidden states of three of its
layers stacked per token (3 x 2560 = 7680 wide for klein 4B, 3 x 5120 = 15360 for dev). Images go through
AutoencoderKLFlux2 (32 channels, 8x down), are patched 2x2 (128 channels) and normalised by the VAE's batch-norm
statistics, then packed into tokens with 4-D position ids (t, h, w, l), as the pipelines do.

Training follows diffusers' FLUX.2 DreamBooth LoRA examples (examples/dreambooth/train_dreambooth_lora_flux2*.py):
noisy = (1 - s) x + s noise, the model predicts noise - x from timestep s (the pipeline passes sigma, in [0, 1]),
plain MSE; [dev]'s guidance embedding is given TRAIN_GUIDANCE, [klein] has none. The density of s is
--timestep_sampling (those scripts' --weighting_scheme: logit_normal, or uniform = their "none"). Sampling: [klein]
with true classifier-free guidance (--cfg_scale); [dev] is guidance-distilled: --cfg_scale is the guidance it is
given (the pipeline's guidance_scale), one evaluation per step.
(The tiny text encoders of the debug models: python -m opendit.families.wrapped.tiny_text MODEL FOLDER.)
"""
import torch

from opendit.distributed import unwrap_model
from opendit.families.wrapped.context_parallel import diffusers_plan
from opendit.families.wrapped.references import image_of_the_set
from opendit.families.wrapped.declared import Declared, Feed, Size, Streams

KLEIN_4B = dict(patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256, mlp_ratio=3.0,
                axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=False)
# the CPU-sized model of tests and the demo (flux-debug's size: 64 wide, 2 + 2 blocks); a tiny Qwen3 (16 wide,
# 3 layers) conditions it
KLEIN_DEBUG = dict(KLEIN_4B, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4,
                   joint_attention_dim=48, timestep_guidance_channels=64, axes_dims_rope=(4, 4, 4, 4))
# FLUX.2 [dev]: 8 + 48 blocks 6144 wide, Mistral-Small-3.1 (24B) prompts, a guidance embedding
DEV = dict(KLEIN_4B, num_layers=8, num_single_layers=48, num_attention_heads=48, joint_attention_dim=15360,
           guidance_embeds=True)
DEV_DEBUG = dict(KLEIN_DEBUG, guidance_embeds=True)  # for a tiny Mistral3 (16 wide, layers 1-3 stacked)
DEV_PIPELINE = "Flux2Pipeline"  # [dev]'s (guidance-distilled); [klein] samples with Flux2KleinPipeline
# text_layers: the text encoder's hidden states stacked into the prompt embedding; steps and cfg: sampling defaults
# (dev: cfg is its embedded guidance); text_params: the text encoder's parameters (the memory planner counts them
# without reading the folder); pipeline: the diffusers pipeline that samples it
MODELS = {
    "flux2-klein-4b": Size(KLEIN_4B, dict(text_layers=(9, 18, 27), max_sequence_length=512, steps=50, cfg_scale=4.0,
                                          text_params=4.02e9, references=4)),  # Qwen3-4B
    "flux2-klein-debug": Size(KLEIN_DEBUG, dict(text_layers=(1, 2, 3), max_sequence_length=16, steps=20,
                                                cfg_scale=4.0, text_params=0, tiny_text="qwen3", references=4)),
    "flux2-dev": Size(DEV, dict(text_layers=(10, 20, 30), max_sequence_length=512, steps=50, cfg_scale=4.0,
                                text_params=24.0e9, pipeline=DEV_PIPELINE, references=6)),  # Mistral-Small-3.1-24B
    "flux2-dev-debug": Size(DEV_DEBUG, dict(text_layers=(1, 2, 3), max_sequence_length=48, steps=20, cfg_scale=4.0,
                                            text_params=0, pipeline=DEV_PIPELINE,  # 48: the system message fits
                                            tiny_text="mistral3", references=6)),
}
TRAIN_GUIDANCE = 1.0  # [dev]'s guidance embedding while training (diffusers' examples train with --guidance_scale 1)
# the FLUX.2 pipelines' scheduler (resolution-dependent shift, mu from compute_empirical_mu)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")


def is_dev(name: str) -> bool:
    return MODELS[name].constants.get("pipeline") == DEV_PIPELINE


def encode(text, captions, device) -> dict:
    """The pipeline's own prompt encoding: [dev]'s Mistral3 (its system message), [klein]'s Qwen3."""
    from diffusers import Flux2KleinPipeline, Flux2Pipeline
    embed = (Flux2Pipeline._get_mistral_3_small_prompt_embeds if isinstance(text.pipeline, Flux2Pipeline)
             else Flux2KleinPipeline._get_qwen3_prompt_embeds)
    return {"embeds": embed(text.model, text.tokenizer, captions, dtype=torch.float32, device=device,
                            max_sequence_length=text.max_length, hidden_states_layers=text.layers)}


def to_model(vae, z):
    """Patched 2x2 and normalised by the VAE's batch-norm statistics (the pipeline's _encode_vae_image)."""
    from diffusers import Flux2KleinPipeline
    z = Flux2KleinPipeline._patchify_latents(z)
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z)
    return (z - mean) / std


def forward(model, x, t, cond) -> dict:
    """The pipeline's packing and 4-D position ids; [dev]'s guidance embedding given TRAIN_GUIDANCE; an editing
    pair's references appended without noise, reference k's ids with time coordinate 10 (k + 1) (the pipelines'
    prepare_image_latents)."""
    from diffusers import Flux2KleinPipeline as pipe
    embeds = cond["embeds"]
    guidance = torch.full((len(x),), TRAIN_GUIDANCE, device=x.device) \
        if unwrap_model(model).config.guidance_embeds else None  # model: as boosted (DDP wraps it)
    tokens, ids = pipe._pack_latents(x), pipe._prepare_latent_ids(x).to(x.device)
    if "references" in cond:
        references = cond["references"].unbind(1)
        reference_ids = pipe._prepare_image_ids([r[:1] for r in references]).to(x.device)
        tokens = torch.cat([tokens, *map(pipe._pack_latents, references)], dim=1)
        ids = torch.cat([ids, reference_ids.expand(len(x), -1, -1)], dim=1)
    return dict(hidden_states=tokens, encoder_hidden_states=embeds, timestep=t, img_ids=ids,
                txt_ids=pipe._prepare_text_ids(embeds).to(x.device), guidance=guidance, return_dict=False)


def call(constants, sample_cfg, cond, negative) -> dict:
    """[klein]: true guidance with the negative prompt; [dev]: --cfg_scale is its embedded guidance, no negative."""
    given = dict(prompt_embeds=cond["embeds"], guidance_scale=sample_cfg.cfg_scale,
                 max_sequence_length=constants["max_sequence_length"], text_encoder_out_layers=constants["text_layers"])
    if constants.get("pipeline") == DEV_PIPELINE:
        return given
    return dict(given, negative_prompt_embeds=negative["embeds"])


def kohya_names(keys) -> dict[str, tuple[str, ...]]:
    """BFL's module names, as kohya/ComfyUI/musubi-tuner files of FLUX.2 use them (and diffusers'
    _convert_kohya_flux2_lora_to_diffusers reads them), for the model of state-dict `keys`: a double block's fused
    img_attn.qkv / txt_attn.qkv hold diffusers' to_q, to_k, to_v / add_*_proj rows; the rest are one Linear each."""
    def count(blocks: str) -> int:
        return len({k.split(".")[1] for k in keys if k.startswith(blocks + ".")})
    stacks = {}
    for i in range(count("transformer_blocks")):
        d, b = f"double_blocks.{i}", f"transformer_blocks.{i}"
        stacks |= {f"{d}.img_attn.qkv": (f"{b}.attn.to_q", f"{b}.attn.to_k", f"{b}.attn.to_v"),
                   f"{d}.txt_attn.qkv": (f"{b}.attn.add_q_proj", f"{b}.attn.add_k_proj", f"{b}.attn.add_v_proj"),
                   f"{d}.img_attn.proj": (f"{b}.attn.to_out.0",), f"{d}.txt_attn.proj": (f"{b}.attn.to_add_out",),
                   f"{d}.img_mlp.0": (f"{b}.ff.linear_in",), f"{d}.img_mlp.2": (f"{b}.ff.linear_out",),
                   f"{d}.txt_mlp.0": (f"{b}.ff_context.linear_in",), f"{d}.txt_mlp.2": (f"{b}.ff_context.linear_out",)}
    for i in range(count("single_transformer_blocks")):
        b = f"single_transformer_blocks.{i}.attn"
        stacks |= {f"single_blocks.{i}.linear1": (f"{b}.to_qkv_mlp_proj",),
                   f"single_blocks.{i}.linear2": (f"{b}.to_out",)}
    stacks |= {"img_in": ("x_embedder",), "txt_in": ("context_embedder",), "final_layer.linear": ("proj_out",),
               "time_in.in_layer": ("time_guidance_embed.timestep_embedder.linear_1",),
               "time_in.out_layer": ("time_guidance_embed.timestep_embedder.linear_2",)}
    return stacks


def text_model(name: str) -> tuple[str, str]:
    """[dev] reads Mistral3's prompts, [klein] Qwen3's."""
    encoder = "Mistral3" if is_dev(name) else "Qwen3"
    return encoder, f"{encoder} model {name} is conditioned by"


MODEL = Declared(
    family="flux2", title="FLUX.2", transformer="Flux2Transformer2DModel", pipeline="Flux2KleinPipeline",
    models=MODELS, feed=Feed(encode, to_model, forward, call), reference_call=image_of_the_set,
    text={"text_encoder": "text_encoder", "tokenizer": "tokenizer"}, text_model=text_model,
    conditions={"embeds": ("L", "joint_attention_dim")},
    scheduler=SCHEDULER, vae="AutoencoderKLFlux2", vae_size=(32, 84e6),  # about: 8x down, 32 channels (128 in 2x2)
    packed_latents=False,  # the pipelines pack the latents they are given
    cfg_calls=lambda name: None if is_dev(name) else "pairs",  # [dev]: embedded guidance
    pipeline_options={"Flux2KleinPipeline": {"is_distilled": False}},  # the base models: true CFG
    parallel_plan=diffusers_plan(split=("image tokens and their ids", "text tokens and their ids")),
    # attention and feed-forward Linears of both streams and of the single blocks (diffusers' names)
    lora_targets=(r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out)|"
                  r"ff(_context)?\.linear_(in|out))|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)"),
    kohya_names=kohya_names,
    official_key="single_stream_modulation.lin.weight",  # BFL's flux-2-*.safetensors
    official_converter="convert_flux2_transformer_checkpoint_to_diffusers",
    recipe=("diffusers' FLUX.2 DreamBooth LoRA examples: x_s = (1 - s) x + s noise, target noise - x, plain MSE, "
            f"[dev]'s guidance embedding given {TRAIN_GUIDANCE}"),
    # the modulations and time embedding run once per sample, the single blocks on the joint sequence, the text
    # stream (context_embedder, the double blocks' add_*_proj, to_add_out, ff_context) on the prompt's tokens, the
    # rest on the image's; every block's attention spans the joint sequence
    streams=Streams(one=r"modulation|^(time_guidance_embed|norm_out)", joint=r"^single_transformer_blocks",
                    text=r"^context_embedder|\.add_|to_add_out|ff_context",
                    attention={"transformer_blocks": "joint", "single_transformer_blocks": "joint"}),
)


def save_tiny_qwen3(folder, words="digits", hidden_size: int = 16, layers: int = 3, max_length: int = 16,
                    seed: int = 0) -> str:
    """Write a tiny random Qwen3ForCausalLM (hidden_size wide, `layers` deep) and a word-level chat tokenizer over
    `words` (opendit.encoders.word_tokenizer.chat_word_tokenizer) to `folder`: flux2-klein-debug's text encoder
    (its prompt embedding stacks layers 1-3: 3 x 16 = 48 wide)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from opendit.encoders.word_tokenizer import chat_word_tokenizer

    tokenizer = chat_word_tokenizer(words, max_length)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=hidden_size // 2, max_position_embeddings=4 * max_length, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def save_tiny_mistral3(folder, words="digits", hidden_size: int = 16, layers: int = 3, max_length: int = 48,
                       seed: int = 0) -> str:
    """Write a tiny random Mistral3ForConditionalGeneration (its Mistral text model hidden_size wide, `layers` deep;
    a one-layer Pixtral vision tower the prompts never reach) and a word-level chat tokenizer over `words` to
    `folder`: flux2-dev-debug's text encoder (layers 1-3 stacked: 3 x 16 = 48 wide). The tokenizer stands in for the
    release's processor, whose chat template it follows for text: the pipeline's system message, then the prompt."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    from opendit.encoders.word_tokenizer import chat_word_tokenizer

    tokenizer = chat_word_tokenizer(words, max_length)
    text = MistralConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=hidden_size // 2, max_position_embeddings=4 * max_length,
                         pad_token_id=tokenizer.pad_token_id)
    vision = PixtralVisionConfig(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=1,
                                 num_attention_heads=2, head_dim=hidden_size // 2, image_size=32, patch_size=16)
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=tokenizer.unk_token_id)
    torch.manual_seed(seed)
    Mistral3ForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
