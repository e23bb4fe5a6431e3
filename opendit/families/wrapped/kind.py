"""The diffusers-transformer family kind: a family whose model is diffusers' own transformer class, trained under
opendit's whole stack (every plugin, activation checkpointing and --compile per block, master-weight modes, the
sharded EMA, exact resume at another world size, LoRA, the lean optimizer, block swap, validation, previews) and
sampled through the model's own diffusers pipeline.

What differs per model is its glue (opendit.families.wrapped.glue.ModelGlue): prompts -> embeddings, images -> the
model's token space, the forward's arguments, the pipeline. A family is `DiffusersFamily(name, glue)`.

Data: the captioned digits demo (pixel space, through PixelSpace), a folder of captioned images / a CSV or JSONL
of path,caption through the model's VAE, or a latent cache of either (cache.py). Caption dropout for classifier-free
guidance replaces a caption's embedding by the empty caption's (p = --caption_dropout_prob). A model that takes
reference images (its constants' `references`: FLUX.1 Kontext, FLUX.2, FLUX.3, Qwen-Image-Edit) also trains on
editing pairs (the edit-digits demo, a target folder with its control folder, a stream of pairs, a latent cache of
pairs): the controls are encoded as its pipeline encodes a reference image and reach the forward as the condition
"references" [B, K, C', h', w'] (never dropped), which the feed appends to the sequence without noise; the loss covers
the target's tokens only. Where the prompt also sees the references (Qwen-Image-Edit), it is encoded with them and
caption dropout drops the instruction only.
"""
import dataclasses
import functools
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from opendit.checkpoint import load_weights
from opendit.checkpoint.folders import model_folder, read_config, read_safetensors
from opendit.data import (CAPTIONED_DIGITS, CAPTIONED_STREAMS, CAPTIONS, EDIT_DIGITS, EDIT_PAIRS, EDIT_STREAMS, LATENTS,
                          dataset_map)
from opendit.data.latents import MANIFEST, read_manifest
from opendit.diffusion.flow import TIMESTEP_SAMPLINGS
from opendit.encoders.text import encoder_dtype
from opendit.families.base import NegativePromptOption, preview_prompts, prompt_conditions
from opendit.families.latent import LatentImageFamily, is_none
from opendit.families.wrapped.cache import CachedConditions
from opendit.families.wrapped.first_block_cache import DEFAULT_THRESHOLD, first_block_cache
from opendit.families.wrapped.glue import ModelGlue, PixelSpace
from opendit.families.wrapped.objective import FixedPrompts, WrappedEncoders, WrappedObjective
from opendit.families.wrapped.references import reference_images, reference_sets
from opendit.options import opt
from opendit.seeding import sampling_generator

logger = logging.getLogger("opendit")
TEXT_HELP = "the text encoder: a folder with the model and its tokenizer, or the model's diffusers pipeline folder"


@dataclass(frozen=True)
class WrappedTrainOptions:
    text_encoder: str = opt("none", TEXT_HELP + ", required")
    caption_dropout_prob: float = opt(0.1, "a caption's embedding is replaced by the empty caption's this often "
                                           "(classifier-free guidance)", check="prob")
    timestep_sampling: str = opt("logit_normal", "training t ~ sigmoid(N(0, 1)) or uniform, unshifted",
                                 TIMESTEP_SAMPLINGS)
    scheduler: str | None = opt(None, "a diffusers pipeline folder (or its scheduler/) whose sampling schedule "
                                      "samples this model; default: the model's release settings")


@dataclass(frozen=True)
class WrappedCacheOptions:
    text_encoder: str = opt("none", TEXT_HELP + ": the --model's, whose prompt embeddings a cache stores")
    control_directory: str | None = opt(None, "editing pairs (--dataset edit_pairs): the folder of control images, "
                                              "each named as its target; the cache stores their latents")


@dataclass(frozen=True)
class WrappedSampleOptions(NegativePromptOption):
    text_encoder: str | None = opt(None, "the text encoder folder; default: the checkpoint's", from_checkpoint=True)
    image: str | None = opt(None, "an editing model: the reference image every prompt edits (several joined by "
                                  "commas), or a folder with one per prompt (in name order; or one folder of "
                                  "references per prompt), resized and cropped to the sample size as training's "
                                  "controls are")


