"""Kandinsky 5.0 Image Lite (Kandinsky Lab's 6B text-to-image DiT) through diffusers' Kandinsky5Transformer3DModel and
Kandinsky5T2IPipeline: the video model's architecture (kandinsky5.py, whose feed it shares) on one frame.

Prompts are the pipeline's own encode_prompt: the prompt in its image-description system template through Qwen2.5-VL
(the template's first 40 tokens dropped) and CLIP ViT-L/14's pooled output; padded, masked and cut to a batch's longest
prompt as for the video model (diffusers' class takes no text mask). Images go through FLUX.1's AutoencoderKL (16
channels, 8x down), times its scaling_factor and not shifted: the pipeline decodes latents / scaling_factor alone, as
the official code does. The model takes them as one frame [B, 1, h, w, C] (no visual condition), with RoPE unscaled
(the pipeline's scale factor 1).

Training: Kandinsky 5's trainer is not public, so opendit follows the pipeline's parametrisation: x_t = (1 - t) x + t
noise, model time 1000 t, target noise - x, plain MSE. Sampling: the pipeline's Euler steps at the official image
pipeline's flow shift 3 (scheduler_scale) and its classifier-free guidance (--cfg_scale its guidance_scale, 1 off).
diffusers' pipeline replaces any size but its seven listed resolutions (1024x1024, 640x1408, ...) by the listed one
of the nearest aspect ratio, and takes 8 pixels per latent whatever the autoencoder: it is sampled through a subclass
(_sampling_pipeline) that keeps the run's size, reads the autoencoder's downsampling (FLUX.1's 8; 1 in pixel space)
and takes opendit's latents [B, C, h, w]; at the listed sizes with FLUX.1's autoencoder it is diffusers' own.

Sizes: "kandinsky5-t2i-lite" is the official configs/config_t2i.yaml (2560 wide, 2 text and 50 visual blocks of 20
heads of 128, feed-forward 10240), about 6.0B parameters, the architecture of Kandinsky-5.0-T2I-Lite-{sft,pretrain}-
Diffusers. Unsure: visual_cond False (the official config leaves it at its default) and attention_type "regular" as the
diffusers folders spell them. max_sequence_length 512 is the official image config's Qwen length (the pipeline's too).
No sequence parallelism, LoRA targets and official single files: as the video model's (kandinsky5.py).
"""
from opendit.families.wrapped.declared import Declared, Feed, Size
from opendit.families.wrapped.kandinsky5 import (CONDITIONS, DERIVED, KANDINSKY5_T2V_DEBUG, LORA_TARGETS, STREAMS, TEXT,
                                                 TEXT_PARAMS, call, channels_last, encode, forward_with, output,
                                                 repair_tables, to_model)

KANDINSKY5_T2I_LITE = dict(in_visual_dim=16, out_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=512,
                           patch_size=(1, 2, 2), model_dim=2560, ff_dim=10240, num_text_blocks=2, num_visual_blocks=50,
                           axes_dims=(32, 48, 48), visual_cond=False, attention_type="regular")
# the video debug model's size (64 wide, 2 + 2 blocks) on one frame
KANDINSKY5_T2I_DEBUG = dict(KANDINSKY5_T2V_DEBUG, visual_cond=False)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)  # the official image pipeline's scheduler_scale


def image_rope_scale(height: int, width: int) -> list:
    return [1.0, 1.0, 1.0]  # the image pipeline's, at every size


def _sampling_pipeline():
    """Kandinsky5T2IPipeline sampling the run's size with its autoencoder's downsampling, from opendit's latents (see
    the module's docstring)."""
    from diffusers import Kandinsky5T2IPipeline

    class Kandinsky5T2ISampling(Kandinsky5T2IPipeline):
        def __call__(self, *, latents, height, width, **kwargs):
            self.vae_scale_factor_spatial = 2 ** (len(self.vae.config.block_out_channels) - 1)
            if (width, height) not in self.resolutions:
                self.resolutions = [*self.resolutions, (width, height)]
            return super().__call__(latents=channels_last(latents), height=height, width=width, **kwargs)
    return Kandinsky5T2ISampling


# sampling defaults: the official image config's (50 steps, guidance 3.5)
MODEL = Declared(
    family="kandinsky5image", title="Kandinsky 5 (image)", transformer="Kandinsky5Transformer3DModel",
    pipeline="Kandinsky5T2IPipeline",
    models={"kandinsky5-t2i-lite": Size(KANDINSKY5_T2I_LITE, dict(max_sequence_length=512, steps=50, cfg_scale=3.5,
                                                                  text_params=TEXT_PARAMS)),
            "kandinsky5-t2i-debug": Size(KANDINSKY5_T2I_DEBUG, dict(max_sequence_length=16, steps=20, cfg_scale=3.5,
                                                                    text_params=0, tiny_text="kandinsky5"))},
    feed=Feed(encode, to_model, forward_with(image_rope_scale), call, output),
    text=TEXT, conditions=CONDITIONS, scheduler=SCHEDULER, vae_size=(16, 83_819_683),  # FLUX.1's autoencoder
    patch=2, outside_patch=1, packed_latents=False, derived=DERIVED, repair=repair_tables,
    sampling_pipeline=_sampling_pipeline, lora_targets=LORA_TARGETS,
    recipe=("the pipeline's parametrisation (the official trainer is not public): x_t = (1 - t) x + t noise, model "
            "time 1000 t, target noise - x, plain MSE"),
    streams=STREAMS,
)
