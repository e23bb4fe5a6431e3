"""A diffusers-transformer model declared, not programmed: one file per model holding a `Declared` (data: the
diffusers classes, the registry sizes, the text components of its pipeline, the shapes of its prompt conditions, LoRA
targets, the parallel plan, the token streams of its FLOP count, the recipe) and a `Feed` of five short functions
(prompts -> conditions, latents -> model space, the forward's arguments, its output -> velocity, the pipeline's
call). `DeclaredGlue` turns the declaration into the glue the kind (kind.py) asks; nothing shared changes when a
model is added: its file and one line in the registry (opendit/families/wrapped/__init__.py), or, outside opendit, a
module named in OPENDIT_FAMILIES that calls `register_family(declared_family(MODEL))`.
"""
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from opendit.checkpoint.folders import read_config
from opendit.families.wrapped.glue import (GUIDANCE_DISTILLED, ModelGlue, TextEncoder, WrappedSpec, find_folder,
                                           last_block_parameters, pack)
from opendit.perf import matmul_macs


def tokens_to_grid(out: torch.Tensor, shape) -> torch.Tensor:
    """The usual output: tokens [B, h * w, C] row by row -> [B, C, h, w] (the first h * w tokens: those after them
    are the references an editing model was given, as its pipeline drops them)."""
    b, c, h, w = shape
    return out[:, :h * w].transpose(1, 2).reshape(b, c, h, w)


@dataclass(frozen=True)
class Feed:
    """How one model is fed, each the pipeline's own way:
    encode(text: glue.TextEncoder, captions, device) -> {condition: [B, ...]} (a mask, named mask..., as bool; padded
      to the model's max_sequence_length, so that caption dropout can swap any two); with Declared.prompt_references
      also given references= (each caption's reference images, PIL);
    to_model(vae, z) -> what the model denoises, [B, C', h', w'] (z: a VAE posterior sample, or pixels);
    forward(model, x, t, cond) -> the forward's keyword arguments at noise level t [B] in [0, 1];
    call(constants, sample_cfg, cond, negative) -> the pipeline's __call__ arguments beyond latents, steps, size and
      output type (--cfg_scale keeps opendit's convention: 1 is off);
    output(out, shape) -> the velocity noise - x of `shape` from the forward's first output."""
    encode: Callable
    to_model: Callable
    forward: Callable
    call: Callable
    output: Callable = tokens_to_grid


@dataclass(frozen=True)
class Streams:
    """Which token stream each Linear of the model runs on, for the FLOP count: regexes over module names, tried in
    order one (a single row: modulations, time embeddings), joint (text + image), text, prompt (the prompt's tokens
    before the model adds its own to the text stream: `added`); the rest run on the image tokens. rows: {regex:
    model -> its row count} for Linears that run on a count of their own (tried first). attention: {block list (a
    module path): the stream its attention spans; or "list.attr": the blocks of the list whose `attr` is not None (a
    second attention some blocks have)}, the stream given as f(model, text tokens, image tokens) -> one block's
    attention MACs where that attention is not softmax attention within one stream (linear, cross); width: the arch
    keys whose product is the attention's inner width; added: model -> tokens the model joins to the prompt's in its
    text stream (counted in text and joint)."""
    rows: Mapping[str, Callable] = field(default_factory=dict)
    one: str = r"^$"
    joint: str = r"^$"
    text: str = r"^$"
    prompt: str = r"^$"
    attention: Mapping[str, str | Callable] = field(default_factory=dict)
    width: tuple[str, ...] = ("num_attention_heads", "attention_head_dim")
    added: Callable | None = None


@dataclass(frozen=True)
class Size:
    """A registry size: the transformer's constructor arguments and the run constants (max_sequence_length, steps,
    cfg_scale: sampling defaults; text_params: the text encoders' parameters, for the memory planner; and any the
    feed reads)."""
    arch: Mapping
    constants: Mapping


