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
import torch
import torch.nn.functional as F

from opendit.families.wrapped.context_parallel import diffusers_plan
from opendit.families.wrapped.declared import Declared, Feed, Size, Streams

Z_IMAGE = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
               n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0,
               t_scale=1000.0, axes_dims=(32, 48, 48), axes_lens=(1024, 512, 512))
# the CPU-sized model of tests (64 wide, 1 + 1 refiner and 2 main blocks); a tiny Qwen3 (16 wide) conditions it
Z_IMAGE_DEBUG = dict(Z_IMAGE, dim=64, n_layers=2, n_refiner_layers=1, n_heads=4, n_kv_heads=4, cap_feat_dim=16,
                     axes_dims=(4, 6, 6), axes_lens=(64, 32, 32))
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)  # Z-Image's scheduler_config


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


def encode(text, captions, device) -> dict:
    """The pipeline's own _encode_prompt, padded to max_sequence_length, with the mask."""
    found = text.pipeline._encode_prompt(captions, device=device, max_sequence_length=text.max_length)
    embeds = torch.zeros(len(found), text.max_length, found[0].shape[-1], device=device)
    mask = torch.zeros(len(found), text.max_length, dtype=torch.bool, device=device)
    for i, e in enumerate(found):
        embeds[i, :len(e)], mask[i, :len(e)] = e.float(), True
    return {"embeds": embeds, "mask": mask}


def to_model(vae, z):
    """(z - shift) * scale, the inverse of the pipeline's decoding (FLUX.1's autoencoder: it has a shift)."""
    if vae.config.shift_factor is None:
        raise ValueError("--vae: not Z-Image's autoencoder (FLUX.1's, with a shift_factor)")
    return (z - vae.config.shift_factor) * vae.config.scaling_factor


def forward(model, x, t, cond) -> dict:
    return dict(x=list(x.unsqueeze(2).unbind(0)), t=1 - t, cap_feats=_unpadded(cond), return_dict=False)


def output(out, shape):
    return -torch.stack(list(out)).squeeze(2)  # the model predicts x - noise


def call(constants, sample_cfg, cond, negative) -> dict:
    return dict(prompt_embeds=_unpadded(cond), negative_prompt_embeds=_unpadded(negative),
                guidance_scale=sample_cfg.cfg_scale - 1)


# sampling defaults: the pipeline's (50 steps, guidance_scale 5 = --cfg_scale 6); text_params: Qwen3-4B's
MODEL = Declared(
    family="zimage", title="Z-Image", transformer="ZImageTransformer2DModel", pipeline="ZImagePipeline",
    models={"z-image": Size(Z_IMAGE, dict(max_sequence_length=512, steps=50, cfg_scale=6.0, text_params=4.02e9)),
            "z-image-debug": Size(Z_IMAGE_DEBUG, dict(max_sequence_length=16, steps=20, cfg_scale=6.0, text_params=0,
                                                      tiny_text="qwen3"))},
    feed=Feed(encode, to_model, forward, call, output),
    text={"text_encoder": "text_encoder", "tokenizer": "tokenizer"},
    conditions={"embeds": ("L", "cap_feat_dim"), "mask": ("L",)},
    scheduler=SCHEDULER, vae_size=(16, 83_819_683),  # FLUX.1's autoencoder
    outside_patch=1, packed_latents=False,  # the model patches its latents itself
    cfg_calls="batched",  # ZImagePipeline calls the model once on the latents twice over, with both prompts
    lora_targets=(r"(noise_refiner|context_refiner|layers)\.\d+\."
                  r"(attention\.(to_[qkv]|to_out\.0)|feed_forward\.w[123])"),
    official_key=".attention.qkv.weight",  # the release's fused projections (diffusers splits them)
    official_converter="convert_z_image_transformer_checkpoint_to_diffusers",
    recipe=("Z-Image's flow as its pipeline runs it: x_s = (1 - s) x + s noise, model time 1 - s, target x - noise, "
            "plain MSE"),
    parallel_plan=diffusers_plan(split=("the main layers' joint sequence (image and caption tokens, padded to a "
                                        "multiple of the group) with its RoPE table and mask",),
                                 cp_plan=_context_parallel_plan, checked=(), prepare=_prepare_split),
    # the caption path runs on its tokens, the main layers on the joint sequence, the rest on the image's
    streams=Streams(one=r"adaLN_modulation|^t_embedder", joint=r"^layers", text=r"^(cap_embedder|context_refiner)",
                    attention={"noise_refiner": "image", "context_refiner": "text", "layers": "joint"},
                    width=("dim",)),
)
