"""FLUX.3 (Black Forest Labs, 2026) text-to-image and editing through diffusers' own Flux3Transformer2DModel and its
modular pipeline (Flux3ModularPipeline running Flux3AutoBlocks; diffusers has no classic pipeline for it).

The model: per-mode blocks (the text tokens, the image tokens and an edit's reference-image tokens each attend within
themselves), then joint single blocks over [text; image; references], modulated per token: the image tokens by the
flow time t, the text and the references by time 0.

Prompts are the pipeline's own (Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds): the prompt in Qwen3-VL's chat
template, its hidden states at layers 4, 8, ..., 32 stacked per token (8 x 2560 = 20480 wide for Qwen3-VL-4B). FLUX.3
has no text mask: it attends to the padding, so the padded length is part of its recipe. The pipeline pads each prompt
to the next multiple of 80 tokens; opendit needs one length for a batch and pads every prompt to max_sequence_length
(640 = 8 x 80, a length the pipeline itself forms, for prompts of 561 to 640 tokens), in training and in sampling
alike. The pipeline given a prompt string forms its own, shorter window for a shorter prompt: the same prompt then
conditions it differently from opendit's sampling (at the debug size, 16 tokens, both are 16).

Images go through AutoencoderKLFlux2 (32 channels, 8x down), are patched 2x2 (128 channels) and normalised by the
VAE's batch-norm statistics (the pipeline's Flux3VaeEncoderStep), then packed into tokens with the pipeline's 4-D
position ids (t, h, w, l; h and w halved, its image_rope_scale); text position ids run along l.

Training: no official FLUX.3 trainer is public and diffusers has no training example for it, so opendit follows the
parametrisation of diffusers' FLUX.2 DreamBooth LoRA examples (train_dreambooth_lora_flux2*.py), which is the one the
FLUX.3 pipeline samples with: x_t = (1 - t) x + t noise, the model sees t (the pipeline passes sigma, in [0, 1]) and
predicts noise - x, plain MSE; no guidance embedding. Sampling: the pipeline's schedule (sigmas 1 .. 1/N, a constant
shift of 6.93) and its guider (classifier-free guidance: --cfg_scale is its guidance_scale; 1 is off), without its
prompt upsampler (a Qwen3.5-9B that rewrites prompts; opendit trains on captions as they are). The step-distilled
release (flow_map=True, Flux3DistilledModularPipeline) is not registered.

Editing: a run on editing pairs feeds the reference-image branch (x_embedders.image_cond, mode_blocks.image_cond, the
image_cond modulations) and trains it; a text-to-image run never reaches it and keeps it frozen. The controls are
encoded as the pipeline's VAE-encoder step encodes its `image` (the posterior's mode, patched and normalised: to_model)
and go in as Flux3PrepareImageCondLatentsStep hands them over: image_cond_hidden_states, reference k's tokens after
those of the ones before it, and image_cond_ids, each reference's grid ids with l = -(k + 1); the loss covers the
target's tokens (the model outputs no others). Sampling (sample.py --image) hands the references to the pipeline as its
`image`, one set for a call's whole batch, at the sample size. The pipeline pads a single reference to at least 64 px a
side (and fits it under 4 megapixels), and fits each of several under 1 megapixel: between those sizes it encodes the
references as training encodes the controls. LoRA adapts the same Linears in either run: the reference branch gets no
adapters by default (a text-to-image run never reaches them); --lora_targets may add its blocks' to an editing run.

Not split for sequence parallelism: diffusers' class has no `_cp_plan`, and opendit has not written one. Its block
lists are txt_mode_blocks and single_transformer_blocks: mode_blocks is a ModuleDict of lists, which opendit's block
lists do not reach, so the per-mode blocks of the image and the references are checkpointed, compiled and sharded
with the root module.
"""
import torch

from opendit.families.wrapped.references import image_of_the_set
from opendit.families.wrapped.declared import Declared, Feed, Size, Streams
from opendit.families.wrapped.glue import pack

# the release (flux-3-image-klein-base): Flux3Transformer2DModel's defaults, which its docstring and diffusers'
# converter of BFL's files describe (5 per-mode blocks of each mode, 28 joint blocks, 3072 wide; 5.5e9 parameters
# with the reference-image branch); not read from the published config.json, which cannot be downloaded here
FLUX3 = dict(in_channels=128, cond_in_channels=128, num_layers=5, num_single_layers=28, attention_head_dim=128,
             num_attention_heads=24, joint_attention_dim=20480, timestep_channels=256, mlp_ratio=3.0,
             axes_dims_rope=(32, 32, 32, 32), rope_theta=10000, eps=1e-6, flow_map=False)
