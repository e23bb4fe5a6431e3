"""Ideogram 4 (Ideogram's 2026 text-to-image model, open weights) through diffusers' own Ideogram4Transformer2DModel
and Ideogram4Pipeline.

The model is one stream: each sample is a single packed sequence [left padding][text tokens][image tokens], every
token tagged by an indicator (text, image or padding), attention kept within a sample by segment ids (padding is a
segment of its own, so it never reaches the prompt or the image) and placed by 3-axis MRoPE position ids (text at
0..n-1 on all three axes, image tokens on (0, row, column) shifted by 65,536). Prompts are the pipeline's own
encode_prompt: the prompt in Qwen3-VL's chat template, left-padded to max_sequence_length, the hidden states of 13 of
Qwen3-VL-8B's 36 decoder layers (0, 3, ..., 33, 35) stacked per token (13 x 4096 = llm_features_dim 53,248), padding
zeroed; opendit keeps them with the text tokens as a bool mask. The packed sequence is the pipeline's own
_prepare_ids, built from each prompt's text length and the image grid; the text features run the whole sequence
(zeros at the image tokens), as the pipeline feeds them. A prompt longer than max_sequence_length is an error, as in
the pipeline (it does not truncate). The empty caption is no text at all: the input of the pipeline's unconditional
pass (the image tokens alone, text features zeroed), which caption dropout then trains.

Images go through AutoencoderKLFlux2 (32 channels, 8x down), patched 2x2 into 128 channels in the order the
pipeline unpatches them ((dy, dx, c), not FLUX.2's (c, dy, dx)) and normalised by the VAE's batch-norm statistics,
the inverse of the pipeline's decoding. The statistics are read in that order, so --vae must be Ideogram 4's own
vae/ folder, not FLUX.2's (the two may share weights; whether their statistics agree is not known here; ai-toolkit
encodes training images with the release's autoencoder, so it has an encoder). The model's time runs the other way:
0 is noise, 1 is data (the pipeline passes 1 - sigma) and it predicts the velocity x - noise (the pipeline negates it
before the Euler step).

Training follows the pipeline's own parametrisation (diffusers has no Ideogram 4 training example and Ideogram's
trainer is not public): x_s = (1 - s) x + s noise, the model sees 1 - s and its image tokens' output is taken as
x - noise (opendit's velocity is its negation), plain MSE; the text region of the sequence is input only. ai-toolkit's
Ideogram 4 trainer takes the same target. Its time density is --timestep_sampling; the pipeline samples on a
logit-normal schedule (std 1.5, its mean shifted by resolution), which hints at, but does not tell, the release's.

Sampling: the pipeline takes prompt strings alone (no prompt_embeds), so opendit samples through a subclass that is
handed the feed's conditions where the pipeline would encode the strings, and otherwise runs the pipeline's own
__call__ (its logit-normal schedule, packing, guidance and decoding); the tests check its images equal the pipeline's
own, bitwise. The release guides asymmetrically: a second, separately trained unconditional transformer denoises
the image tokens alone, v = g v_cond + (1 - g) v_uncond. opendit trains one transformer, which caption dropout
teaches that unconditional pass too, and gives it to the pipeline as both (--cfg_scale is g; 1: off). Fine-tuning
the release, its unconditional transformer is not used: guidance is against the trained model itself, as good as
its caption dropout made it. There is no negative prompt (a non-empty --negative_prompt is refused). The release's
recommended guidance (7 for 45 steps, then 3 for the last 3) is one constant --cfg_scale here.

Not split across ranks: diffusers gives the class no context-parallel plan (`_cp_plan`); its attention takes a
dense [B, 1, S, S] mask built from the segment ids. --cfg_parallel does not apply either: the conditional and
unconditional calls differ in length. No official single-file converter exists in diffusers, so only diffusers
folders load.
"""
import functools

import torch

from opendit.families.wrapped.declared import Declared, Feed, Size, Streams, tokens_to_grid
from opendit.families.wrapped.glue import pack

# the release: the class's defaults (34 blocks 4,608 wide, 9.28B parameters), from which ai-toolkit builds the
# released weights too; the published config.json could not be read here
IDEOGRAM4 = dict(in_channels=128, num_layers=34, attention_head_dim=256, num_attention_heads=18,
                 intermediate_size=12288, adaln_dim=512, llm_features_dim=53248, rope_theta=5_000_000,
                 mrope_section=(24, 20, 20), norm_eps=1e-5)