@dataclass(frozen=True)
class Declared:
    family: str
    title: str  # the model's name in the docs' tables
    transformer: str  # diffusers' class names
    pipeline: str
    models: Mapping[str, Size]
    feed: Feed
    # {pipeline constructor argument: subfolder of a pipeline folder} of its text encoders and tokenizers; one of
    # each may also be a folder holding both
    text: Mapping[str, str]
    conditions: Mapping[str, tuple]  # {condition: shape}: "L" max_sequence_length, a str an arch key, an int itself
    scheduler: Mapping  # FlowMatchEulerDiscreteScheduler's settings of the release
    lora_targets: str  # a regex over diffusers' module names
    recipe: str  # the training recipe followed, in words
    streams: Streams
    fps: float | None = None  # a video model's frame rate (its clips' default); None: an image model
    vae: str = "AutoencoderKL"
    vae_kind: str = "kl"  # "kl": a posterior of images; "frame": a video VAE given one frame; "dc": deterministic;
    # "stated": a posterior of a VAE that states its downsampling (spatial_compression_ratio: LTX-2's patches first);
    # "factors": a posterior of clips through a video VAE whose config states its downsampling (scale_factor_spatial,
    # scale_factor_temporal) and channels (z_dim)
    vae_repair: Callable | None = None  # vae -> vae, once loaded (what diffusers' autoencoder gets wrong)
    vae_size: tuple[int, float] = (4, 83_653_863)  # (latent channels, parameters) of its usual VAE, for the planner
    vae_downsampling: int = 8  # pixels per latent side of its usual VAE, for the planner
    vae_temporal: int = 1  # a video model's usual VAE: frames per latent frame after the first, for the planner
    patch: int | Callable = 2  # latent positions per token side, or f(arch) -> that (where the models differ)
    outside_patch: int = 2  # of those, packed before the model (1: the model patches itself)
    packed_latents: bool = True  # the pipeline takes its latents as tokens (else as a grid)
    # how the pipeline guides (opendit.parallel.cfg): "pairs", "batched", None; or f(model name) -> that
    cfg_calls: str | Callable | None = "pairs"
    no_cfg_pair: str = GUIDANCE_DISTILLED  # with cfg_calls None: why --cfg_parallel has no pair of calls to split
    parallel_plan: object = None  # context_parallel.diffusers_plan(...), or None: it cannot be split
    derived: Mapping[str, Callable] = field(default_factory=dict)  # {arch key: f(arch)} the run's channels decide
    # (block list, modules) the last block computes for nothing, or a regex over the names of parameters the
    # forward never reaches (a branch of the model the family does not feed); or f(pairs) -> one of those, where a
    # run on editing pairs (pairs True) feeds a branch that a text-to-image run leaves unused
    unused: tuple[str, tuple[str, ...]] | str | Callable | None = None
    repair: Callable | None = None  # model -> model, once built (what diffusers' class gets wrong on the meta device)
    # () -> a subclass of `pipeline` that samples in its place where diffusers' own cannot be handed the feed's
    # conditions (Ideogram 4's takes prompt strings alone) or the run's latents and size (Kandinsky 5's); the feed's
    # call gives its arguments
    sampling_pipeline: Callable | None = None
    # (pipeline class, {component: object}) -> the pipeline, where it is not built by its constructor (a modular
    # pipeline); what it returns is called as a classic pipeline is (its first output: the images)
    make_pipeline: Callable | None = None
    # (pipeline class, {text part: object}, constants) -> the pipeline that encodes prompts, where it is not built as
    # make_pipeline builds it (settings beyond its constructor's)
    text_pipeline: Callable | None = None
    # model name -> (a part of its text encoder's class name, that encoder in words): another class is refused
    text_model: Callable | None = None
    # {pipeline class: its constructor arguments beyond its components} (each model samples with its constants'
    # "pipeline", else `pipeline`)
    pipeline_options: Mapping[str, Mapping] = field(default_factory=dict)
    # sample options -> more of the sampling pipeline's constructor arguments (a guider holding --cfg_scale)
    sampling_components: Callable | None = None
    official_key: str | tuple[str, ...] = ""  # key(s) only the release's single file has (all of them), and
    # diffusers' converter of that layout
    official_converter: str = ""
    # {release name: (diffusers names, ...)} of kohya LoRA files, if not diffusers'; or f(the model's keys) -> that
    kohya_names: Mapping | Callable | None = None
    # a model taking reference images (its constants' `references`: at most how many): (each sample's reference
    # images in one pipeline call, PIL; or None, height, width) -> the pipeline's arguments that hand them over
    reference_call: Callable | None = None
    references_per_sample: bool = False  # its pipeline takes each sample's references; else one set per call
    one_prompt_per_call: bool = False  # its pipeline samples one prompt per call (QwenImageEditPlusPipeline)
    references_required: bool = False  # it only edits: trains on pairs, samples with --image
    # its prompt embedding also sees the references: feed.encode(text, captions, device, references=each caption's
    # reference images, PIL)
    prompt_references: bool = False
    # (a sample's reference images, PIL) -> [K, C, H, W] in [-1, 1] as its pipeline hands them to the VAE (resized to
    # an area of its own), where it does not take them at the sample's size
    reference_pixels: Callable | None = None


