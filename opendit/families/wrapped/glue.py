"""What one diffusers-transformer model needs beyond what the kind shares (opendit.families.wrapped.kind): the
`ModelGlue` interface (declared.py's DeclaredGlue implements it from a model's declaration), and the pieces it uses
(a text encoder found in a pipeline folder, the stand-in autoencoder of pixel space, the diffusers class given
opendit's model declarations).

A glue says how its model is fed: prompts -> embeddings (the pipeline's own encode_prompt code), images -> the
model's token space (the VAE, its normalisation, patching), the forward's keyword arguments (tokens, position ids,
timestep, guidance), and which diffusers pipeline samples it. The kind does the rest: data, the objective, every
plugin, LoRA, resume, previews and sampling.
"""
import types
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from opendit.families.base import ModelSpec


GUIDANCE_DISTILLED = "it is guidance-distilled: --cfg_scale is its embedded guidance, one model call per step"


class WrappedSpec(ModelSpec):
    """A registry entry whose arch is the diffusers transformer's config (its class's constructor arguments)."""

    @property
    def num_heads(self) -> int:
        if "model_dim" in self.arch and "axes_dims" in self.arch:  # no head count: heads as wide as the RoPE axes
            return self.arch["model_dim"] // sum(self.arch["axes_dims"])
        return next(self.arch[k] for k in ("num_attention_heads", "n_heads") if k in self.arch)


def block_lists(model: nn.Module) -> tuple[str, ...]:
    """The names of the model's nn.ModuleList attributes holding its repeated blocks: the classes its diffusers
    class lists in `_repeated_blocks` (else `_no_split_modules`), in the order the lists were defined."""
    kinds = set(getattr(model, "_repeated_blocks", None) or getattr(model, "_no_split_modules", None) or ())
    found = tuple(name for name, child in model.named_children()
                  if isinstance(child, nn.ModuleList) and len(child) and type(child[0]).__name__ in kinds)
    if not found:
        raise TypeError(f"{type(model).__name__} names no repeated blocks (_repeated_blocks / _no_split_modules) that "
                        f"opendit can find in an nn.ModuleList; it cannot be trained block by block")
    return found


def declare(model: nn.Module, parallel_plan=None) -> nn.Module:
    """A diffusers transformer with what opendit.families.DiffusionModel asks (its block lists, its parallel plan):
    the same class and state_dict keys, so save_pretrained and diffusers' pipelines still take it."""
    model._block_lists = block_lists(model)
    model.parallel_plan = parallel_plan
    return model


def last_block_parameters(model: nn.Module, blocks: str, modules: tuple[str, ...]) -> list[str]:
    """The parameter names of `modules` (e.g. "attn.to_add_out") in the last block of the ModuleList `blocks`: a
    double-stream model's text-stream outputs there are computed and dropped (unused_parameters)."""
    last = f"{blocks}.{len(getattr(model, blocks)) - 1}."
    return [n for n, _ in model.named_parameters() if n.startswith(tuple(last + m for m in modules))]


def patchify(z: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, 4C, h/2, w/2], channels (c, dy, dx): the order of FLUX.1's and Qwen-Image's packed
    tokens."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, 4 * c, h // 2, w // 2)


