"""ERNIE-Image (Baidu, 2026: an 8B single-stream DiT, 36 blocks 4096 wide sharing one time modulation over the joint
sequence [image tokens; text tokens], 3-axis RoPE) through diffusers' own ErnieImageTransformer2DModel and
ErnieImagePipeline.

Prompts are the pipeline's own encode_prompt: each prompt tokenized alone (no template, no padding) and the hidden
states of its text encoder's second-to-last layer at the prompt's tokens (the release's Mistral3Model: Ministral 3
3B's text model, 3072 wide). opendit carries them padded to max_sequence_length with a bool mask, and gives the
forward text_lens = the mask's sum (what the pipeline's _pad_text gives it). The pipeline truncates a prompt only at
its tokenizer's model_max_length, which opendit sets to max_sequence_length; 1024 for the release is opendit's
choice (ERNIE-Image is prompted with long, dense descriptions), not the release's. Its prompt enhancer (pe) is not
used: prompts reach the pipeline as embeddings.

Images go through FLUX.2's AutoencoderKLFlux2 (32 channels, 8x down), are patched 2x2 (the pipeline's
_patchify_latents: 128 channels) and normalised by the VAE's batch-norm statistics, (z - mean) / sqrt(var + 1e-5):
the inverse of the pipeline's decoding, which uses 1e-5 (the value ERNIE-Image was trained with, its comment says)
rather than the VAE config's batch_norm_eps. The model takes them as a grid [B, 128, h, w] (its own patch is 1) and
returns a grid.

Time: the model sees 1000 sigma (the scheduler's timesteps, passed as they are) and predicts noise - x (the pipeline's
Euler step adds (sigma_next - sigma) times it). diffusers has no training example for ERNIE-Image and the official
repository (baidu/ERNIE-Image) only an inference demo, so training follows the pipeline's own parametrisation:
x_t = (1 - t) x + t noise, model time 1000 t, target noise - x, plain MSE. Sampling: the pipeline's linear sigmas
through FlowMatchEulerDiscreteScheduler with the release's static shift 4 (the sigmas that ports of the release
reproduce; its scheduler_config.json was not read here), and its classifier-free guidance (guidance_scale > 1:
uncond + g (cond - uncond), one call on [uncond; cond]): --cfg_scale is its guidance_scale.

Sizes: "ernie-image" is the release's transformer/config.json (36 blocks, 4096 wide, 32 heads, FFN 12288, text
3072 wide: 8.03B parameters), as ports of baidu/ERNIE-Image copy it (the class's defaults, 24 blocks 3072 wide over
2560-wide text, are not the release); "ernie-image-debug" is 64 wide with 2 blocks, over a tiny random Ministral 3.
Weights: diffusers folders, and single files of the original layout (diffusers' names under model.diffusion_model.,
which diffusers' convert_ernie_image_transformer_checkpoint_to_diffusers strips).

No sequence parallelism: diffusers gives the class no `_cp_plan`, and opendit has not written one (its layers take
the joint sequence first, [S, B, H], with the key mask and the time modulation expanded to every token, which a plan
would have to split, and pad to a multiple of the group, together).
"""
import torch

from opendit.families.wrapped.declared import Declared, Feed, Size, Streams

# the release's transformer/config.json (baidu/ERNIE-Image): 8.03B parameters
ERNIE_IMAGE = dict(hidden_size=4096, num_attention_heads=32, num_layers=36, ffn_hidden_size=12288, in_channels=128,
                   out_channels=128, patch_size=1, text_in_dim=3072, rope_theta=256, rope_axes_dim=(32, 48, 48),
                   eps=1e-6, qk_layernorm=True)
# the CPU-sized model of tests (64 wide, 2 blocks); a tiny Ministral 3 (16 wide) conditions it
ERNIE_IMAGE_DEBUG = dict(ERNIE_IMAGE, hidden_size=64, num_attention_heads=4, num_layers=2, ffn_hidden_size=192,
                         text_in_dim=16, rope_axes_dim=(4, 6, 6))
SCHEDULER = dict(num_train_timesteps=1000, shift=4.0, use_dynamic_shifting=False)
TIME_SCALE = 1000  # the model's time: the scheduler's timesteps, 1000 sigma
BATCH_NORM_EPS = 1e-5  # the pipeline decodes with it (the VAE config's batch_norm_eps is not what was trained)


