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
from opendit.families.wrapped.glue import (ModelGlue, TextEncoder, WrappedSpec, last_block_parameters,
                                           load_text_encoder, pack, patchify)
from opendit.perf import matmul_macs

QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
# the CPU-sized model of tests (64 wide, 2 blocks); a tiny random Qwen2.5-VL (16 wide) conditions it
QWEN_IMAGE_DEBUG = dict(QWEN_IMAGE, num_layers=2, attention_head_dim=16, num_attention_heads=4, joint_attention_dim=16,
                        axes_dims_rope=(4, 6, 6))
# sampling defaults: the pipeline's (50 steps, true_cfg_scale 4); text_params: Qwen2.5-VL-7B's
QWEN_IMAGE_MODELS = {
    "qwen-image": WrappedSpec("qwen-image", "qwenimage", None, QWEN_IMAGE,
                              dict(max_sequence_length=1024, steps=50, cfg_scale=4.0, text_params=8.29e9)),
    "qwen-image-debug": WrappedSpec("qwen-image-debug", "qwenimage", None, QWEN_IMAGE_DEBUG,
                                    dict(max_sequence_length=32, steps=20, cfg_scale=4.0, text_params=0)),
}
# Qwen-Image's scheduler settings: resolution-dependent shift between 0.5 and 0.9 up to 8,192 tokens, stretched to
# end at 0.02
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                 base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")


def _pipeline():
    from diffusers import QwenImagePipeline
    return QwenImagePipeline


def _pad_text(model, size: int) -> None:
    """Prompts of any length split evenly: the text tokens padded with masked ones (the pipeline trims its prompts
    to the batch's longest, e.g. 5 tokens)."""
    model.register_forward_pre_hook(masked_padding(size, "encoder_hidden_states", "encoder_hidden_states_mask"),
                                    with_kwargs=True)


