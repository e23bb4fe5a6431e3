"""Z-Image through diffusers' own ZImageTransformer2DModel and ZImagePipeline.

Its prompt embedding is the pipeline's: each prompt in Qwen3's chat template, the hidden states of Qwen3's
second-to-last layer at the prompt's own tokens (no padding: each prompt its own length; opendit carries them
padded with a mask). Images go through FLUX.1's 16-channel AutoencoderKL, (z - shift) * scale; the model patches
2x2 itself and takes one latent [C, 1, h, w] per sample.

Z-Image's time runs the other way: the model sees 1 - sigma (the pipeline passes (1000 - t) / 1000) and predicts
x - noise (the pipeline negates its output before the Euler step). Training follows that: x_s = (1 - s) x + s noise,
model time 1 - s, target x - noise, plain MSE (the loss of Z-Image's training code as diffusers' pipeline implies
it; the velocity opendit computes is the negated output). --cfg_scale keeps opendit's convention (1: off); the
pipeline's guidance_scale is cfg_scale - 1 (its 0 is off): pos + g (pos - neg) = neg + cfg_scale (pos - neg).

Sequence parallelism (diffusers' class has no context-parallel plan; opendit gives it one): the main layers' joint
sequence [image tokens, caption tokens] is split, with its RoPE table and mask, and gathered after the final layer;
the refiners (one or two blocks each, before the joint sequence is built) run whole on every rank. The joint
sequence is padded with masked tokens to a length the group divides (Z-Image pads each part to 32 tokens, so
groups of 2, 4, ... need none); unpatchify reads only the image tokens.
"""
import types

import torch
import torch.nn.functional as F

from opendit.families.wrapped.context_parallel import diffusers_plan
from opendit.families.wrapped.glue import ModelGlue, TextEncoder, WrappedSpec, load_text_encoder
from opendit.perf import matmul_macs

Z_IMAGE = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
               n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0,
               t_scale=1000.0, axes_dims=(32, 48, 48), axes_lens=(1024, 512, 512))
# the CPU-sized model of tests (64 wide, 1 + 1 refiner and 2 main blocks); a tiny Qwen3 (16 wide) conditions it
Z_IMAGE_DEBUG = dict(Z_IMAGE, dim=64, n_layers=2, n_refiner_layers=1, n_heads=4, n_kv_heads=4, cap_feat_dim=16,
                     axes_dims=(4, 6, 6), axes_lens=(64, 32, 32))
# sampling defaults: the pipeline's (50 steps, guidance_scale 5 = --cfg_scale 6); text_params: Qwen3-4B's
ZIMAGE_MODELS = {
    "z-image": WrappedSpec("z-image", "zimage", None, Z_IMAGE,
                           dict(max_sequence_length=512, steps=50, cfg_scale=6.0, text_params=4.02e9)),
    "z-image-debug": WrappedSpec("z-image-debug", "zimage", None, Z_IMAGE_DEBUG,
                                 dict(max_sequence_length=16, steps=20, cfg_scale=6.0, text_params=0)),
}
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)  # Z-Image's scheduler_config


def _pipeline():
    from diffusers import ZImagePipeline
    return ZImagePipeline


def _context_parallel_plan() -> dict:
    from diffusers.models._modeling_parallel import ContextParallelInput as Split
    from diffusers.models._modeling_parallel import ContextParallelOutput as Gather
    return {"layers.0": {"x": Split(split_dim=1, expected_dims=3)},
            "layers.*": {"attn_mask": Split(split_dim=1, expected_dims=2),
                         "freqs_cis": Split(split_dim=1, expected_dims=3)},
            "all_final_layer.2-1": Gather(gather_dim=1, expected_dims=3)}  # the pipeline's patch sizes (2, 1)


def _prepare_split(model, size: int) -> None:
    """The refiners attend whole on every rank; each main layer's joint sequence (x, its mask and RoPE table, the
    forward's positional arguments) is padded with masked tokens to a multiple of `size` before the plan splits it."""
    for block in (*model.noise_refiner, *model.context_refiner):
        block.attention.processor._parallel_config = None

    def pad(layer, args):
        x, mask, freqs = args[:3]
        extra = -freqs.shape[1] % size
        if not extra:
            return None
        if x.shape[1] == freqs.shape[1]:  # the first layer's x is whole yet; the next ones get it split
            x = F.pad(x, (0, 0, 0, extra))
        if mask is None:
            mask = torch.ones(freqs.shape[:2], dtype=torch.bool, device=freqs.device)
        return (x, F.pad(mask, (0, extra), value=False), F.pad(freqs, (0, 0, 0, extra)), *args[3:])
    for layer in model.layers:
        layer.register_forward_pre_hook(pad)