@dataclass
class PipelineSampler:
    steps: int
    first_block_cache: float | None = None  # --cache fbcache's threshold (diffusers' First Block Cache), None: off
    references: list | None = None  # an editing model's --image: each prompt's reference files (references.py)


class DiffusersFamily(CachedConditions, LatentImageFamily):
    """A family of one ModelGlue's models (see the module's docstring)."""
    datasets = dataset_map(CAPTIONED_DIGITS, CAPTIONS, LATENTS, *CAPTIONED_STREAMS, EDIT_DIGITS, EDIT_PAIRS,
                           *EDIT_STREAMS)
    samplers = ("euler",)  # the pipeline's scheduler (FLUX.2: FlowMatchEulerDiscreteScheduler)
    train_options = WrappedTrainOptions
    sample_options = WrappedSampleOptions
    encoder_folders = ("vae", "text_encoder")
    cache_options = WrappedCacheOptions
    cache_keys = ("model", "text_encoder")  # a cache is one model's (its prompt embeddings)
    default_vae_scale = 1.0  # the glue normalises latents (FLUX.2: the VAE's batch-norm statistics)
    cache_thresholds = {"fbcache": DEFAULT_THRESHOLD}

    def __init__(self, name: str, glue: ModelGlue):
        self.name, self.glue = name, glue
        self.models = {n: dataclasses.replace(spec, constructor=glue) for n, spec in glue.models.items()}
        self.lora_targets = glue.lora_targets
        self.vae_channels, self.vae_params, self.vae_downsampling = glue.vae_channels, glue.vae_params, \
            glue.vae_downsampling
        self.vae_temporal = getattr(glue, "vae_temporal", 1)
        self.defaults_help = {"sampler": f"{name}: its diffusers pipeline ({glue.pipeline_class})"}
        self.title = glue.title or name
        self.built_from = f"diffusers' `{glue.transformer_class}` / `{glue.pipeline_class}`"
        self.weight_formats = "diffusers folders" + (", official single files" if glue.official_converter else "")

    def constant(self, model: str, key: str):
        return self.models[model].constants[key]

    def default_sampling_steps(self, cfg: WrappedTrainOptions) -> int:
        return self.constant(cfg.model, "steps")

    def text_encoder_bytes(self, cfg, device) -> dict:
        """The memory planner's: the declared text encoders' parameters (text_params) as they load on `device`."""
        return {"text encoder": encoder_dtype(device).itemsize * self.constant(cfg.model, "text_params")}

    def patch_size(self, cfg) -> int:
        return self.glue.patch_of(cfg.model)

    # ---- configuration and data ---------------------------------------------------------------------------
    def fill_defaults(self, cfg):
        pairs = self.trains_on_pairs(cfg)
        if self.glue.references_required and cfg.model in self.models and self.references(cfg.model):
            if pairs is False:
                raise ValueError(f"--dataset {cfg.dataset}: {cfg.model} edits images, it trains on editing pairs "
                                 f"(--dataset edit_pairs with --control_directory, or the edit_digits demo)")
            if getattr(cfg, "sample_every", 0):
                raise ValueError(f"--sample_every {cfg.sample_every}: {cfg.model} samples only with reference "
                                 f"images, which previews do not give yet; leave it out and sample checkpoints with "
                                 f"sample.py --image")
        if pairs and cfg.model in self.models and not self.references(cfg.model):
            editing = [n for n in self.models if self.references(n)]
            raise ValueError(f"--dataset {cfg.dataset}: {cfg.model} takes no reference image, so it cannot learn from "
                             f"editing pairs; " + (f"train {' or '.join(editing)}" if editing else
                                                   f"no {self.name} model does (README's models table names those "
                                                   f"that do)"))
        return dataclasses.replace(super().fill_defaults(cfg), num_classes=0)

    def trains_on_pairs(self, cfg) -> bool | None:
        """Whether the run's data are editing pairs: a dataset of pairs, or a latent cache of them (its manifest
        counts their controls); None for a cache not written yet."""
        spec = self.dataset_spec(cfg)
        if not spec.cache:
            return spec.pairs
        if cfg.data_path and os.path.isfile(os.path.join(cfg.data_path, MANIFEST)):
            return read_manifest(cfg.data_path).get("controls_per_target", 0) > 0
        return None

    def references(self, model: str) -> int:
        """How many reference images the registered `model` takes (0: none)."""
        return self.models[model].constants.get("references", 0)

    def load_encoders(self, cfg: WrappedTrainOptions | WrappedCacheOptions, device, training: bool) -> WrappedEncoders:
        if is_none(cfg.text_encoder):
            raise ValueError(f"{cfg.model} needs --text_encoder <local folder> ({TEXT_HELP}); the demo makes a tiny "
                             f"one: RECIPE=digits bash train_diffusers.sh")
        if training and self.dataset_spec(cfg).cache:  # the prompts are in the cache; the VAE normalises latents
            return WrappedEncoders(vae=self._vae(cfg, device), text=None, glue=self.glue)
        text = self.glue.text_encoder(cfg.text_encoder, device, encoder_dtype(device), cfg.model)
        return WrappedEncoders(vae=self._vae(cfg, device), text=text, glue=self.glue)

    def _vae(self, cfg, device):
        if is_none(cfg.vae):
            return PixelSpace(self.pixel_channels(cfg)).to(device)
        return self.glue.load_vae(cfg.vae, device)

    def dataset_options(self, cfg: WrappedTrainOptions, encoders, spec) -> dict:
        if spec.cache:
            return {"seed": cfg.global_seed}
        return {"channels": self.source_channels(cfg, encoders)}

    def load_data(self, cfg: WrappedTrainOptions, encoders):
        dataset, cfg = super().load_data(cfg, encoders)
        controls = getattr(dataset, "controls_per_target", 0)
        if controls and self.glue.reference_pixels is not None and isinstance(encoders.vae, PixelSpace):
            raise ValueError(f"--vae none (pixel space): {cfg.model}'s pipeline hands its references to the VAE at an "
                             f"area of its own (about 1024 x 1024), hundreds of thousands of tokens in pixel space; "
                             f"give --vae (the vae/ of its pipeline folder)")
        if controls > self.references(cfg.model):
            raise ValueError(f"{cfg.data_path or cfg.dataset}: {controls} controls per target; {cfg.model} takes "
                             f"{self.references(cfg.model)} reference image(s): keep that many per target")
        if self.dataset_spec(cfg).cache:
            self.use_cache(cfg, encoders, dataset)
        return dataset, cfg

    def source_channels(self, cfg, encoders) -> int:
        return self.pixel_channels(cfg) if isinstance(encoders.vae, PixelSpace) else 3

    def data_settings(self, cfg, dataset):
        return dataclasses.replace(cfg, num_classes=0)

    def size_step(self, cfg, encoders) -> int:
        return self._downsampling(encoders.vae) * self.patch_size(cfg)

    def downsampling(self, loaded) -> int:
        """Pixels per side of one position of the model's input: the VAE's downsampling (x the 2x2 patches the
        glue packs before the model)."""
        return self._downsampling(loaded.encoders.vae) * self.glue.outside_patch

    def _downsampling(self, vae) -> int:
        return self.glue.vae_geometry(vae)[0]

    # ---- model ---------------------------------------------------------------------------------------------
    def latent_shape(self, cfg: WrappedTrainOptions | WrappedCacheOptions, encoders, dataset=None,
                     data_channels=None) -> tuple[int, ...]:
        vae = encoders.vae if encoders.vae is not None else self._vae(cfg, "cpu")
        down, patch, packed = self._downsampling(vae), self.patch_size(cfg), self.glue.outside_patch
        if cfg.image_size % (down * patch):
            raise ValueError(f"--image_size {cfg.image_size} must be a multiple of {down * patch} (the VAE's "
                             f"downsampling x {cfg.model}'s {patch}x{patch} patches)")
        side = cfg.image_size // (down * packed)
        return self.glue.vae_geometry(vae)[1] * packed * packed, side, side

    def build_model(self, cfg: WrappedTrainOptions, latent_shape):
        model = self.models[cfg.model].build(in_channels=latent_shape[0])
        for name in self.glue.unused_parameters(model, pairs=bool(self.trains_on_pairs(cfg))):
            model.get_parameter(name).requires_grad_(False)
        # (text, image or video) tokens per sample, for the FLOP count
        tokens = math.prod(latent_shape[1:]) * self.glue.outside_patch ** 2 // self.patch_size(cfg) ** 2
        model.num_tokens = (self.constant(cfg.model, "max_sequence_length"), tokens)
        model.cfg_calls = self.glue.cfg_calls(cfg.model)  # how --cfg_parallel splits its pipeline's guidance
        return model

    def train_flops_per_sample(self, model) -> float:
        return 3 * 2 * float(self.glue.forward_macs(model, *model.num_tokens))

    def objective(self, cfg: WrappedTrainOptions, encoders) -> WrappedObjective:
        logger.info("objective of %s: %s; t ~ %s", cfg.model, self.glue.recipe, cfg.timestep_sampling)
        return WrappedObjective(encoders, cfg, pairs=self.dataset_spec(cfg).pairs)

    def memory_inputs(self, cfg: WrappedTrainOptions, model, latent_shape, batch, device) -> dict:
        cond = self.glue.random_conditions(self.models[cfg.model], batch, device)
        x = torch.randn(batch, *latent_shape, device=device)
        return self.glue.forward_kwargs(model, x, torch.rand(batch, device=device), cond, cfg)

    # ---- weights -------------------------------------------------------------------------------------------
    def load_weights(self, path: str) -> dict[str, torch.Tensor]:
        """{diffusers key: tensor}: a diffusers folder of the glue's transformer (or a pipeline folder holding it in
        transformer/) as it is, an official single file through diffusers' converter, else opendit's formats."""
        folder = self._diffusers_folder(path)
        if folder is not None:
            return read_safetensors(folder)
        if self._is_official(path):
            logger.info("converting the official layout of %s with diffusers' %s", path, self.glue.official_converter)
            return self.glue.convert_official(read_safetensors(path))
        return load_weights(path)

    def kohya_lora_names(self, keys) -> dict[str, tuple[str, ...]] | None:
        return self.glue.kohya_lora_names(keys)

    def _diffusers_folder(self, path, other_class_is_none: bool = False) -> str | None:
        """The folder holding the glue's transformer; one holding another class is an error (or None when asked:
        another family may know it)."""
        folder = model_folder(path) if Path(path).is_dir() else None
        if folder is None or "_class_name" not in read_config(folder):
            return None
        found = read_config(folder)["_class_name"]
        if found != self.glue.transformer_class:
            if other_class_is_none:
                return None
            raise ValueError(f"{path!r} holds a {found}, not the {self.glue.transformer_class} of the {self.name} "
                             f"models ({', '.join(self.models)})")
        return folder

    def _is_official(self, path) -> bool:
        if Path(path).suffix != ".safetensors" or not self.glue.official_key:
            return False
        wanted = (self.glue.official_key,) if isinstance(self.glue.official_key, str) else self.glue.official_key
        with safe_open(path, "pt") as f:
            keys = list(f.keys())
        return all(any(k.endswith(w) for k in keys) for w in wanted)

    def recognize_checkpoint(self, path: str):
        """A diffusers folder of the glue's transformer (a pipeline folder also names its VAE, text encoder and
        scheduler) or an official single file: the registered model whose architecture its config has."""
        folder = self._diffusers_folder(path, other_class_is_none=True)
        if folder is None:
            return None if not self._is_official(path) else (dict(dataset="captions", image_size=1024), None)
        config = read_config(folder)
        differ = {n: [k for k, v in spec.arch.items()
                      if k not in self.glue.run_keys and _same(config.get(k), v) is False]
                  for n, spec in self.models.items()}
        matching = [n for n, keys in differ.items() if not keys]
        if not matching:
            raise ValueError(f"{folder}: a {config['_class_name']} that no registered {self.name} model matches "
                             f"(each differs in: {differ}); opendit trains {', '.join(self.models)}")
        root = Path(path)
        # models of one architecture (FLUX.1-dev and Kontext, Qwen-Image and its edit models): a pipeline folder's
        # pipeline class tells them apart
        index = root / "model_index.json"
        pipeline = json.loads(index.read_text()).get("_class_name") if index.is_file() else None
        name = next((n for n in matching if self.glue.pipeline_name(n) == pipeline), matching[0])
        edits = self.glue.references_required and self.references(name)
        settings = dict(model=name, dataset="edit_pairs" if edits else "captions", image_size=1024)
        if folder != str(root):  # a pipeline folder: its other components
            for key, sub in (("vae", "vae"), ("text_encoder", "text_encoder"), ("scheduler", "scheduler")):
                if (root / sub).is_dir():
                    settings[key] = str(root if key != "vae" else root / sub)
        return settings, None

    # ---- sampling ------------------------------------------------------------------------------------------
    def sample_defaults(self, sample_cfg: WrappedSampleOptions, cfg: WrappedTrainOptions) -> dict:
        return {**super().sample_defaults(sample_cfg, cfg), "cfg_scale": self.constant(cfg.model, "cfg_scale")}

    def conditions(self, sample_cfg: WrappedSampleOptions, cfg: WrappedTrainOptions) -> list:
        return prompt_conditions(sample_cfg, cfg.model)

    def make_sampler(self, sample_cfg: WrappedSampleOptions, cfg: WrappedTrainOptions) -> PipelineSampler:
        """The pipeline samples and decodes: opendit's options that hook either are refused, not ignored; --cache
        fbcache is diffusers' own First Block Cache."""
        references = None
        if sample_cfg.image is None and self.glue.references_required and self.references(cfg.model):
            raise ValueError(f"{cfg.model} edits images: give the reference image(s) with --image (a file, files "
                             f"joined by commas, or a folder with one per prompt)")
        if sample_cfg.image is not None:
            if not self.references(cfg.model):
                raise ValueError(f"--image {sample_cfg.image}: {cfg.model} takes no reference image; leave --image "
                                 f"out (or sample an editing model)")
            references = reference_sets(sample_cfg.image, len(self.conditions(sample_cfg, cfg)), cfg.model,
                                        self.references(cfg.model))
        if sample_cfg.cache == "fbcache" and sample_cfg.sequence_parallel_size > 1:
            raise ValueError("--cache fbcache with --sequence_parallel_size: diffusers' First Block Cache decides on "
                             "each rank's own tokens, so the ranks could part ways; leave one of them out")
        if sample_cfg.cfg_parallel and sample_cfg.cache == "fbcache":
            raise ValueError("--cache fbcache with --cfg_parallel: diffusers' First Block Cache keeps one state per "
                             "guidance branch, which the two ranks would split; leave one of them out")
        if sample_cfg.cfg_parallel and self.glue.cfg_calls(cfg.model) is None:
            raise ValueError(f"--cfg_parallel: {cfg.model} has no pair of guidance calls to split "
                             f"({self.glue.no_cfg_pair(cfg.model)}); leave it out")
        hooked = {f"--cache {sample_cfg.cache}": sample_cfg.cache not in ("none", "fbcache"),
                  "--vae_tiling": sample_cfg.vae_tiling or sample_cfg.vae_tile_size is not None,
                  "--parallel_decode": sample_cfg.parallel_decode}
        if any(hooked.values()):
            raise ValueError(f"{', '.join(k for k, v in hooked.items() if v)}: {cfg.model} samples and decodes "
                             f"through its diffusers pipeline ({self.glue.pipeline_name(cfg.model)}), which this "
                             f"option does not reach yet; leave it out")
        return PipelineSampler(sample_cfg.num_sampling_steps,
                               sample_cfg.cache_threshold if sample_cfg.cache == "fbcache" else None, references)

    def sampling_encoders(self, cfg: WrappedTrainOptions, encoders, device):
        return encoders

    @torch.no_grad()
    def sample_batch(self, loaded, sampler, indices, conditions, sample_cfg, device) -> np.ndarray:
        """The pipeline's images (its own decoding and post-processing, as its PIL images are) for global indices;
        the noise from (seed, first index), the prompt embeddings from the family's encoder (an editing model's
        with the references, where its prompt sees them); an editing model's samples in one pipeline call, one per
        set of reference images where its pipeline gives one set to its whole batch (glue.references_per_sample
        False), or one per prompt (glue.one_prompt_per_call)."""
        enc, (h, w) = loaded.encoders, loaded.latent_shape[-2:]
        noise = torch.randn(len(indices), *loaded.latent_shape,
                            generator=sampling_generator(sample_cfg.seed, indices.start))
        scheduler = None if loaded.cfg.scheduler is None else _scheduler_folder(loaded.cfg.scheduler)
        pipe = self.glue.pipeline(loaded.model, enc.vae, scheduler, self.glue.pipeline_name(loaded.cfg.model),
                                  **self.glue.pipeline_components(sample_cfg))
        height, width = h * self.downsampling(loaded), w * self.downsampling(loaded)
        sets = sampler.references or [None]
        grey = isinstance(enc.vae, PixelSpace) and enc.vae.config.latent_channels == 1

        def set_of(i: int) -> int:
            return i % len(conditions) % len(sets)
        images_of = functools.cache(lambda k: None if sets[k] is None else
                                    reference_images(sets[k], height, width, grey))
        prompts = [conditions[i % len(conditions)] for i in indices]
        if self.glue.prompt_references and sampler.references:  # each call's prompts see its references
            def prompts_of(rows, given):
                return (enc.encode([prompts[r] for r in rows], device, given),
                        enc.encode([sample_cfg.negative_prompt] * len(rows), device, given))
        else:
            cond = enc.encode(prompts, device)
            negative = {k: v.expand(len(indices), *v.shape[1:]) for k, v in enc.encode([sample_cfg.negative_prompt],
                                                                                       device).items()}

            def prompts_of(rows, given):
                return {k: v[rows] for k, v in cond.items()}, {k: v[rows] for k, v in negative.items()}
        rows_of: dict[int, list[int]] = {}  # {a call: the batch rows it samples}: one, one per reference set or row
        for row, i in enumerate(indices):
            call = row if self.glue.one_prompt_per_call else 0 if self.glue.references_per_sample else set_of(i)
            rows_of.setdefault(call, []).append(row)
        found = []
        for rows in rows_of.values():
            given = [images_of(set_of(indices[row])) for row in rows]
            references = {} if not self.references(loaded.cfg.model) else self.glue.reference_call(
                None if given[0] is None else given, height, width)
            with first_block_cache(loaded.model, sampler.first_block_cache):
                images = pipe(latents=self.glue.pipeline_latents(noise[rows].to(device)),
                             num_inference_steps=sampler.steps, height=height, width=width, output_type="np",
                             **self.size_kwargs(loaded, noise[rows].shape), **references,
                             **self.glue.pipeline_call(loaded, sample_cfg, *prompts_of(rows, given)))
            found.append((np.asarray(images[0]) * 255).round().astype(np.uint8))  # as diffusers' numpy_to_pil
        out = np.concatenate(found)
        out[np.concatenate(list(rows_of.values()))] = out.copy()  # back in the rows' order
        return out

    def size_kwargs(self, loaded, shape) -> dict:
        """The pipeline's size arguments beyond height and width for latents of `shape` (video: num_frames)."""
        return {}

    # ---- previews ------------------------------------------------------------------------------------------
    def preview_conditions(self, cfg: WrappedTrainOptions, dataset, rows: int) -> list:
        return preview_prompts(dataset, rows, cfg.model)

    def preview_encoders(self, cfg: WrappedTrainOptions, encoders: WrappedEncoders, conditions,
                         dataset) -> WrappedEncoders:
        if encoders.text is None:  # trained on a cache: the prompts' conditions are in it
            return dataclasses.replace(encoders, text=FixedPrompts(self.cached_preview_prompts(encoders, conditions,
                                                                                               dataset)))
        captions = list(dict.fromkeys([*conditions, ""]))
        found = encoders.encode(captions, "cpu")
        table = {c: {k: v[i] for k, v in found.items()} for i, c in enumerate(captions)}
        return dataclasses.replace(encoders, text=FixedPrompts(table))


def _same(found, registered) -> bool | None:
    """Whether a diffusers config value equals a registry value (lists and tuples alike); None when absent."""
    if found is None:
        return None
    return list(found) == list(registered) if isinstance(registered, (list, tuple)) else found == registered


def _scheduler_folder(path: str) -> str:
    folder = Path(path)
    if (folder / "scheduler" / "scheduler_config.json").is_file():
        return str(folder / "scheduler")
    if (folder / "scheduler_config.json").is_file():
        return str(folder)
    raise FileNotFoundError(f"--scheduler {path!r}: no scheduler_config.json there nor in its scheduler/")