# the CPU-sized model of tests (64 wide, 2 blocks); a tiny Qwen3-VL (16 wide, 36 layers: the pipeline taps layer 35)
# conditions it, 13 x 16 = 208 features per token
IDEOGRAM4_DEBUG = dict(IDEOGRAM4, num_layers=2, attention_head_dim=16, num_attention_heads=4, intermediate_size=128,
                       adaln_dim=32, llm_features_dim=208, mrope_section=(2, 1, 1))
# the pipeline sets its own sigmas (a resolution-aware logit-normal schedule), so the scheduler only steps: no shift
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)


def encode(text, captions, device) -> dict:
    """The pipeline's own encode_prompt (left-padded, 13 layers stacked), its text tokens as the mask; the empty
    caption is no text (the unconditional pass's input), so the encoder never sees it."""
    from diffusers.models.transformers.transformer_ideogram4 import LLM_TOKEN_INDICATOR
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import QWEN3_VL_ACTIVATION_LAYERS
    width = len(QWEN3_VL_ACTIVATION_LAYERS) * text.model.config.text_config.hidden_size
    embeds = torch.zeros(len(captions), text.max_length, width, device=device)
    mask = torch.zeros(len(captions), text.max_length, dtype=torch.bool, device=device)
    given = [i for i, caption in enumerate(captions) if caption]
    if given:
        found, _, _, indicator = text.pipeline.encode_prompt([captions[i] for i in given], grid_h=0, grid_w=0,
                                                             max_sequence_length=text.max_length, device=device)
        embeds[given], mask[given] = found.float(), indicator == LLM_TOKEN_INDICATOR
    return {"embeds": embeds, "mask": mask}