def _pipeline():
    from diffusers import ErnieImagePipeline
    return ErnieImagePipeline


def encode(text, captions, device) -> dict:
    """The pipeline's own encode_prompt, padded to max_sequence_length, with the mask."""
    text.tokenizer.model_max_length = text.max_length  # where the pipeline's tokenizer call truncates
    found = text.pipeline.encode_prompt(captions, device)
    embeds = torch.zeros(len(found), text.max_length, found[0].shape[-1], device=device)
    mask = torch.zeros(len(found), text.max_length, dtype=torch.bool, device=device)
    for i, e in enumerate(found):
        embeds[i, :len(e)], mask[i, :len(e)] = e.float(), True
    return {"embeds": embeds, "mask": mask}


def _unpadded(cond: dict) -> list[torch.Tensor]:
    return [e[m] for e, m in zip(cond["embeds"], cond["mask"])]


def to_model(vae, z):
    """2x2 patches (the pipeline's _patchify_latents), then the VAE's batch-norm statistics: the inverse of the
    pipeline's decoding."""
    z = _pipeline()._patchify_latents(z)
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + BATCH_NORM_EPS).to(z)
    return (z - mean) / std


def forward(model, x, t, cond) -> dict:
    return dict(hidden_states=x, timestep=TIME_SCALE * t, text_bth=cond["embeds"], text_lens=cond["mask"].sum(1),
                return_dict=False)


def output(out, shape):
    return out  # already the grid [B, C, h, w]


def call(constants, sample_cfg, cond, negative) -> dict:
    """Each prompt's embedding at its own length: the pipeline pads them to the batch's longest itself."""
    return dict(prompt_embeds=_unpadded(cond), negative_prompt_embeds=_unpadded(negative),
                guidance_scale=sample_cfg.cfg_scale)


# sampling defaults: the pipeline's (50 steps, guidance_scale 4); text_params: Mistral3Model as the release loads it
# (Ministral 3 3B's text model and its Pixtral vision tower), about
MODEL = Declared(
    family="ernieimage", title="ERNIE-Image", transformer="ErnieImageTransformer2DModel",
    pipeline="ErnieImagePipeline",
    models={"ernie-image": Size(ERNIE_IMAGE, dict(max_sequence_length=1024, steps=50, cfg_scale=4.0,
                                                  text_params=3.85e9)),
            "ernie-image-debug": Size(ERNIE_IMAGE_DEBUG, dict(max_sequence_length=16, steps=20, cfg_scale=4.0,
                                                              text_params=0, tiny_text="ministral3"))},
    feed=Feed(encode, to_model, forward, call, output),
    text={"text_encoder": "text_encoder", "tokenizer": "tokenizer"},
    conditions={"embeds": ("L", "text_in_dim"), "mask": ("L",)},
    scheduler=SCHEDULER, vae="AutoencoderKLFlux2", vae_size=(32, 84_046_115),  # FLUX.2's autoencoder
    packed_latents=False,  # the pipeline takes its latents as a grid
    cfg_calls="batched",  # ErnieImagePipeline calls the model once on [uncond; cond]
    derived={"out_channels": lambda arch: arch["in_channels"]},  # both the run's latent channels
    # every Linear of the blocks, attention and MLP (what trainers that target the block class adapt)
    lora_targets=r"layers\.\d+\.(self_attention\.(to_[qkv]|to_out\.0)|mlp\.(gate_proj|up_proj|linear_fc2))",
    # single files of the original layout: diffusers' names under model.diffusion_model. (all diffusers' converter
    # does is strip it)
    official_key="model.diffusion_model.x_embedder.proj.weight",
    official_converter="convert_ernie_image_transformer_checkpoint_to_diffusers",
    recipe=("ErnieImagePipeline's own parametrisation: x_t = (1 - t) x + t noise, model time 1000 t, target "
            "noise - x, plain MSE"),
    # the shared modulation and the final norm's run once per sample, text_proj on the text tokens, the blocks and
    # the final Linear (its text rows dropped after) on the joint sequence, the patch embedding on the image's
    streams=Streams(one=r"^(time_embedding|adaLN_modulation|final_norm)", joint=r"^(layers|final_linear)",
                    text=r"^text_proj", attention={"layers": "joint"}, width=("hidden_size",)),
)
