"""Qwen-Image through diffusers' own QwenImageTransformer2DModel and QwenImagePipeline.

Its prompt embedding is the pipeline's: each prompt in Qwen-Image's system template, the last hidden states of
Qwen2.5-VL at the prompt's own tokens (the template's first 34 tokens dropped), padded with a mask. Images go through
its causal 3-D autoencoder (one frame; 16 channels, 8x down), normalised per channel by the VAE's latents_mean and
latents_std, patched 2x2 (64 channels) and packed into tokens; the model's RoPE takes the grid from `img_shapes`.

Training follows diffusers' Qwen-Image DreamBooth LoRA example (train_dreambooth_lora_qwen_image.py): x_t = (1 - t) x +
t noise, the model sees t (the pipeline passes sigma) and predicts noise - x, plain MSE. Sampling
goes through the pipeline's true classifier-free guidance (--cfg_scale is its true_cfg_scale; 1: off), which
rescales the guided prediction to the conditional one's norm.

Qwen-Image-Edit-2509 and -2511 (the edit models) edit with up to 3 reference images through QwenImageEditPlusPipeline
and train on editing pairs as musubi-tuner and DiffSynth-Studio train them, in the pipeline's own shapes: each
reference is shown twice. To Qwen2.5-VL, resized to the pipeline's condition area (384 x 384, its aspect kept): the
prompt is the instruction after "Picture 1: <image> ..." in the edit template, so the prompt embedding carries the
references' vision tokens (caption dropout drops the instruction, not the pictures). To the VAE, resized to the
pipeline's reference area (1024 x 1024, its aspect kept): its latents (the posterior's mode), normalised and packed as
the target's, join the image tokens after the target's without noise (2511: at time 0, its zero_cond_t), their grids
in img_shapes; the loss covers the target's tokens. Its pipeline samples one prompt per call.
"""
import functools
import inspect
from pathlib import Path

import torch

from opendit.families.wrapped.context_parallel import diffusers_plan, masked_padding
from opendit.families.wrapped.references import image_of_the_set
from opendit.families.wrapped.declared import Declared, Feed, Size, Streams, _construct
from opendit.families.wrapped.glue import pack, patchify

QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
# the CPU-sized model of tests (64 wide, 2 blocks); a tiny random Qwen2.5-VL (16 wide) conditions it
QWEN_IMAGE_DEBUG = dict(QWEN_IMAGE, num_layers=2, attention_head_dim=16, num_attention_heads=4, joint_attention_dim=16,
                        axes_dims_rope=(4, 6, 6))
# the edit models: Qwen-Image's architecture; 2511 gives the reference tokens time 0 (zero_cond_t)
QWEN_IMAGE_EDIT_2511 = dict(QWEN_IMAGE, zero_cond_t=True)
QWEN_IMAGE_EDIT_DEBUG = dict(QWEN_IMAGE_DEBUG, zero_cond_t=True)
# QwenImageEditPlusPipeline; up to 3 references: the model cards' "optimal with 1 to 3 input images"
EDIT = dict(pipeline="QwenImageEditPlusPipeline", references=3, steps=50, cfg_scale=4.0)
# Qwen-Image's scheduler settings: resolution-dependent shift between 0.5 and 0.9 up to 8,192 tokens, stretched to
# end at 0.02
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                 base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")


def _pad_text(model, size: int) -> None:
    """Prompts of any length split evenly: the text tokens padded with masked ones (the pipeline trims its prompts
    to the batch's longest, e.g. 5 tokens)."""
    model.register_forward_pre_hook(masked_padding(size, "encoder_hidden_states", "encoder_hidden_states_mask"),
                                    with_kwargs=True)


def encode(text, captions, device, references=None) -> dict:
    """The pipeline's own _get_qwen_prompt_embeds, padded to max_sequence_length, with the mask; an edit model's
    prompts with each one's reference images (PIL), one prompt at a time as QwenImageEditPlusPipeline encodes them,
    shown to Qwen2.5-VL as that pipeline shows them (condition_images)."""
    pipe, length = text.pipeline, text.max_length
    if references is None:
        found = [pipe._get_qwen_prompt_embeds(captions, device=device, dtype=torch.float32)]
    else:
        found = [pipe._get_qwen_prompt_embeds([caption], image=condition_images(pipe, images), device=device,
                                              dtype=torch.float32) for caption, images in zip(captions, references)]
    embeds = torch.zeros(len(captions), length, found[0][0].shape[-1], device=device)
    padded = torch.zeros(len(captions), length, dtype=torch.bool, device=device)
    row = 0
    for part, mask in found:
        n = min(part.shape[1], length)
        embeds[row:row + len(part), :n], padded[row:row + len(part), :n] = part[:, :n], mask[:, :n].bool()
        row += len(part)
    return {"embeds": embeds * padded[..., None], "mask": padded}