# 64 wide, 2 + 2 blocks; a tiny Qwen3-VL (16 wide, 3 layers) conditions it: its layers 1-3 stacked, 48 wide
FLUX3_DEBUG = dict(FLUX3, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4,
                   joint_attention_dim=48, timestep_channels=64, axes_dims_rope=(4, 4, 4, 4))
TEXT_LAYERS = (4, 8, 12, 16, 20, 24, 28, 32)  # Flux3TextEncoderStep's text_encoder_out_layers
IMAGE_ROPE_SCALE = 0.5  # Flux3PrepareLatentsStep's: the h, w position ids of the image tokens are halved
SCHEDULER = dict(num_train_timesteps=1000, shift=6.93, use_dynamic_shifting=False)  # Flux3SetTimestepsStep's


def encode(text, captions, device) -> dict:
    """The pipeline's own Qwen3-VL encoding, one prompt at a time as its step takes them, each padded to
    max_sequence_length (its window: see the module's docstring)."""
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep
    pipe, length = text.pipeline.modular, text.max_length
    return {"embeds": torch.cat([Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(
        pipe.text_encoder, pipe.tokenizer, caption, device=device, max_sequence_length=length, pad_multiple=length,
        hidden_states_layers=text.layers) for caption in captions]).float()}


def to_model(vae, z):
    """Patched 2x2 (the pipeline's own _patchify_latents) and normalised by the VAE's batch-norm statistics, as its
    VAE-encoder step does (the inverse of its decode step)."""
    from diffusers.modular_pipelines.flux3.encoders import Flux3VaeEncoderStep
    z = Flux3VaeEncoderStep._patchify_latents(z)
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z)
    return (z - mean) / std


def forward(model, x, t, cond) -> dict:
    """The pipeline's packing and 4-D position ids; an editing pair's references [B, K, C', h', w'] as
    Flux3PrepareImageCondLatentsStep passes them: their tokens one reference after another [B, K h' w', C'], reference
    k's ids those of its grid with l = -(k + 1)."""
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep, _prepare_image_ids
    _, _, h, w = x.shape
    embeds = cond["embeds"]
    given = dict(hidden_states=pack(x), encoder_hidden_states=embeds, timestep=t,
                 img_ids=_prepare_image_ids(h, w, IMAGE_ROPE_SCALE).to(x.device),
                 txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(embeds).to(x.device), return_dict=False)
    if "references" in cond:
        references = cond["references"].unbind(1)
        ids = [_prepare_image_ids(*r.shape[-2:], IMAGE_ROPE_SCALE, l_coord=-(k + 1)) for k, r in enumerate(references)]
        given |= dict(image_cond_hidden_states=torch.cat([pack(r) for r in references], dim=1),
                      image_cond_ids=torch.cat(ids).to(x.device))
    return given


def call(constants, sample_cfg, cond, negative) -> dict:
    return dict(prompt_embeds=cond["embeds"], negative_prompt_embeds=negative["embeds"],
                guidance_scale=sample_cfg.cfg_scale)