def pack(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(2).transpose(1, 2)  # [B, 4C, h, w] -> [B, h * w, 4C], row by row


def find_folder(path: str, subfolders: tuple[str, ...], what: str, flag: str, marker: str = "config.json"
                ) -> Path:
    """`path` itself when it holds `marker`, else the first of its `subfolders` that does (a pipeline folder)."""
    root = Path(path)
    for folder in (root, *(root / s for s in subfolders)):
        if (folder / marker).is_file():
            return folder
    raise FileNotFoundError(f"{flag} {path!r}: no {what} there ({marker}, or a pipeline folder with "
                            f"{' or '.join(s + '/' for s in subfolders)})")


class PixelSpace(nn.Module):
    """Pixel space dressed as an autoencoder, so a diffusers pipeline samples a pixel-space model unchanged:
    downsampling 1, scale 1 and shift 0 (FLUX.2's batch-norm statistics and Qwen-Image's latent statistics zero
    mean and unit variance: normalising is the identity), decode returns its input."""

    def __init__(self, channels: int):
        super().__init__()
        # encoder_block_out_channels: AutoencoderDC's downsampling, as Sana's pipeline reads it
        self.config = types.SimpleNamespace(block_out_channels=(channels,), encoder_block_out_channels=(channels,),
                                            batch_norm_eps=0.0, latent_channels=channels, scaling_factor=1.0,
                                            shift_factor=0.0,
                                            z_dim=channels, latents_mean=[0.0] * channels, latents_std=[1.0] * channels,
                                            scale_factor_temporal=1, scale_factor_spatial=1)
        self.bn = types.SimpleNamespace(running_mean=torch.zeros(4 * channels), running_var=torch.ones(4 * channels))
        self.temperal_downsample = []  # Qwen-Image's pipeline reads its downsampling from this
        self.temporal_compression_ratio = self.spatial_compression_ratio = 1  # HunyuanVideo-1.5's pipeline these
        self.config.temporal_compression_ratio = self.config.spatial_compression_ratio = 1  # and Kandinsky 5's these
        self.register_buffer("anchor", torch.zeros(()), persistent=False)  # its device and dtype for the pipeline

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor.dtype

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    def encode(self, x, return_dict: bool = True):
        """Pixels as their own latents (a pipeline encoding a reference image: its posterior's mode), in the
        channels this space has (RGB to grey by luma)."""
        from opendit.data.mixture import to_channels
        z = torch.stack([to_channels(image, self.config.latent_channels) for image in x])
        dist = types.SimpleNamespace(mode=lambda: z, sample=lambda generator=None: z, mean=z)
        return (dist,) if not return_dict else types.SimpleNamespace(latent_dist=dist)

    def decode(self, z, return_dict: bool = True):
        return (z,) if not return_dict else types.SimpleNamespace(sample=z)


@dataclass
class TextEncoder:
    """A pipeline's text encoder and tokenizer (frozen, eval mode), and what its encode_prompt is given."""
    model: nn.Module
    tokenizer: object
    max_length: int
    layers: tuple[int, ...] = ()  # hidden-state layers the prompt embedding stacks (FLUX.2)
    pipeline: object = None  # a pipeline holding this encoder, whose own encoding a glue runs (Qwen-Image)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


class ModelGlue:
    """One diffusers transformer class's glue. Class attributes: `transformer_class` and `pipeline_class` (diffusers
    names), `models` {name: WrappedSpec}, `lora_targets` (a regex over the diffusers module names), `recipe` (the
    training recipe followed, in words), `parallel_plan` (how its sequence is split; None: it is not). Methods
    below. A glue is its models' constructor: glue(**config) builds the transformer."""
    title: str = ""  # the model's name in the docs' tables
    transformer_class: str = ""
    pipeline_class: str = ""
    pipeline_options: dict = {}  # {pipeline class name: its constructor arguments beyond its components}
    scheduler_config: dict = {}  # FlowMatchEulerDiscreteScheduler's settings of the release
    vae_class: str = "AutoencoderKL"
    vae_channels, vae_params = 4, 83_653_863  # the usual VAE's, for the memory planner (SD's AutoencoderKL)
    vae_downsampling = 8
    models: dict = {}
    parallel_plan = None  # an opendit.parallel.ParallelPlan (context_parallel.diffusers_plan) or None
    lora_targets: str = ""
    recipe: str = ""
    patch: int = 2  # latent positions per token side
    outside_patch: int = 2  # of those, packed into channels before the model (FLUX.2), 1: the model patches (Z-Image)

    # an official release's single file: a key only its layout has, and diffusers' converter of it
    # (diffusers.loaders.single_file_utils)
    official_key: str | tuple[str, ...] = ""  # (or keys, all of them)
    official_converter: str = ""
    references_per_sample: bool = False  # an editing model's pipeline takes each sample's references in one call
    one_prompt_per_call: bool = False  # its pipeline samples one prompt per call
    references_required: bool = False  # it only edits: trains on pairs, samples with --image
    prompt_references: bool = False  # its prompt embedding also sees the reference images
    reference_pixels = None  # (reference images, PIL) -> [K, C, H, W] as its pipeline gives them to the VAE
    # config keys the run decides (from its latent channels), not compared when naming a diffusers folder's model
    run_keys: tuple[str, ...] = ("in_channels",)

    def patch_of(self, model: str) -> int:
        """Latent positions per token side of the registered `model` (`patch`, unless its models differ)."""
        return self.patch

    def convert_official(self, state: dict) -> dict:
        from diffusers.loaders import single_file_utils
        return getattr(single_file_utils, self.official_converter)(dict(state))

    def transformer_type(self):
        import diffusers
        return getattr(diffusers, self.transformer_class)

    def __call__(self, **config) -> nn.Module:
        return declare(self.transformer_type()(**config), self.parallel_plan)

    @property
    def __name__(self) -> str:  # as a class constructor's: the help texts name the model class
        return self.transformer_class

    def cfg_calls(self, model: str) -> str | None:
        """How the pipeline of the registered `model` evaluates classifier-free guidance (opendit.parallel.cfg):
        "pairs" (a conditional then an unconditional call per step), "batched" (one call on [cond; uncond]), or None
        (no true guidance: guidance-distilled)."""
        return "pairs"

    def no_cfg_pair(self, model: str) -> str:
        """Why the pipeline of `model` makes no pair of guidance calls for --cfg_parallel (cfg_calls None)."""
        return GUIDANCE_DISTILLED

    def kohya_lora_names(self, keys) -> dict[str, tuple[str, ...]] | None:
        """The release's module names that kohya/ComfyUI LoRA files of this model use, where they are not diffusers'
        (ModelFamily.kohya_lora_names); None: diffusers' names (what diffusers' own converter of such files reads for
        Z-Image, Qwen-Image)."""
        return None

    def unused_parameters(self, model, pairs: bool = False) -> list[str]:
        """Parameters the forward computes with but whose result it discards (they never get a gradient; `pairs`: in
        a run on editing pairs): frozen, so every plugin and the optimizer's checkpoint treat the model as fully
        used."""
        return []

    def text_encoder(self, path: str, device, dtype, model: str) -> TextEncoder:
        raise NotImplementedError

    def encode_prompts(self, encoder: TextEncoder, captions: list[str], device, references=None
                       ) -> dict[str, torch.Tensor]:
        """captions -> their conditions {name: float32 or bool [B, ...]} on device, as the pipeline's encode_prompt
        makes them (FLUX.2: {"embeds": [B, L, D]}; a masked encoder adds "mask": [B, L]); where the prompt sees the
        reference images (prompt_references), each caption's (PIL) in `references`."""
        raise NotImplementedError

    def load_vae(self, path: str, device):
        import diffusers
        folder = find_folder(path, ("vae",), "autoencoder", "--vae")
        return getattr(diffusers, self.vae_class).from_pretrained(folder).to(device).eval().requires_grad_(False)

    def vae_geometry(self, vae) -> tuple[int, int]:
        """(spatial downsampling, latent channels) of the model's VAE (or PixelSpace, or the memory planner's stand-in
        holding the config of the family's usual VAE)."""
        return 2 ** (len(vae.config.block_out_channels) - 1), vae.config.latent_channels

    def temporal_downsampling(self, vae) -> int:
        """Frames per latent frame after the first of a video model's VAE (PixelSpace, the memory planner's stand-in:
        1)."""
        return getattr(vae, "temporal_compression_ratio", 1)

    def posterior(self, vae, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Images [B, 3, H, W] in [-1, 1] (video: clips [B, 3, T, H, W]) -> the VAE posterior's (mean, std) float32
        [B, C, h, w] ([B, C, T', h, w]), unscaled: what a latent cache stores."""
        posterior = vae.encode(images.to(next(vae.parameters()).dtype)).latent_dist
        return posterior.mean.float(), posterior.std.float()

    def encode_images(self, vae, images: torch.Tensor) -> torch.Tensor:
        """One posterior sample (mean + std * randn from the global RNG, as training on a cache draws it)."""
        from opendit.encoders.vae import posterior_sample
        return posterior_sample(*self.posterior(vae, images))

    def to_model_space(self, vae, z: torch.Tensor) -> torch.Tensor:
        """VAE latents (a posterior sample; pixels for PixelSpace) [B, C, h, w] -> what the model denoises,
        [B, C * outside_patch^2, h / outside_patch, w / outside_patch], as the pipeline normalises and packs them."""
        raise NotImplementedError

    def random_conditions(self, spec, batch: int, device) -> dict:
        """Prompt conditions of `batch` random prompts of the longest length (the memory planner's)."""
        raise NotImplementedError

    def forward_kwargs(self, model, x: torch.Tensor, t: torch.Tensor, cond: dict, cfg) -> dict:
        """The forward's keyword arguments for x [B, C', h', w'] at times t [B] in [0, 1] (the noise level of
        x_t = (1 - t) x + t noise) and the prompts' conditions."""
        raise NotImplementedError

    def from_output(self, out, shape) -> torch.Tensor:
        """The forward's first output -> the velocity noise - x, [B, C', h', w'] of `shape`."""
        raise NotImplementedError

    def pipeline_name(self, model: str) -> str:
        """The diffusers pipeline class that samples the registered `model` (its constants' "pipeline", else
        `pipeline_class`)."""
        return self.models[model].constants.get("pipeline", self.pipeline_class)

    def pipeline(self, model, vae, scheduler_folder: str | None, name: str | None = None, **components):
        """The diffusers pipeline `name` (default `pipeline_class`) that samples `model` (no text encoder: prompt
        embeddings are passed in), with the scheduler of `scheduler_folder`, else of `scheduler_config` (the
        release's settings); `components`: more of its constructor's arguments (pipeline_components)."""
        import diffusers
        from diffusers import FlowMatchEulerDiscreteScheduler
        name = name or self.pipeline_class
        scheduler = (FlowMatchEulerDiscreteScheduler.from_pretrained(scheduler_folder) if scheduler_folder
                     else FlowMatchEulerDiscreteScheduler(**self.scheduler_config))
        pipe = getattr(diffusers, name)(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None,
                                        transformer=model, **self.pipeline_options.get(name, {}), **components)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def pipeline_components(self, sample_cfg) -> dict:
        """Constructor arguments of the sampling pipeline that depend on the sampling options (HunyuanVideo-1.5: its
        guider, which holds the guidance scale)."""
        return {}

    def pipeline_latents(self, noise: torch.Tensor) -> torch.Tensor:
        """The noise [B, C', h', w'] as the pipeline's `latents` argument takes it."""
        return noise

    def pipeline_call(self, loaded, sample_cfg, cond: dict, negative: dict) -> dict:
        """The pipeline's __call__ keyword arguments beyond latents, steps, size and output type: the prompts'
        and the negative prompt's embeddings, the guidance scale (--cfg_scale: 1 is off, as everywhere in opendit),
        what the pipeline needs to encode as training did."""
        raise NotImplementedError