class QwenImageGlue(ModelGlue):
    transformer_class = "QwenImageTransformer2DModel"
    pipeline_class = "QwenImagePipeline"
    scheduler_config = SCHEDULER
    vae_class = "AutoencoderKLQwenImage"
    vae_channels, vae_params = 16, 126.9e6  # about: its causal 3-D autoencoder
    models = QWEN_IMAGE_MODELS
    run_keys = ("in_channels", "out_channels")  # both from the latent channels
    parallel_plan = diffusers_plan(split=("image tokens", "text tokens and their mask (padded with masked ones to a "
                                          "multiple of the group)", "RoPE tables"), prepare=_pad_text)
    # attention of both streams and the image MLP; not the text stream's outputs (to_add_out, txt_mlp), which the
    # last block computes for nothing (its text tokens are dropped): adapters there would never get a gradient
    lora_targets = r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj)|img_mlp\.net\.(0\.proj|2))"
    recipe = ("diffusers' Qwen-Image DreamBooth LoRA example: x_t = (1 - t) x + t noise, target noise - x, plain MSE")

    def __call__(self, **config):
        model = super().__call__(**{**config, "out_channels": config["in_channels"] // 4})
        rope = model.pos_embed  # its frequency tables are plain tensors, not buffers: built on the meta device (a
        if rope.pos_freqs.is_meta:  # model a file fills), nothing would fill them; they are computed on the host
            with torch.device("cpu"):
                model.pos_embed = type(rope)(theta=rope.theta, axes_dim=rope.axes_dim, scale_rope=rope.scale_rope)
        return model

    def unused_parameters(self, model) -> list[str]:
        """The last block's text-stream outputs: its text tokens are dropped before the output layer."""
        return last_block_parameters(model, "transformer_blocks", ("attn.to_add_out", "txt_mlp"))

    def text_encoder(self, path, device, dtype, model) -> TextEncoder:
        encoder = load_text_encoder(path, device, dtype, self.models[model].constants["max_sequence_length"])
        encoder.pipeline = _pipeline()(None, None, encoder.model, encoder.tokenizer, None)  # runs its encoding
        return encoder

    def encode_prompts(self, encoder: TextEncoder, captions, device) -> dict:
        """The pipeline's own _get_qwen_prompt_embeds, padded to max_sequence_length, with the mask."""
        found, mask = encoder.pipeline._get_qwen_prompt_embeds(list(captions), device, dtype=torch.float32)
        length = encoder.max_length
        embeds = torch.zeros(len(found), length, found.shape[-1], device=device)
        padded = torch.zeros(len(found), length, dtype=torch.bool, device=device)
        embeds[:, :found.shape[1]], padded[:, :found.shape[1]] = found[:, :length], mask[:, :length].bool()
        return {"embeds": embeds * padded[..., None], "mask": padded}

    def random_conditions(self, spec, batch, device) -> dict:
        length, width = spec.constants["max_sequence_length"], spec.arch["joint_attention_dim"]
        return {"embeds": torch.randn(batch, length, width, device=device),
                "mask": torch.ones(batch, length, dtype=torch.bool, device=device)}

    def vae_geometry(self, vae) -> tuple[int, int]:
        if hasattr(vae, "temperal_downsample") and not hasattr(vae.config, "block_out_channels"):
            return 2 ** len(vae.temperal_downsample), vae.config.z_dim
        return super().vae_geometry(vae)

    def posterior(self, vae, images):
        """One frame through the causal 3-D autoencoder."""
        posterior = vae.encode(images.to(next(vae.parameters()).dtype)[:, :, None]).latent_dist
        return posterior.mean[:, :, 0].float(), posterior.std[:, :, 0].float()

    def to_model_space(self, vae, z):
        """(z - latents_mean) / latents_std per channel (the inverse of the pipeline's decoding), then 2x2 patches."""
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1).to(z)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1).to(z)
        return patchify((z - mean) / std)

    def forward_kwargs(self, model, x, t, cond, cfg) -> dict:
        b, _, h, w = x.shape
        return dict(hidden_states=pack(x), encoder_hidden_states=cond["embeds"],
                    encoder_hidden_states_mask=cond["mask"], timestep=t, img_shapes=[[(1, h, w)]] * b,
                    return_dict=False)

    def from_output(self, out, shape):
        b, c, h, w = shape
        return out.transpose(1, 2).reshape(b, c, h, w)

    def forward_macs(self, model, txt_tokens, img_tokens) -> int:
        """Each block's text-stream Linears (add_*_proj, to_add_out, txt_mlp) and txt_in cost txt_tokens * in * out,
        its image-stream ones (to_q/k/v, to_out, img_mlp), img_in and proj_out img_tokens, the modulations and time
        embedding one row; each block's joint attention 2 * L^2 * inner."""
        joint = txt_tokens + img_tokens

        def rows_of(name: str) -> int:
            if "_mod." in name or name.startswith(("time_text_embed", "norm_out")):
                return 1
            if name.startswith("txt_in") or any(p in name for p in (".add_", "to_add_out", "txt_mlp")):
                return txt_tokens
            return img_tokens
        return matmul_macs(model, rows_of) + len(model.transformer_blocks) * 2 * joint * joint * model.inner_dim

    def pipeline_latents(self, noise):
        return pack(noise)

    def pipeline_call(self, loaded, sample_cfg, cond, negative) -> dict:
        """The embeddings cut to the longest prompt of the batch, as the pipeline pads them itself."""
        def trimmed(c):
            n = int(c["mask"].sum(1).max())
            return c["embeds"][:, :n], c["mask"][:, :n].long()
        (embeds, mask), (neg, neg_mask) = trimmed(cond), trimmed(negative)
        return dict(prompt_embeds=embeds, prompt_embeds_mask=mask, negative_prompt_embeds=neg,
                    negative_prompt_embeds_mask=neg_mask, true_cfg_scale=sample_cfg.cfg_scale,
                    max_sequence_length=self.models[loaded.cfg.model].constants["max_sequence_length"])


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



if __name__ == "__main__":
    import sys
    print(save_tiny_qwen25vl(sys.argv[1]))  # python -m opendit.families.wrapped.qwenimage FOLDER
