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
"""
import torch

from opendit.distributed import unwrap_model
from opendit.families.wrapped.context_parallel import diffusers_plan
from opendit.families.wrapped.glue import ModelGlue, TextEncoder, WrappedSpec, pack, patchify, pipeline_part
from opendit.perf import matmul_macs

FLUX1_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                 axes_dims_rope=(16, 56, 56))
# flux-debug's architecture (64 wide, 2 + 2 blocks) for tiny T5 and CLIP encoders 32 wide
FLUX1_DEBUG = dict(FLUX1_DEV, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4,
                   joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
FLUX1_MODELS = {
    "flux1-dev-diffusers": WrappedSpec("flux1-dev-diffusers", "flux1", None, FLUX1_DEV,
                                       dict(max_sequence_length=512, sample_guidance=3.5, steps=50,
                                            cfg_scale=1.0, text_params=4.76e9 + 0.12e9)),
    "flux1-debug-diffusers": WrappedSpec("flux1-debug-diffusers", "flux1", None, FLUX1_DEBUG,
                                         dict(max_sequence_length=16, sample_guidance=3.5, steps=20,
                                              cfg_scale=1.0, text_params=0)),
}
# FLUX.1-dev's scheduler (resolution-dependent shift)
TRAIN_GUIDANCE = 1.0
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096)


def _pipeline():
    from diffusers import FluxPipeline
    return FluxPipeline


class Flux1Glue(ModelGlue):
    transformer_class = "FluxTransformer2DModel"
    pipeline_class = "FluxPipeline"
    scheduler_config = SCHEDULER
    vae_channels, vae_params = 16, 83_819_683  # FLUX.1's autoencoder
    models = FLUX1_MODELS
    parallel_plan = diffusers_plan(split=("image tokens and their ids", "text tokens and their ids"))
    # attention and feed-forward Linears of both streams and of the single blocks (diffusers' names)
    lora_targets = (r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out)|"
                    r"ff(_context)?\.net\.(0\.proj|2))|single_transformer_blocks\.\d+\.(attn\.to_[qkv]|proj_mlp|"
                    r"proj_out)")
    recipe = ("diffusers' FLUX DreamBooth examples: x_t = (1 - t) x + t noise, target noise - x, plain MSE, the "
              "training guidance embedded")

    def text_encoder(self, path, device, dtype, model) -> TextEncoder:
        """CLIP (text_encoder/, tokenizer/) and T5 (text_encoder_2/, tokenizer_2/) of a FLUX.1 pipeline folder, held by
        the pipeline whose encode_prompt runs them."""
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        def part(model_class, sub: str, tokenizer: str, what: str):
            found = model_class.from_pretrained(pipeline_part(path, sub, what), dtype=dtype)
            tokens = pipeline_part(path, tokenizer, f"{what} tokenizer", marker="tokenizer_config.json")
            return found.to(device).eval().requires_grad_(False), AutoTokenizer.from_pretrained(tokens)
        clip, clip_tokenizer = part(CLIPTextModel, "text_encoder", "tokenizer", "CLIP text encoder")
        t5, t5_tokenizer = part(T5EncoderModel, "text_encoder_2", "tokenizer_2", "T5 encoder")
        pipe = _pipeline()(scheduler=None, vae=None, text_encoder=clip, tokenizer=clip_tokenizer, text_encoder_2=t5,
                           tokenizer_2=t5_tokenizer, transformer=None)
        return TextEncoder(t5, t5_tokenizer, self.models[model].constants["max_sequence_length"], pipeline=pipe)

    def encode_prompts(self, encoder: TextEncoder, captions, device) -> dict:
        """The pipeline's own encode_prompt: T5's tokens and CLIP's pooled embedding."""
        txt, pooled, _ = encoder.pipeline.encode_prompt(list(captions), None, device=device,
                                                        max_sequence_length=encoder.max_length)
        return {"embeds": txt.float(), "pooled": pooled.float()}

    def random_conditions(self, spec, batch, device) -> dict:
        length, arch = spec.constants["max_sequence_length"], spec.arch
        return {"embeds": torch.randn(batch, length, arch["joint_attention_dim"], device=device),
                "pooled": torch.randn(batch, arch["pooled_projection_dim"], device=device)}

    def to_model_space(self, vae, z):
        """(z - shift) * scale (the inverse of the pipeline's decoding), then 2x2 patches."""
        return patchify((z - vae.config.shift_factor) * vae.config.scaling_factor)

    def forward_kwargs(self, model, x, t, cond, cfg) -> dict:
        b, _, h, w = x.shape
        guidance = torch.full((b,), TRAIN_GUIDANCE, device=x.device) \
            if unwrap_model(model).config.guidance_embeds else None
        return dict(hidden_states=pack(x), encoder_hidden_states=cond["embeds"], pooled_projections=cond["pooled"],
                    timestep=t, img_ids=_pipeline()._prepare_latent_image_ids(b, h, w, x.device, x.dtype),
                    txt_ids=torch.zeros(cond["embeds"].shape[1], 3, device=x.device, dtype=x.dtype),
                    guidance=guidance, return_dict=False)

    def from_output(self, out, shape):
        b, c, h, w = shape
        return out.transpose(1, 2).reshape(b, c, h, w)

    def forward_macs(self, model, txt_tokens, img_tokens) -> int:
        """A double block's text-stream Linears (add_*_proj, to_add_out, ff_context) and context_embedder cost
        txt_tokens * in * out, a single block's the joint sequence's, the modulations and time embeddings one row,
        the rest img_tokens; each block's joint attention 2 * L^2 * inner."""
        joint = txt_tokens + img_tokens

        def rows_of(name: str) -> int:
            if ".norm" in name or name.startswith(("time_text_embed", "norm_out")):
                return 1
            if name.startswith("single_transformer_blocks"):
                return joint
            if name.startswith("context_embedder") or any(p in name for p in (".add_", "to_add_out", "ff_context")):
                return txt_tokens
            return img_tokens
        blocks = len(model.transformer_blocks) + len(model.single_transformer_blocks)
        return matmul_macs(model, rows_of) + blocks * 2 * joint * joint * model.inner_dim

    def pipeline_components(self, sample_cfg) -> dict:
        return dict(text_encoder_2=None, tokenizer_2=None)

    def pipeline_latents(self, noise):
        return pack(noise)

    def pipeline_call(self, loaded, sample_cfg, cond, negative) -> dict:
        const = self.models[loaded.cfg.model].constants
        return dict(prompt_embeds=cond["embeds"], pooled_prompt_embeds=cond["pooled"],
                    negative_prompt_embeds=negative["embeds"], negative_pooled_prompt_embeds=negative["pooled"],
                    true_cfg_scale=sample_cfg.cfg_scale, guidance_scale=const["sample_guidance"],
                    max_sequence_length=const["max_sequence_length"])