def condition_images(pipe, images: list) -> list:
    """Reference images as QwenImageEditPlusPipeline shows them to Qwen2.5-VL: resized to its condition area, their
    aspect kept."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions
    sizes = [calculate_dimensions(CONDITION_IMAGE_SIZE, image.width / image.height) for image in images]
    return [pipe.image_processor.resize(image, height, width) for image, (width, height) in zip(images, sizes)]


def reference_pixels(images: list) -> torch.Tensor:
    """Reference images (PIL) as QwenImageEditPlusPipeline gives them to the VAE: resized to its reference area,
    their aspect kept -> [K, C, H, W] in [-1, 1]."""
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import VAE_IMAGE_SIZE, calculate_dimensions
    processor = VaeImageProcessor(vae_scale_factor=16)  # the pipeline's (8x down, 2x2 patches)
    sizes = [calculate_dimensions(VAE_IMAGE_SIZE, image.width / image.height) for image in images]
    return torch.cat([processor.preprocess(image, height, width) for image, (width, height) in zip(images, sizes)])


def to_model(vae, z):
    """(z - latents_mean) / latents_std per channel (the inverse of the pipeline's decoding), then 2x2 patches."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1).to(z)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1).to(z)
    return patchify((z - mean) / std)


def forward(model, x, t, cond) -> dict:
    """The pipeline's arguments; an edit model's references packed after the target's tokens, their grids after its
    grid in img_shapes."""
    b, _, h, w = x.shape
    tokens, grids = [pack(x)], [(1, h, w)]
    for k in range(cond["references"].shape[1] if "references" in cond else 0):
        reference = cond["references"][:, k]
        tokens.append(pack(reference))
        grids.append((1, *reference.shape[-2:]))
    return dict(hidden_states=torch.cat(tokens, dim=1), encoder_hidden_states=cond["embeds"],
                encoder_hidden_states_mask=cond["mask"], timestep=t, img_shapes=[grids] * b, return_dict=False)


def call(constants, sample_cfg, cond, negative) -> dict:
    """The embeddings cut to the longest prompt of the batch, as the pipeline pads them itself."""
    def trimmed(c):
        n = int(c["mask"].sum(1).max())
        return c["embeds"][:, :n], c["mask"][:, :n].long()
    (embeds, mask), (neg, neg_mask) = trimmed(cond), trimmed(negative)
    return dict(prompt_embeds=embeds, prompt_embeds_mask=mask, negative_prompt_embeds=neg,
                negative_prompt_embeds_mask=neg_mask, true_cfg_scale=sample_cfg.cfg_scale,
                max_sequence_length=constants["max_sequence_length"])


@functools.cache
def image_text_processor():
    """The class of the edit pipeline's processor: transformers' Qwen2VLProcessor without its video processor, which
    needs torchvision and which prompts never reach."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageTextProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id, self.video_token_id = tokenizer.convert_tokens_to_ids([self.image_token,
                                                                                        self.video_token])
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
    return ImageTextProcessor


def _processor(tokenizer_folder: str):
    """The processor of a pipeline folder (its processor/ beside tokenizer/), or of a folder holding the tokenizer
    and the processor together (the debug model's)."""
    folder = Path(tokenizer_folder)
    for candidate in (folder.parent / "processor", folder):
        if any((candidate / name).is_file() for name in ("processor_config.json", "preprocessor_config.json")):
            return image_text_processor().from_pretrained(candidate)
    raise FileNotFoundError(f"--text_encoder: no processor/ beside {folder} and no processor in it; the edit models "
                            f"take their pipeline folder, which holds one (qwen-image-edit-debug: python -m "
                            f"opendit.families.wrapped.tiny_text qwen-image-edit-debug DIR)")


def _text_pipeline(pipeline_class, parts: dict, constants):
    """The pipeline that encodes prompts; the edit pipeline also gets its processor (a pipeline folder's processor/,
    or the tokenizer's folder holding one)."""
    if "processor" in inspect.signature(pipeline_class.__init__).parameters:
        parts = dict(parts, processor=_processor(parts["tokenizer"].name_or_path))
    return _construct(pipeline_class, parts)


def _repair_rope(model):
    """Its RoPE frequency tables are plain tensors, not buffers: built on the meta device (a model a file fills),
    nothing would fill them; they are computed on the host."""
    rope = model.pos_embed
    if rope.pos_freqs.is_meta:
        with torch.device("cpu"):
            model.pos_embed = type(rope)(theta=rope.theta, axes_dim=rope.axes_dim, scale_rope=rope.scale_rope)
    return model


# sampling defaults: the pipelines' (50 steps, true_cfg_scale 4); text_params: Qwen2.5-VL-7B's
MODEL = Declared(
    family="qwenimage", title="Qwen-Image", transformer="QwenImageTransformer2DModel", pipeline="QwenImagePipeline",
    models={"qwen-image": Size(QWEN_IMAGE, dict(max_sequence_length=1024, steps=50, cfg_scale=4.0,
                                                text_params=8.29e9)),
            "qwen-image-debug": Size(QWEN_IMAGE_DEBUG, dict(max_sequence_length=32, steps=20, cfg_scale=4.0,
                                                            text_params=0, tiny_text="qwen2.5-vl")),
            "qwen-image-edit-2509": Size(QWEN_IMAGE, dict(EDIT, max_sequence_length=1024, text_params=8.29e9)),
            "qwen-image-edit-2511": Size(QWEN_IMAGE_EDIT_2511, dict(EDIT, max_sequence_length=1024,
                                                                    text_params=8.29e9)),
            # a prompt holds 196 vision tokens per reference (384 x 384 in 28-pixel patches)
            "qwen-image-edit-debug": Size(QWEN_IMAGE_EDIT_DEBUG, dict(EDIT, max_sequence_length=640, steps=20,
                                                                      text_params=0,
                                                                      tiny_text="qwen2.5-vl+processor"))},
    feed=Feed(encode, to_model, forward, call), text_pipeline=_text_pipeline, reference_call=image_of_the_set,
    reference_pixels=reference_pixels, prompt_references=True, one_prompt_per_call=True, references_required=True,
    text={"text_encoder": "text_encoder", "tokenizer": "tokenizer"},
    conditions={"embeds": ("L", "joint_attention_dim"), "mask": ("L",)},
    scheduler=SCHEDULER, vae="AutoencoderKLQwenImage", vae_kind="frame", vae_size=(16, 126.9e6),
    derived={"out_channels": lambda arch: arch["in_channels"] // 4},  # both from the latent channels
    repair=_repair_rope,
    parallel_plan=diffusers_plan(split=("image tokens", "text tokens and their mask (padded with masked ones to a "
                                        "multiple of the group)", "RoPE tables"), prepare=_pad_text),
    # attention of both streams and the image MLP; not the text stream's outputs (to_add_out, txt_mlp), which the
    # last block computes for nothing (its text tokens are dropped): adapters there would never get a gradient
    lora_targets=r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|to_out\.0|add_[qkv]_proj)|img_mlp\.net\.(0\.proj|2))",
    unused=("transformer_blocks", ("attn.to_add_out", "txt_mlp")),
    recipe="diffusers' Qwen-Image DreamBooth LoRA example: x_t = (1 - t) x + t noise, target noise - x, plain MSE",
    streams=Streams(one=r"_mod\.|^(time_text_embed|norm_out)", text=r"^txt_in|\.add_|to_add_out|txt_mlp",
                    attention={"transformer_blocks": "joint"}),
)


VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def save_tiny_qwen25vl(folder, words="digits", hidden_size: int = 16, layers: int = 2, seed: int = 0,
                       processor: bool = False) -> str:
    """Write a tiny random Qwen2_5_VLForConditionalGeneration (hidden_size wide, `layers` deep, a one-block vision
    tower) and a word-level chat tokenizer over `words` to `folder`: qwen-image-debug's text encoder. The tokenizer
    splits Qwen-Image's system template into 34 tokens, as Qwen's own does (its words unknown to the vocabulary are
    one token each). With `processor`, the edit models' (qwen-image-edit-debug): the tokenizer also knows Qwen's
    vision tokens (the model's ids of them) and splits the edit template's system turn into the 64 tokens its
    pipeline drops, as Qwen's does ("'s" one token), and the processor the edit pipeline takes is written beside it
    (a Qwen2-VL image processor of 14-pixel patches merged 2 x 2, as Qwen2.5-VL's)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from opendit.encoders.word_tokenizer import WORDS, chat_word_tokenizer

    tokenizer = chat_word_tokenizer(words, 1024, pieces="'s|" + WORDS) if processor else \
        chat_word_tokenizer(words, 64)
    vision_ids = {}
    if processor:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
        names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
        vision_ids = dict(zip(names, tokenizer.convert_tokens_to_ids(VISION_TOKENS)))
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, pad_token_id=tokenizer.pad_token_id)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden_size,
                  fullatt_block_indexes=[0])
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **vision_ids)
                                       ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if processor:
        image_text_processor()(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer).save_pretrained(folder)
    return str(folder)
