"""Qwen-Image 2.1 through diffusers' own QwenImage21Transformer2DModel and QwenImage21Pipeline.

Qwen-Image 2.1 (Alibaba, 2026) is a single-stream transformer over one joint sequence: the prompt's tokens, then the
image's. Attention is block-causal (text tokens causal, the image block bidirectional and seeing all the text), and
with `causal_condition` the text is modulated from t = 0, the image from its own t. Prompts are the pipeline's own
_get_qwen_prompt_embeds: each prompt in its system template, read by Qwen3-VL (left-padded, the last decoder layer's
states before the final norm), the system turn dropped, padded on the right with a mask (to max_sequence_length
here, so caption dropout can swap rows; longer prompts are cut: the pipeline has no limit). The forward, and the
embeddings handed to the pipeline, are cut back to the batch's longest prompt, as the pipeline pads a batch: RoPE
places the image after every text position, padding included, so any other length would move the image. The model's
`img_mask` marks the joint sequence's image slots (one per 2x2 latent tokens): none among the text, then the
image's. Images go through its RGBA autoencoder (16x down, 64 channels; opendit's RGB images get an opaque alpha, as
the pipeline converts its images), normalised per channel by latents_mean and latents_std, and enter unpatched, one
token per latent position (an even number of rows and columns: --image_size a multiple of 32, of 2 in pixel space).
The model sees t itself (the pipeline passes its timestep / 1000, sigma) and returns the whole joint sequence; the
image's last tokens are the prediction of noise - x.

Training follows diffusers' Qwen-Image 2.1 DreamBooth LoRA example (train_dreambooth_lora_qwenimage21.py): RGBA
images, (z - latents_mean) / latents_std, x_t = (1 - t) x + t noise, timestep t, `img_mask` over [prompt, image
slots], prompts padded to the batch's longest, the prediction's image tail against noise - x, plain MSE (its
default weighting). Sampling goes through the pipeline (its key-value cache of the text; true classifier-free
guidance with --cfg_scale > 1, off by default as Qwen recommends) and gives its RGBA images.

Sizes: the release's transformer is the class's defaults (32 blocks of 32 heads x 128, SwiGLU 3x, Qwen3-VL-8B's
4,096-wide states, 64 latent channels: 7.1B parameters), which third-party ports' copies of the published config
repeat; its scheduler settings (Qwen-Image's resolution-dependent shift) are the least certain: diffusers' training
example says the shipped scheduler sets use_dynamic_shifting; the values are Qwen-Image's, as a third-party port's
copy of the release config has them.
No sequence parallelism: diffusers' class has no `_cp_plan` (its prefill attends segment by segment of the joint
sequence, which diffusers' context-parallel hooks do not split), and opendit has not written one.
"""
import torch

from opendit.families.wrapped.declared import Declared, Feed, Size, Streams, tokens_to_grid
from opendit.families.wrapped.glue import pack
from opendit.families.wrapped.qwenimage import SCHEDULER

QWEN_IMAGE21 = dict(patch_size=1, in_channels=64, out_channels=64, num_layers=32, attention_head_dim=128,
                    num_attention_heads=32, context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56),
                    causal_condition=True)
# the CPU-sized model of tests (64 wide, 2 blocks); a tiny random Qwen3-VL (16 wide) conditions it
QWEN_IMAGE21_DEBUG = dict(QWEN_IMAGE21, num_layers=2, attention_head_dim=16, num_attention_heads=4, context_in_dim=16,
                          axes_dims_rope=(4, 6, 6))


def encode(text, captions, device) -> dict:
    """The pipeline's own _get_qwen_prompt_embeds, padded to max_sequence_length, with the mask."""
    found, mask, _ = text.pipeline._get_qwen_prompt_embeds(captions, device=device)
    length = text.max_length
    embeds = torch.zeros(len(found), length, found.shape[-1], device=device)
    padded = torch.zeros(len(found), length, dtype=torch.bool, device=device)
    embeds[:, :found.shape[1]], padded[:, :found.shape[1]] = found[:, :length].float(), mask[:, :length].bool()
    return {"embeds": embeds * padded[..., None], "mask": padded}


