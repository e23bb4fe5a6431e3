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
from opendit.families.wrapped.glue import (ModelGlue, TextEncoder, WrappedSpec, find_folder, last_block_parameters,
                                           pack)
from opendit.perf import matmul_macs


def tokens_to_grid(out: torch.Tensor, shape) -> torch.Tensor:
    """The usual output: tokens [B, h * w, C] row by row -> [B, C, h, w]."""
    b, c, h, w = shape
    return out.transpose(1, 2).reshape(b, c, h, w)


@dataclass(frozen=True)
class Feed:
    """How one model is fed, each the pipeline's own way:
    encode(text: glue.TextEncoder, captions, device) -> {condition: [B, ...]} (a mask as bool; padded to the
      model's max_sequence_length, so that caption dropout can swap any two);
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
    order one (a single row: modulations, time embeddings), joint (text + image), text; the rest run on the image
    tokens. rows: {regex: model -> its row count} for Linears that run on a count of their own (tried first).
    attention: {block list: the stream its attention spans}; width: the arch keys whose product is the attention's
    inner width."""
    rows: Mapping[str, Callable] = field(default_factory=dict)
    one: str = r"^$"
    joint: str = r"^$"
    text: str = r"^$"
    attention: Mapping[str, str] = field(default_factory=dict)
    width: tuple[str, ...] = ("num_attention_heads", "attention_head_dim")


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
    vae_kind: str = "kl"  # "kl": a posterior of images; "frame": a video VAE given one frame; "dc": deterministic
    vae_size: tuple[int, float] = (4, 83_653_863)  # (latent channels, parameters) of its usual VAE, for the planner
    patch: int = 2  # latent positions per token side
    outside_patch: int = 2  # of those, packed before the model (1: the model patches itself)
    packed_latents: bool = True  # the pipeline takes its latents as tokens (else as a grid)
    cfg_calls: str | None = "pairs"  # how the pipeline guides (opendit.parallel.cfg): "pairs", "batched", None
    parallel_plan: object = None  # context_parallel.diffusers_plan(...), or None: it cannot be split
    derived: Mapping[str, Callable] = field(default_factory=dict)  # {arch key: f(arch)} the run's channels decide
    unused: tuple[str, tuple[str, ...]] | None = None  # (block list, modules) the last block computes for nothing
    repair: Callable | None = None  # model -> model, once built (what diffusers' class gets wrong on the meta device)
    official_key: str | tuple[str, ...] = ""  # key(s) only the release's single file has (all of them), and
    # diffusers' converter of that layout
    official_converter: str = ""
    kohya_names: Mapping | None = None  # {release name: (diffusers names, ...)} of kohya LoRA files, if not diffusers'