class DeclaredGlue(ModelGlue):
    """ModelGlue from a Declared: every method reads the declaration or calls the feed."""

    def __init__(self, d: Declared):
        self.d, self.feed, self.title, self.fps = d, d.feed, d.title, d.fps
        self.transformer_class, self.pipeline_class = d.transformer, d.pipeline
        self.scheduler_config, self.vae_class = dict(d.scheduler), d.vae
        self.vae_channels, self.vae_params = d.vae_size
        self.vae_downsampling, self.vae_temporal = d.vae_downsampling, d.vae_temporal
        self.parallel_plan, self.lora_targets, self.recipe = d.parallel_plan, d.lora_targets, d.recipe
        self.patch, self.outside_patch = d.patch, d.outside_patch
        self.official_key, self.official_converter = d.official_key, d.official_converter
        self.run_keys = tuple(dict.fromkeys(("in_channels", *d.derived)))
        self.pipeline_options = {k: dict(v) for k, v in d.pipeline_options.items()}
        self.references_per_sample, self.one_prompt_per_call = d.references_per_sample, d.one_prompt_per_call
        self.references_required, self.prompt_references = d.references_required, d.prompt_references
        self.reference_pixels = d.reference_pixels
        self.models = {n: WrappedSpec(n, d.family, None, dict(s.arch), dict(s.constants)) for n, s in d.models.items()}

    def __call__(self, **config) -> nn.Module:
        config = {**config, **{k: f(config) for k, f in self.d.derived.items()}}
        if "in_channels" not in inspect.signature(self.transformer_type().__init__).parameters:
            del config["in_channels"]  # a class naming its channels otherwise (Kandinsky 5) takes them by `derived`
        model = super().__call__(**config)
        return model if self.d.repair is None else self.d.repair(model)

    def patch_of(self, model: str) -> int:
        return self.d.patch(self.models[model].arch) if callable(self.d.patch) else self.d.patch

    def cfg_calls(self, model):
        return self.d.cfg_calls(model) if callable(self.d.cfg_calls) else self.d.cfg_calls

    def no_cfg_pair(self, model) -> str:
        return self.d.no_cfg_pair

    def kohya_lora_names(self, keys):
        names = self.d.kohya_names
        return None if names is None else names(keys) if callable(names) else dict(names)

    def unused_parameters(self, model, pairs: bool = False):
        unused = self.d.unused(pairs) if callable(self.d.unused) else self.d.unused
        if isinstance(unused, str):
            return [n for n, _ in model.named_parameters() if re.match(unused, n)]
        return [] if unused is None else last_block_parameters(model, *unused)

    # ---- prompts -------------------------------------------------------------------------------------------
    def text_encoder(self, path, device, dtype, model) -> TextEncoder:
        """The pipeline's text components from `path` (a pipeline folder, or for one encoder a folder holding it and
        its tokenizer), held by the pipeline (the model's) whose encoding code the feed runs."""
        pipeline = self.pipeline_type(self.pipeline_name(model))
        parts = {arg: _text_part(path, arg, self.d.text, device, dtype, pipeline) for arg in self.d.text}
        encoder = next(v for k, v in parts.items() if not k.startswith("tokenizer"))
        tokenizer = next(v for k, v in parts.items() if k.startswith("tokenizer"))
        constants = self.models[model].constants
        if self.d.text_model is not None:
            self._check_text_model(path, model, type(encoder).__name__)
        made = (self.d.text_pipeline(pipeline, parts, constants) if self.d.text_pipeline
                else (self.d.make_pipeline or _construct)(pipeline, parts))
        return TextEncoder(encoder, tokenizer, constants["max_sequence_length"],
                           tuple(constants.get("text_layers", ())), pipeline=made)

    def _check_text_model(self, path, model: str, found: str) -> None:
        part, words = self.d.text_model(model)
        if part not in found:
            tiny = self.models[model].constants.get("tiny_text")
            how = f", or for {model}: python -m opendit.families.wrapped.tiny_text {model} DIR" if tiny else ""
            raise ValueError(f"--text_encoder {path}: a {found}, not the {words} (its pipeline folder{how})")

    def encode_prompts(self, encoder, captions, device, references=None) -> dict:
        given = {} if references is None else {"references": references}
        return self.feed.encode(encoder, list(captions), device, **given)

    def random_conditions(self, spec, batch, device) -> dict:
        def dim(d):
            return spec.constants["max_sequence_length"] if d == "L" else spec.arch[d] if isinstance(d, str) else d
        return {name: torch.ones(batch, *map(dim, shape), dtype=torch.bool, device=device) if name.startswith("mask")
                else torch.randn(batch, *map(dim, shape), device=device)
                for name, shape in self.d.conditions.items()}

    # ---- latents -------------------------------------------------------------------------------------------
    def load_vae(self, path, device):
        vae = super().load_vae(path, device)
        return vae if self.d.vae_repair is None else self.d.vae_repair(vae)

    def vae_geometry(self, vae) -> tuple[int, int]:
        if self.d.vae_kind == "frame" and not hasattr(vae.config, "block_out_channels"):
            return 2 ** len(vae.temperal_downsample), vae.config.z_dim
        if self.d.vae_kind == "dc" and hasattr(vae.config, "encoder_block_out_channels"):
            return 2 ** (len(vae.config.encoder_block_out_channels) - 1), vae.config.latent_channels
        if self.d.vae_kind == "stated" and hasattr(vae, "spatial_compression_ratio"):  # not the planner's stand-in
            return vae.spatial_compression_ratio, vae.config.latent_channels
        if self.d.vae_kind == "factors" and hasattr(vae.config, "scale_factor_spatial"):  # not the planner's stand-in
            return vae.config.scale_factor_spatial, vae.config.z_dim
        return super().vae_geometry(vae)

    def temporal_downsampling(self, vae) -> int:
        if self.d.vae_kind == "factors" and hasattr(vae.config, "scale_factor_temporal"):  # not the planner's
            return vae.config.scale_factor_temporal
        return super().temporal_downsampling(vae)

    def posterior(self, vae, images):
        x = _opaque_alpha(vae, images).to(next(vae.parameters()).dtype)
        if self.d.vae_kind == "dc":  # deterministic: its latent, with no spread
            z = vae.encode(x).latent.float()
            return z, torch.zeros_like(z)
        if self.d.vae_kind == "frame":
            posterior = vae.encode(x[:, :, None]).latent_dist
            return posterior.mean[:, :, 0].float(), posterior.std[:, :, 0].float()
        return super().posterior(vae, images)

    def to_model_space(self, vae, z):
        return self.feed.to_model(vae, z)

    # ---- the forward ---------------------------------------------------------------------------------------
    def forward_kwargs(self, model, x, t, cond, cfg) -> dict:
        return self.feed.forward(model, x, t, cond)

    def from_output(self, out, shape):
        return self.feed.output(out, shape)

    def forward_macs(self, model, txt_tokens, img_tokens) -> int:
        """Each Linear costs its stream's rows (Streams) * in * out; each block's attention 2 * L^2 * width over
        its stream (or what its Streams function counts)."""
        s = self.d.streams
        text = txt_tokens + (s.added(model) if s.added else 0)
        rows = {"one": 1, "joint": text + img_tokens, "text": text, "prompt": txt_tokens, "image": img_tokens}

        own = {pattern: count(model) for pattern, count in s.rows.items()}

        def rows_of(name: str) -> int:
            found = next((n for pattern, n in own.items() if re.search(pattern, name)), None)
            if found is not None:
                return found
            return rows[next((k for k in ("one", "joint", "text", "prompt") if re.search(getattr(s, k), name)),
                             "image")]
        width = 1
        for key in s.width:
            width *= model.config[key]

        def blocks_of(name: str) -> int:  # "list", or "list.attr": those of its blocks whose attr is not None
            try:
                return len(model.get_submodule(name))
            except AttributeError:
                blocks, _, attr = name.rpartition(".")
                return sum(getattr(block, attr) is not None for block in model.get_submodule(blocks))

        def block_attention(stream) -> int:  # one block's: softmax over a stream, else the model's own count
            return stream(model, txt_tokens, img_tokens) if callable(stream) else 2 * rows[stream] ** 2 * width
        attention = sum(blocks_of(name) * block_attention(stream) for name, stream in s.attention.items())
        return matmul_macs(model, rows_of) + attention

    # ---- sampling ------------------------------------------------------------------------------------------
    @staticmethod
    def pipeline_type(name: str):
        import diffusers
        return getattr(diffusers, name)

    def pipeline(self, model, vae, scheduler_folder, name=None, **components):
        from diffusers import FlowMatchEulerDiscreteScheduler
        scheduler = (FlowMatchEulerDiscreteScheduler.from_pretrained(scheduler_folder) if scheduler_folder
                     else FlowMatchEulerDiscreteScheduler(**self.scheduler_config))
        name = name or self.pipeline_class
        chosen = self.d.sampling_pipeline() if self.d.sampling_pipeline else self.pipeline_type(name)
        pipe = (self.d.make_pipeline or _construct)(chosen, dict(scheduler=scheduler, vae=vae, transformer=model,
                                                                 **self.pipeline_options.get(name, {}), **components))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def pipeline_components(self, sample_cfg) -> dict:
        return {} if self.d.sampling_components is None else self.d.sampling_components(sample_cfg)

    def pipeline_latents(self, noise):
        return pack(noise) if self.d.packed_latents else noise

    def pipeline_call(self, loaded, sample_cfg, cond, negative) -> dict:
        return self.feed.call(self.models[loaded.cfg.model].constants, sample_cfg, cond, negative)

    def reference_call(self, references, height: int, width: int) -> dict:
        return self.d.reference_call(references, height, width)