class ModularAsClassic:
    """Flux3ModularPipeline built from components and called as diffusers' classic pipelines are (keyword arguments
    in, (images,) out; guidance_scale sets its guider). Its blocks: Flux3AutoBlocks without the prompt upsampler, and
    without the text-encoder step when it is given no text encoder (prompts then arrive as embeddings)."""

    def __init__(self, pipeline_class, components: dict):
        from diffusers import Flux3AutoBlocks
        self.blocks = Flux3AutoBlocks()
        self.blocks.sub_blocks.pop("prompt_upsampler")
        given = {k: v for k, v in components.items() if v is not None}
        if "tokenizer" in given:
            given["tokenizer"] = _processor(given["tokenizer"])
        else:
            self.blocks.sub_blocks.pop("text_encoder")
        self.modular = pipeline_class(blocks=self.blocks)
        self.modular.update_components(**given)

    def set_progress_bar_config(self, **kwargs):
        """On every denoising loop of its blocks (the modular pipeline's own reaches only the outermost)."""
        def visit(block):
            if hasattr(block, "set_progress_bar_config"):
                block.set_progress_bar_config(**kwargs)
            for child in getattr(block, "sub_blocks", {}).values():
                visit(child)
        visit(self.blocks)

    def __call__(self, guidance_scale: float, **kwargs):
        from diffusers import ClassifierFreeGuidance
        self.modular.update_components(guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
        return (self.modular(output="images", **kwargs),)


def _processor(tokenizer):
    """The processor the text-encoder step takes (its chat template and its tokenizer), read from the folder the
    tokenizer came from: a FLUX.3 pipeline folder's tokenizer/ holds Qwen3-VL's processor."""
    from transformers import AutoProcessor
    found = AutoProcessor.from_pretrained(tokenizer.name_or_path)
    if not hasattr(found, "tokenizer"):
        raise ValueError(f"--text_encoder: {tokenizer.name_or_path} holds a tokenizer but no processor; FLUX.3's text "
                         f"encoder takes Qwen3-VL's processor (its pipeline folder's tokenizer/; for flux3-debug: "
                         f"python -m opendit.families.wrapped.tiny_text flux3-debug DIR)")
    return found


# the reference-image branch: what a text-to-image run never reaches
IMAGE_COND = r"(x_embedders|mode_blocks|early_stream_modulations|single_stream_modulations)\.image_cond\."
# at most 10 reference images: diffusers' FLUX.3 prompt upsampler (modular_pipelines/flux3/prompt_upsampler.py,
# MAX_REFERENCES, from BFL's flux3/pup.py; Flux3AutoBlocks' `image`: "at most 10"); its VAE-encoder and image-cond
# steps and the transformer take any number (the references told apart by l = -1, -2, ...)
REFERENCES = 10
# sampling defaults: the pipeline's (50 steps, its guider's guidance_scale 3.5); text_params: Qwen3-VL-4B's (about)
MODEL = Declared(
    family="flux3", title="FLUX.3", transformer="Flux3Transformer2DModel", pipeline="Flux3ModularPipeline",
    models={"flux3": Size(FLUX3, dict(max_sequence_length=640, text_layers=TEXT_LAYERS, steps=50, cfg_scale=3.5,
                                      text_params=4.44e9, references=REFERENCES)),
            "flux3-debug": Size(FLUX3_DEBUG, dict(max_sequence_length=16, text_layers=(1, 2, 3), steps=20,
                                                  cfg_scale=3.5, text_params=0, tiny_text="qwen3-vl+processor",
                                                  references=REFERENCES))},
    feed=Feed(encode, to_model, forward, call), reference_call=image_of_the_set, make_pipeline=ModularAsClassic,
    text={"text_encoder": "text_encoder", "tokenizer": "tokenizer"},
    conditions={"embeds": ("L", "joint_attention_dim")},
    scheduler=SCHEDULER, vae="AutoencoderKLFlux2", vae_size=(32, 84e6), packed_latents=False,
    derived={"cond_in_channels": lambda arch: arch["in_channels"]},  # references go through the same VAE
    unused=lambda pairs: None if pairs else IMAGE_COND,  # trained on editing pairs, else frozen
    # attention and feed-forward Linears of the per-mode blocks (text, image) and of the joint blocks, as peer
    # trainers target FLUX.2's; not the image_cond blocks, which a text-to-image run never reaches (module docstring)
    lora_targets=(r"(txt_mode_blocks|mode_blocks\.image|single_transformer_blocks)\.\d+\."
                  r"(attn\.(to_[qkv]|to_out\.0)|ff\.linear_(in|out))"),
    # BFL's single files: their modulation heads end in .lin (diffusers: .linear)
    official_key="early_stream_modulations.image.lin.weight",
    official_converter="convert_flux3_transformer_checkpoint_to_diffusers",
    recipe=("diffusers' FLUX.2 DreamBooth LoRA examples' parametrisation (no FLUX.3 trainer is public): x_t = (1 - t) "
            "x + t noise, target noise - x, plain MSE; prompts padded to max_sequence_length"),
    # the modulations and the output layer run on every token of their stream (per-token modulation); the time
    # embedder on two rows (t, and 0 for the text); the reference-image branch not at all. mode_blocks["image"] has
    # as many blocks as txt_mode_blocks, which the table counts for it ("txt_mode_blocks.attn": all of them)
    streams=Streams(rows={r"image_cond": lambda model: 0, r"^timestep_embedder\.": lambda model: 2},
                    joint=r"^single_transformer_blocks",
                    text=r"^(context_embedder|txt_mode_blocks)|_modulations\.txt\.",
                    attention={"txt_mode_blocks": "text", "txt_mode_blocks.attn": "image",
                               "single_transformer_blocks": "joint"}),
)