class DeclaredGlue(ModelGlue):
    """ModelGlue from a Declared: every method reads the declaration or calls the feed."""

    def __init__(self, d: Declared):
        self.d, self.feed, self.title, self.fps = d, d.feed, d.title, d.fps
        self.transformer_class, self.pipeline_class = d.transformer, d.pipeline
        self.scheduler_config, self.vae_class = dict(d.scheduler), d.vae
        self.vae_channels, self.vae_params = d.vae_size
        self.parallel_plan, self.lora_targets, self.recipe = d.parallel_plan, d.lora_targets, d.recipe
        self.patch, self.outside_patch = d.patch, d.outside_patch
        self.official_key, self.official_converter = d.official_key, d.official_converter
        self.run_keys = ("in_channels", *d.derived)
        self.models = {n: WrappedSpec(n, d.family, None, dict(s.arch), dict(s.constants)) for n, s in d.models.items()}

    def __call__(self, **config) -> nn.Module:
        model = super().__call__(**{**config, **{k: f(config) for k, f in self.d.derived.items()}})
        return model if self.d.repair is None else self.d.repair(model)

    def cfg_calls(self, model):
        return self.d.cfg_calls

    def kohya_lora_names(self, keys):
        return None if self.d.kohya_names is None else dict(self.d.kohya_names)

    def unused_parameters(self, model):
        return [] if self.d.unused is None else last_block_parameters(model, *self.d.unused)

    # ---- prompts -------------------------------------------------------------------------------------------
    def text_encoder(self, path, device, dtype, model) -> TextEncoder:
        """The pipeline's text components from `path` (a pipeline folder, or for one encoder a folder holding it and
        its tokenizer), held by the pipeline whose encoding code the feed runs."""
        parts = {arg: _text_part(path, arg, self.d.text, device, dtype) for arg in self.d.text}
        encoder = next(v for k, v in parts.items() if not k.startswith("tokenizer"))
        tokenizer = next(v for k, v in parts.items() if k.startswith("tokenizer"))
        constants = self.models[model].constants
        return TextEncoder(encoder, tokenizer, constants["max_sequence_length"],
                           tuple(constants.get("text_layers", ())),
                           pipeline=_construct(self.pipeline_type(self.pipeline_class), parts))

    def encode_prompts(self, encoder, captions, device) -> dict:
        return self.feed.encode(encoder, list(captions), device)

    def random_conditions(self, spec, batch, device) -> dict:
        def dim(d):
            return spec.constants["max_sequence_length"] if d == "L" else spec.arch[d] if isinstance(d, str) else d
        return {name: torch.ones(batch, *map(dim, shape), dtype=torch.bool, device=device) if name == "mask"
                else torch.randn(batch, *map(dim, shape), device=device)
                for name, shape in self.d.conditions.items()}

    # ---- latents -------------------------------------------------------------------------------------------
    def vae_geometry(self, vae) -> tuple[int, int]:
        if self.d.vae_kind == "frame" and not hasattr(vae.config, "block_out_channels"):
            return 2 ** len(vae.temperal_downsample), vae.config.z_dim
        if self.d.vae_kind == "dc" and hasattr(vae.config, "encoder_block_out_channels"):
            return 2 ** (len(vae.config.encoder_block_out_channels) - 1), vae.config.latent_channels
        return super().vae_geometry(vae)

    def posterior(self, vae, images):
        x = images.to(next(vae.parameters()).dtype)
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
        its stream."""
        s, rows = self.d.streams, {"one": 1, "joint": txt_tokens + img_tokens, "text": txt_tokens, "image": img_tokens}

        own = {pattern: count(model) for pattern, count in s.rows.items()}

        def rows_of(name: str) -> int:
            found = next((n for pattern, n in own.items() if re.search(pattern, name)), None)
            if found is not None:
                return found
            return rows[next((k for k in ("one", "joint", "text") if re.search(getattr(s, k), name)), "image")]
        width = 1
        for key in s.width:
            width *= model.config[key]
        attention = sum(len(getattr(model, blocks)) * rows[stream] ** 2 for blocks, stream in s.attention.items())
        return matmul_macs(model, rows_of) + 2 * attention * width

    # ---- sampling ------------------------------------------------------------------------------------------
    @staticmethod
    def pipeline_type(name: str):
        import diffusers
        return getattr(diffusers, name)

    def pipeline(self, model, vae, scheduler_folder, name=None, **components):
        from diffusers import FlowMatchEulerDiscreteScheduler
        scheduler = (FlowMatchEulerDiscreteScheduler.from_pretrained(scheduler_folder) if scheduler_folder
                     else FlowMatchEulerDiscreteScheduler(**self.scheduler_config))
        pipe = _construct(self.pipeline_type(name or self.pipeline_class),
                          dict(scheduler=scheduler, vae=vae, transformer=model, **components))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def pipeline_latents(self, noise):
        return pack(noise) if self.d.packed_latents else noise

    def pipeline_call(self, loaded, sample_cfg, cond, negative) -> dict:
        return self.feed.call(self.models[loaded.cfg.model].constants, sample_cfg, cond, negative)


def _construct(pipeline_class, components: dict):
    """pipeline_class with `components`, every other constructor argument None (no text encoder: prompts are
    encoded apart; no transformer: a pipeline that only encodes)."""
    names = [p for p in inspect.signature(pipeline_class.__init__).parameters if p != "self"]
    return pipeline_class(**{n: components.get(n) for n in names})


def _text_part(path: str, arg: str, text: Mapping[str, str], device, dtype):
    """The text component `arg` (a pipeline argument, in `text[arg]`/ of a pipeline folder): a tokenizer
    (AutoTokenizer) or an encoder (the transformers class its config names)."""
    import transformers
    tokenizer, sub = arg.startswith("tokenizer"), text[arg]
    marker = "tokenizer_config.json" if tokenizer else "config.json"
    if len(text) == 2:  # one encoder: a folder holding it and its tokenizer, or a pipeline folder
        folder = find_folder(path, (sub,), "tokenizer" if tokenizer else "text encoder", "--text_encoder", marker)
    else:
        folder = Path(path) / sub
        if not (folder / marker).is_file():
            raise FileNotFoundError(f"--text_encoder {path!r}: no {arg} in {sub}/; this model takes its pipeline "
                                    f"folder, holding {', '.join(s + '/' for s in text.values())}")
    if tokenizer:
        return transformers.AutoTokenizer.from_pretrained(folder)
    named = (read_config(folder).get("architectures") or ["AutoModel"])[0]
    model_class = getattr(transformers, named, transformers.AutoModel)
    return model_class.from_pretrained(folder, dtype=dtype).to(device).eval().requires_grad_(False)


def declared_family(d: Declared):
    """The family of a declared model: the image kind's (kind.DiffusersFamily), or with `fps` the video kind's
    (video.DiffusersVideoFamily: clips, frames, the pipeline's num_frames)."""
    from opendit.families.wrapped.kind import DiffusersFamily
    from opendit.families.wrapped.video import DiffusersVideoFamily
    return (DiffusersFamily if d.fps is None else DiffusersVideoFamily)(d.family, DeclaredGlue(d))