def to_model(vae, z):
    """(z - latents_mean) / latents_std per channel, as the pipeline normalises image latents; no patches."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1).to(z)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1).to(z)
    return (z - mean) / std


def _batch_prompts(cond) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The embeddings and mask cut to the batch's longest prompt, as the pipeline pads a batch; no mask when none
    is padded (the pipeline's rule)."""
    n = int(cond["mask"].sum(1).max())
    embeds, mask = cond["embeds"][:, :n], cond["mask"][:, :n]
    return embeds, None if mask.all() else mask


def forward(model, x, t, cond) -> dict:
    b, _, h, w = x.shape
    if h % 2 or w % 2:
        raise ValueError(f"Qwen-Image 2.1 takes latents of an even number of rows and columns (given {h}x{w}): "
                         f"each image slot of its sequence stands for 2x2 latent tokens; use an --image_size that "
                         f"is a multiple of twice the VAE's downsampling (32; 2 in pixel space)")
    embeds, mask = _batch_prompts(cond)
    image_slots = torch.cat([torch.zeros(b, embeds.shape[1], dtype=torch.bool, device=x.device),
                             torch.ones(b, h * w // 4, dtype=torch.bool, device=x.device)], dim=1)
    return dict(hidden_states=pack(x), encoder_hidden_states=embeds, encoder_hidden_states_mask=mask, timestep=t,
                img_shapes=[[(1, h, w)]] * b, img_mask=image_slots, return_dict=False)


def output(out, shape):
    """The joint sequence's last h * w tokens (the image's) back to the grid."""
    return tokens_to_grid(out[:, -shape[-2] * shape[-1]:], shape)


def call(constants, sample_cfg, cond, negative) -> dict:
    """The negative prompt only where --cfg_scale guides (the pipeline warns of one it would not use)."""
    embeds, mask = _batch_prompts(cond)
    guided = {}
    if sample_cfg.cfg_scale > 1:
        guided = dict(zip(("negative_prompt_embeds", "negative_prompt_embeds_mask"), _batch_prompts(negative)))
    return dict(prompt_embeds=embeds, prompt_embeds_mask=mask, true_cfg_scale=sample_cfg.cfg_scale, **guided)


def make_pipeline(pipeline_class, components: dict):
    """QwenImage21Pipeline from opendit's components. To encode prompts (a text encoder and its tokenizer): with the
    processor of the folder the tokenizer came from (a Qwen-Image 2.1 pipeline folder's processor/), which formats
    and tokenizes them. To sample (prompts given as embeddings): without one, which diffusers' constructor cannot do
    (it reads the processor's chat template at once), and with the VAE's own downsampling where diffusers' fixes 16
    (16 for the release's VAE; pixel space's 1); its __call__ is diffusers'."""
    if components.get("tokenizer") is not None:
        return pipeline_class(scheduler=None, vae=None, text_encoder=components["text_encoder"],
                              processor=_processor(components["tokenizer"]), transformer=None)
    return _from_embeddings(pipeline_class)(**components)


def _processor(tokenizer):
    from transformers import AutoProcessor
    found = AutoProcessor.from_pretrained(tokenizer.name_or_path)
    if not hasattr(found, "tokenizer"):
        raise ValueError(f"--text_encoder: {tokenizer.name_or_path} holds a tokenizer but no processor; Qwen-Image "
                         f"2.1's pipeline takes Qwen3-VL's processor (its pipeline folder's processor/; for "
                         f"qwen-image-2.1-debug: python -m opendit.families.wrapped.tiny_text qwen-image-2.1-debug "
                         f"DIR)")
    return found


def _from_embeddings(pipeline_class):
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

    class QwenImage21FromEmbeddings(pipeline_class):
        def __init__(self, scheduler, vae, transformer, text_encoder=None, processor=None, sample_sigmas=None):
            DiffusionPipeline.__init__(self)
            self.register_modules(vae=vae, text_encoder=text_encoder, processor=processor, transformer=transformer,
                                  scheduler=scheduler)
            self.register_to_config(sample_sigmas=sample_sigmas)
            self.vae_scale_factor = 2 ** len(vae.temperal_downsample)
            self.latent_channels = vae.config.z_dim
            self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor,
                                                     vae_latent_channels=self.latent_channels)
    return QwenImage21FromEmbeddings


def _repair_tables(model):
    """Its RoPE tables (plain tensors) and its time embedding's frequencies (a non-persistent buffer) are computed at
    construction: built on the meta device (a model a file fills), nothing would fill them; they are computed on
    the host."""
    rope, time = model.pos_embed, model.time_text_embed.time_proj
    with torch.device("cpu"):
        if rope.freqs[0].is_meta:
            model.pos_embed = type(rope)(theta=rope.theta, axes_dim=rope.axes_dim)
        if time.freqs.is_meta:
            model.time_text_embed.time_proj = type(time)(time.timestep_dim, time_factor=time.time_factor)
    return model


def _block_causal_macs(model, txt_tokens: int, img_tokens: int) -> int:
    """One block's attention: the text causal over itself (computed whole, masked), the image over everything."""
    width = model.config.num_attention_heads * model.config.attention_head_dim
    return 2 * width * (txt_tokens ** 2 + img_tokens * (txt_tokens + img_tokens))


# sampling defaults: Qwen's (40 steps, no guidance); text_params: Qwen3-VL-8B's
MODEL = Declared(
    family="qwenimage21", title="Qwen-Image 2.1", transformer="QwenImage21Transformer2DModel",
    pipeline="QwenImage21Pipeline",
    models={"qwen-image-2.1": Size(QWEN_IMAGE21, dict(max_sequence_length=1024, steps=40, cfg_scale=1.0,
                                                      text_params=8.77e9)),
            "qwen-image-2.1-debug": Size(QWEN_IMAGE21_DEBUG, dict(max_sequence_length=32, steps=20, cfg_scale=1.0,
                                                                  text_params=0, tiny_text="qwen-image-2.1"))},
    feed=Feed(encode, to_model, forward, call, output), make_pipeline=make_pipeline, repair=_repair_tables,
    # the tokenizer of its processor/ (the pipeline's processor is read from that folder: make_pipeline)
    text={"text_encoder": "text_encoder", "tokenizer": "processor"},
    conditions={"embeds": ("L", "context_in_dim"), "mask": ("L",)},
    scheduler=SCHEDULER, vae="AutoencoderKLQwenImage21", vae_kind="frame", vae_size=(64, 337.7e6), vae_downsampling=16,
    patch=1, outside_patch=1,
    derived={"out_channels": lambda arch: arch["in_channels"]},  # the latent channels, in and out
    # every block's attention and SwiGLU Linears (diffusers' names), as peer trainers adapt Qwen-Image's (diffusers'
    # example adapts the attention's alone by default)
    lora_targets=r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|to_out\.0)|img_mlp\.(proj|gate_layer|out))",
    # ComfyUI's single file (diffusers' names, the SwiGLU's gate and up projections fused, gate rows first)
    official_key="transformer_blocks.0.img_mlp.gate_up.weight",
    official_converter="convert_qwen_image21_transformer_checkpoint_to_diffusers",
    recipe=("diffusers' Qwen-Image 2.1 DreamBooth LoRA example: x_t = (1 - t) x + t noise, target noise - x on the "
            "image tokens, plain MSE, prompts padded to the batch's longest"),
    # one joint sequence: the blocks and the output projection run on text + image tokens (the text counted at
    # max_sequence_length, a bound: the forward cuts it to the batch's longest prompt); the time embedding and the
    # shared modulation on each sample's t and once more on the t = 0 of its text (causal_condition)
    streams=Streams(rows={r"^(time_text_embed|modulation|norm_out)\.": lambda model: 1 + model.config.causal_condition},
                    joint=r"^(transformer_blocks|proj_out)", text=r"^txt_in",
                    attention={"transformer_blocks": _block_causal_macs}),
)