def _unpadded(cond: dict) -> list[torch.Tensor]:
    return [e[m] for e, m in zip(cond["embeds"], cond["mask"])]


class ZImageGlue(ModelGlue):
    transformer_class = "ZImageTransformer2DModel"
    pipeline_class = "ZImagePipeline"
    scheduler_config = SCHEDULER
    vae_channels, vae_params = 16, 83_819_683  # FLUX.1's autoencoder
    outside_patch = 1  # the model patches its latents itself
    models = ZIMAGE_MODELS
    lora_targets = (r"(noise_refiner|context_refiner|layers)\.\d+\."
                    r"(attention\.(to_[qkv]|to_out\.0)|feed_forward\.w[123])")
    official_key = ".attention.qkv.weight"  # the release's fused projections (diffusers splits them)
    official_converter = "convert_z_image_transformer_checkpoint_to_diffusers"
    recipe = ("Z-Image's flow as its pipeline runs it: x_s = (1 - s) x + s noise, model time 1 - s, target x - noise, "
              "plain MSE")
    parallel_plan = diffusers_plan(split=("the main layers' joint sequence (image and caption tokens, padded to a "
                                          "multiple of the group) with its RoPE table and mask",),
                                   cp_plan=_context_parallel_plan, checked=(), prepare=_prepare_split)

    def cfg_calls(self, model: str) -> str:
        return "batched"  # ZImagePipeline calls the model once on the latents twice over, with both prompts

    def text_encoder(self, path, device, dtype, model) -> TextEncoder:
        return load_text_encoder(path, device, dtype, self.models[model].constants["max_sequence_length"])

    def encode_prompts(self, encoder: TextEncoder, captions, device) -> dict:
        """The pipeline's own _encode_prompt (run on a stand-in holding our encoder), padded to max_sequence_length,
        with the mask."""
        stand_in = types.SimpleNamespace(tokenizer=encoder.tokenizer, text_encoder=encoder.model)
        found = _pipeline()._encode_prompt(stand_in, list(captions), device=device,
                                           max_sequence_length=encoder.max_length)
        length = encoder.max_length  # every caption's conditions one shape (caption dropout swaps them)
        embeds = torch.zeros(len(found), length, found[0].shape[-1], device=device)
        mask = torch.zeros(len(found), length, dtype=torch.bool, device=device)
        for i, e in enumerate(found):
            embeds[i, :len(e)], mask[i, :len(e)] = e.float(), True
        return {"embeds": embeds, "mask": mask}

    def random_conditions(self, spec, batch, device) -> dict:
        length, width = spec.constants["max_sequence_length"], spec.arch["cap_feat_dim"]
        return {"embeds": torch.randn(batch, length, width, device=device),
                "mask": torch.ones(batch, length, dtype=torch.bool, device=device)}

    def load_vae(self, path, device):
        vae = super().load_vae(path, device)
        if vae.config.shift_factor is None:
            raise ValueError(f"--vae {path}: not Z-Image's autoencoder (FLUX.1's, with a shift_factor)")
        return vae

    def to_model_space(self, vae, z):
        """(z - shift) * scale, the inverse of the pipeline's decoding."""
        return (z - vae.config.shift_factor) * vae.config.scaling_factor

    def forward_kwargs(self, model, x, t, cond, cfg) -> dict:
        return dict(x=list(x.unsqueeze(2).unbind(0)), t=1 - t, cap_feats=_unpadded(cond), return_dict=False)

    def from_output(self, out, shape):
        return -torch.stack(list(out)).squeeze(2)  # the model predicts x - noise

    def forward_macs(self, model, txt_tokens, img_tokens) -> int:
        """A Linear of the caption path (cap_embedder, the context refiner) costs txt_tokens * in * out, of the main
        layers the joint sequence's, of the time embedding and modulations one row, of the rest (x_embedder, the
        noise refiner, the final layer) img_tokens; each block's attention 2 * L^2 * dim over its own sequence."""
        joint = txt_tokens + img_tokens

        def rows_of(name: str) -> int:
            if "adaLN_modulation" in name or name.startswith("t_embedder"):
                return 1
            if name.startswith(("cap_embedder", "context_refiner")):
                return txt_tokens
            return joint if name.startswith("layers") else img_tokens
        attention = (len(model.noise_refiner) * img_tokens ** 2 + len(model.context_refiner) * txt_tokens ** 2
                     + len(model.layers) * joint ** 2)
        return matmul_macs(model, rows_of) + 2 * attention * model.dim

    def pipeline_call(self, loaded, sample_cfg, cond, negative) -> dict:
        return dict(prompt_embeds=_unpadded(cond), negative_prompt_embeds=_unpadded(negative),
                    guidance_scale=sample_cfg.cfg_scale - 1)