def _opaque_alpha(vae, images: torch.Tensor) -> torch.Tensor:
    """RGB images with an opaque alpha channel where the VAE reads RGBA (its config's in_channels 4: Qwen-Image
    2.1's), as its pipeline converts images to RGBA; other images as they are."""
    if getattr(vae.config, "in_channels", None) == 4 and images.shape[1] == 3:
        return torch.cat([images, torch.ones_like(images[:, :1])], dim=1)
    return images


def _construct(pipeline_class, components: dict):
    """pipeline_class with `components`, every other constructor argument its default, or None where it has none
    (no text encoder: prompts are encoded apart; no transformer: a pipeline that only encodes)."""
    parameters = inspect.signature(pipeline_class.__init__).parameters
    return pipeline_class(**{n: components.get(n) for n, p in parameters.items()
                             if n != "self" and (n in components or p.default is inspect.Parameter.empty)})


def _text_part(path: str, arg: str, text: Mapping[str, str], device, dtype, pipeline_class):
    """The text component `arg` (a pipeline argument, in `text[arg]`/ of a pipeline folder): a tokenizer
    (AutoTokenizer), an encoder (the transformers class its config names), or a diffusers model of the pipeline's text
    side (its config's `_class_name`, as the pipeline's module imports it: LTX-2's text connectors)."""
    import transformers
    tokenizer, sub = arg.startswith("tokenizer"), text[arg]
    marker = "tokenizer_config.json" if tokenizer else "config.json"
    if len(text) == 2:  # one encoder: a folder holding it and its tokenizer, or a pipeline folder (its tokenizer in
        # its own subfolder or beside the encoder)
        subs = (sub, *(s for a, s in text.items() if not a.startswith("tokenizer"))) if tokenizer else (sub,)
        folder = find_folder(path, subs, "tokenizer" if tokenizer else "text encoder", "--text_encoder", marker)
    else:
        folder = Path(path) / sub
        if not (folder / marker).is_file():
            raise FileNotFoundError(f"--text_encoder {path!r}: no {arg} in {sub}/; this model takes its pipeline "
                                    f"folder, holding {', '.join(s + '/' for s in text.values())}")
    if tokenizer:
        return transformers.AutoTokenizer.from_pretrained(folder)
    config = read_config(folder)
    if "_class_name" in config:
        model_class = getattr(inspect.getmodule(pipeline_class), config["_class_name"])
        return model_class.from_pretrained(folder, torch_dtype=dtype).to(device).eval().requires_grad_(False)
    named = (config.get("architectures") or ["AutoModel"])[0]
    model_class = getattr(transformers, named, transformers.AutoModel)
    return model_class.from_pretrained(folder, dtype=dtype).to(device).eval().requires_grad_(False)


def declared_family(d: Declared):
    """The family of a declared model: the image kind's (kind.DiffusersFamily), or with `fps` the video kind's
    (video.DiffusersVideoFamily: clips, frames, the pipeline's num_frames)."""
    from opendit.families.wrapped.kind import DiffusersFamily
    from opendit.families.wrapped.video import DiffusersVideoFamily
    return (DiffusersFamily if d.fps is None else DiffusersVideoFamily)(d.family, DeclaredGlue(d))