def to_model(vae, z):
    """2x2 patches with channels (dy, dx, c), normalised by the VAE's batch-norm statistics: the inverse of the
    pipeline's decoding."""
    b, c, h, w = z.shape
    patched = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1).reshape(b, h // 2, w // 2, 4 * c)
    mean = vae.bn.running_mean.to(z)
    std = torch.sqrt(vae.bn.running_var + vae.config.batch_norm_eps).to(z)
    return ((patched - mean) / std).permute(0, 3, 1, 2)


def packed_sequence(cond: dict, grid_h: int, grid_w: int) -> tuple[torch.Tensor, ...]:
    """The pipeline's packed conditioning for the prompts of `cond` and a grid_h x grid_w image: the text features
    followed by the image tokens' zeros, and the pipeline's own position ids, segment ids and indicator
    (_prepare_ids, from each prompt's text length)."""
    from diffusers import Ideogram4Pipeline
    embeds, mask = cond["embeds"], cond["mask"]
    ids = Ideogram4Pipeline._prepare_ids(mask.sum(1).tolist(), grid_h, grid_w, mask.shape[1], mask.device)
    image = embeds.new_zeros(len(embeds), grid_h * grid_w, embeds.shape[-1])
    return (torch.cat([embeds, image], 1), *ids)


def forward(model, x, t, cond) -> dict:
    b, c, h, w = x.shape
    features, position_ids, segment_ids, indicator = packed_sequence(cond, h, w)
    text_region = x.new_zeros(b, cond["mask"].shape[1], c)  # the pipeline's zeros before the image tokens
    return dict(hidden_states=torch.cat([text_region, pack(x)], 1), timestep=1 - t, encoder_hidden_states=features,
                position_ids=position_ids, segment_ids=segment_ids, indicator=indicator, return_dict=False)


def output(out, shape):
    """The image tokens' output (the last h * w), negated: the model predicts x - noise."""
    return -tokens_to_grid(out[:, -shape[2] * shape[3]:], shape)


def call(constants, sample_cfg, cond, negative) -> dict:
    if negative["mask"].any():
        raise ValueError("--negative_prompt: Ideogram4Pipeline guides against no text at all (its unconditional "
                         "pass sees the image tokens alone) and takes no negative prompt; leave it out")
    return dict(conditions=cond, guidance_scale=sample_cfg.cfg_scale, guidance_schedule=None,
                max_sequence_length=cond["mask"].shape[1])


@functools.cache
def sampling_pipeline():
    """Ideogram4Pipeline handed its prompts' conditions (the feed's, made by its own encode_prompt) where diffusers'
    takes prompt strings alone, with one transformer for its conditional and unconditional passes; the rest is the
    pipeline's own __call__. Built on first use, so that opendit imports diffusers only to sample."""
    from diffusers import Ideogram4Pipeline

    class Ideogram4FromConditions(Ideogram4Pipeline):
        def __init__(self, scheduler, vae, text_encoder, tokenizer, transformer, unconditional_transformer=None,
                     prompt_enhancer_head=None):
            super().__init__(scheduler, vae, text_encoder, tokenizer, transformer,
                             unconditional_transformer or transformer, prompt_enhancer_head)
            self.conditions = None

        def __call__(self, conditions: dict, **kwargs):
            """The pipeline's __call__ for the prompts whose conditions (embeds, mask) are given."""
            self.conditions = conditions
            try:
                return super().__call__(prompt=[""] * len(conditions["mask"]), **kwargs)
            finally:
                self.conditions = None

        def encode_prompt(self, prompt, grid_h, grid_w, max_sequence_length, device):
            return tuple(v.to(device) for v in packed_sequence(self.conditions, grid_h, grid_w))

    return Ideogram4FromConditions


def _float32_frequencies(rope, base: float) -> torch.Tensor:
    """The MRoPE frequencies of `rope` (its head width, sections and `base`) as its class computes them, on the
    host, in float32."""
    with torch.device("cpu"):
        return type(rope)(head_dim=rope.head_dim, base=base, mrope_section=rope.mrope_section).inv_freq


def _keep_float32(rope, args, base: float) -> None:
    """A forward pre-hook: frequencies a cast of the model (sampling in bf16) rounded are computed again in float32,
    as diffusers' from_pretrained keeps them; image positions start at 65,536, where bf16 frequencies would misplace
    the image against the prompt."""
    if rope.inv_freq.dtype != torch.float32:
        rope.inv_freq = _float32_frequencies(rope, base).to(rope.inv_freq.device)


def _repair_rope(model):
    """Its MRoPE frequencies are a non-persistent buffer computed at construction: built on the meta device (a
    model a file fills), nothing would fill them; they are computed on the host, and kept float32 (_keep_float32)."""
    base = model.config.rope_theta
    if model.rotary_emb.inv_freq.is_meta:
        model.rotary_emb.inv_freq = _float32_frequencies(model.rotary_emb, base)
    model.rotary_emb.register_forward_pre_hook(functools.partial(_keep_float32, base=base))
    return model


# sampling defaults: the pipeline's (48 steps, guidance 7, 2,048 text tokens); text_params: Qwen3-VL-8B without its
# LM head (about)
MODEL = Declared(
    family="ideogram4", title="Ideogram 4", transformer="Ideogram4Transformer2DModel", pipeline="Ideogram4Pipeline",
    models={"ideogram4": Size(IDEOGRAM4, dict(max_sequence_length=2048, steps=48, cfg_scale=7.0, text_params=8.15e9)),
            "ideogram4-debug": Size(IDEOGRAM4_DEBUG, dict(max_sequence_length=24, steps=20, cfg_scale=4.0,
                                                          text_params=0, tiny_text="qwen3-vl"))},
    feed=Feed(encode, to_model, forward, call, output), repair=_repair_rope, sampling_pipeline=sampling_pipeline,
    text={"text_encoder": "text_encoder", "tokenizer": "tokenizer"},
    conditions={"embeds": ("L", "llm_features_dim"), "mask": ("L",)},
    scheduler=SCHEDULER, vae="AutoencoderKLFlux2", vae_size=(32, 84e6),  # FLUX.2's autoencoder class
    cfg_calls=None, no_cfg_pair="its conditional and unconditional passes differ in length (the latter has no text)",
    # attention and SwiGLU Linears of every block (diffusers' names), as ai-toolkit's Ideogram 4 LoRAs hold them
    # (its fused attention.qkv is diffusers' to_q, to_k, to_v)
    lora_targets=r"layers\.\d+\.(attention\.(to_[qkv]|to_out\.0)|feed_forward\.w[123])",
    recipe=("the pipeline's own parametrisation: x_s = (1 - s) x + s noise, model time 1 - s, target x - noise on "
            "the image tokens, plain MSE; the empty caption is no text (the unconditional pass)"),
    # one packed sequence: every token-wise Linear runs on text + image tokens, the modulations once per sample
    streams=Streams(one=r"adaln|^t_embedding", joint=r"^(input_proj|llm_cond_proj|layers|final_layer)",
                    attention={"layers": "joint"}),
)
