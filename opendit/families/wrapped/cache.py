"""Latent and text-embedding caches of the diffusers-transformer kind, a mixin of DiffusersFamily:

    python preprocess.py --family flux2 --model flux2-klein-4b --vae PIPE --text_encoder PIPE \
        --dataset captions --data_path photos/ --image_size 1024 --out cache/photos
    python train.py --model flux2-klein-4b --dataset latents --data_path cache/photos ...

A cache stores each image's VAE posterior (mean and std, unscaled, in the VAE's own space) and its caption's
conditions exactly as the glue's encode_prompts gives them (the pipeline's own prompt encoding, masks included), as
arrays named cond_<key>, and once the empty caption's (caption dropout). Training on it loads the VAE (the glue's
normalisation reads it; it is small) but never the text encoder, and draws the posterior sample as encoding on the
fly does, so both train alike. The cache is for one --model (its text encoder, hidden layers and length): another
model is refused. Video models (opendit.families.wrapped.video) cache fixed clips of --num_frames the same way.

A cache of editing pairs (--dataset edit_pairs --control_directory, edit_digits) also stores each pair's controls as
their posterior means, unscaled (control_mean [K, C, h, w]: the mode a pipeline encodes a reference image with);
training takes them to model space as reference_latents does and hands them to the forward as "references". A model
whose prompt sees the controls (Qwen-Image-Edit) gets them resized as its pipeline hands them to its VAE, its prompt
conditions encoded with the pictures, and per pair the empty instruction's with them (dropped_<key>: its caption
dropout). It records its control folder (the manifest's source): a run that names another one is refused. In pixel
space (--vae none) the cache holds the pixels themselves (std 0), which training takes as they are, as it takes
pixels.
"""
import dataclasses
import os

import torch

from opendit.data.captions import LabelledCaptions, distinct_captions
from opendit.families.latent import is_none
from opendit.families.wrapped.glue import ModelGlue, PixelSpace
from opendit.families.wrapped.references import control_images, reference_inputs

COND = "cond_"  # a cached condition's array name: cond_<the glue's key>
CONTROL_MEAN = "control_mean"  # a cached pair's controls: their posterior means [K, C, h, w], unscaled
# a cached pair's conditions of the empty instruction with its pictures (a model whose prompt sees the controls:
# its caption dropout), dropped_<the glue's key>
DROPPED = "dropped_"


def cached_references(glue: ModelGlue, vae, control_mean: torch.Tensor) -> torch.Tensor:
    """A batch of cached pairs' control_mean [B, K, C, h, w] -> the references [B, K, C', h', w'] in model space, as
    reference_latents makes them from the controls."""
    return glue.to_model_space(vae, control_mean.flatten(0, 1).float()).float().unflatten(0, control_mean.shape[:2])


class LabelledPairs(LabelledCaptions):
    """Editing pairs (target, controls [K, C, H, W], instruction) -> (target, label, instruction, controls), the
    layout preprocess.py encodes (label: the digit each target shows where the data knows it, else 0)."""

    def __init__(self, dataset):
        super().__init__(dataset)
        self.controls_per_target = dataset.controls_per_target

    def __getitem__(self, i):
        target, controls, caption = self.dataset[i]
        return target, int(self.labels[i]) if self.labels is not None else 0, caption, controls


class CachedConditions:
    """preprocess.py's hooks and what training on a cache needs (see the module's docstring)."""

    def resolve_cache_config(self, cfg):
        if cfg.model not in self.models:
            raise ValueError(f"--model {cfg.model}: a {self.name} cache is for one model (its prompt embeddings "
                             f"are that model's); name one of: {', '.join(self.models)}")
        if is_none(cfg.text_encoder):
            raise ValueError(f"--text_encoder is required: {cfg.model}'s prompts are cached through it (its folder, "
                             f"or the model's pipeline folder)")
        if is_none(cfg.vae):  # pixel space: the pixels are cached as they are
            return dataclasses.replace(cfg, vae_scale=self.default_vae_scale if cfg.vae_scale is None else
                                       cfg.vae_scale)
        return super().resolve_cache_config(cfg)

    def cache_encoders(self, cfg, device):
        return self.load_encoders(cfg, device, training=False)

    def cache_source(self, cfg, encoders):
        """(image [C, H, W] in [-1, 1] (RGB through a VAE, else the data's channels), label (the digit of the
        captioned digits, else 0), caption), unflipped; editing pairs add their controls [K, C, H, W]."""
        self.latent_shape(cfg, encoders)  # the image size fits the VAE and the patches, else a clear error
        spec = self.dataset_spec(cfg)
        if spec.pairs and cfg.flip_both:
            raise ValueError(f"--flip_both: a latent cache of editing pairs (--dataset {cfg.dataset}) holds each pair "
                             f"as it is (a flip would flip its controls too); leave --flip_both out")
        settings = {name: getattr(cfg, name) for name in spec.settings if hasattr(cfg, name)} if spec.pairs else {}
        dataset = spec(cfg.data_path, cfg.image_size, channels=self.source_channels(cfg, encoders), **settings)
        if cfg.buckets:
            self.use_buckets(dataset, cfg, encoders)
        return LabelledPairs(dataset) if spec.pairs else LabelledCaptions(dataset)

    def _posterior(self, vae, x) -> tuple[torch.Tensor, torch.Tensor]:
        """Images x [B, C, H, W] (or clips) -> (mean, std) float32 as a cache stores them: the VAE posterior's,
        unscaled; in pixel space the pixels (in its channels) and a std of 0."""
        if isinstance(vae, PixelSpace):
            mean = vae.encode(x).latent_dist.mean.float()
            return mean, torch.zeros_like(mean)
        return self.glue.posterior(vae, x.to(next(vae.parameters()).device))

    @torch.no_grad()
    def cache_encode(self, encoders, x, captions=None, controls=None) -> dict:
        """A batch -> {"mean", "std": [B, C, h, w], cond_<key>: the captions' conditions, control_mean: the
        controls' [B, K, C, H, W] posterior means [B, K, C, h, w] (editing pairs)}, float32 on the CPU."""
        mean, std = self._posterior(encoders.vae, x)
        out = {"mean": mean.cpu(), "std": std.cpu()}
        seen = None if controls is None or not self.glue.prompt_references else control_images(controls)
        if captions is not None:
            out.update({COND + k: v.float() for k, v in encoders.encode(list(captions), "cpu", seen).items()})
            if seen is not None:  # the prompt sees the pictures: caption dropout's empty instruction with them
                out.update({DROPPED + k: v.float() for k, v in encoders.encode([""] * len(seen), "cpu", seen).items()})
        if controls is not None:
            pixels = reference_inputs(self.glue, controls)  # as the pipeline hands them to the VAE
            means = self._posterior(encoders.vae, pixels.flatten(0, 1))[0]
            out[CONTROL_MEAN] = means.unflatten(0, pixels.shape[:2]).cpu()
        return out

    def cache_extras(self, encoders) -> dict:
        """The empty caption's conditions (caption dropout while training)."""
        return {COND + k: v.float() for k, v in encoders.empty_conditions("cpu").items()}

    def use_cache(self, cfg, encoders, dataset) -> None:
        """Training on `dataset` (a cache): its conditions must be this model's (names and shapes), else an error
        naming both, and a --control_directory the cache's; encoders learn their order (a cache of pairs: with its
        control_mean, which prepare reads as the references) and the empty caption's."""
        declared = self.glue.random_conditions(self.models[cfg.model], 1, "meta")  # shapes, no RNG drawn
        found = {name.removeprefix(COND): name for name in dataset.embeddings if name.startswith(COND)}
        empty = {k: dataset.extra(found[k]) for k in declared if k in found}
        shapes = {k: tuple(v.shape) for k, v in empty.items()}
        if shapes != {k: tuple(v.shape[1:]) for k, v in declared.items()}:
            raise ValueError(f"latent cache {cfg.data_path!r} holds the conditions {shapes or 'none'}, not those of "
                             f"{cfg.model} ({ {k: tuple(v.shape[1:]) for k, v in declared.items()} }); rebuild it "
                             f"with preprocess.py --family {self.name} --model {cfg.model} --text_encoder ...")
        self._check_controls(cfg, dataset)
        names = tuple(n.removeprefix(COND) for n in dataset.embeddings)
        encoders.cached = tuple(k for k in names if k.removeprefix(DROPPED) in declared or k == CONTROL_MEAN)
        dtypes = {k: v.dtype for k, v in declared.items()}  # masks come back as floats
        encoders.dtypes = dtypes | {DROPPED + k: v for k, v in dtypes.items()} | {CONTROL_MEAN: torch.float32}
        encoders.empty = {k: v.to(encoders.dtypes[k]) for k, v in empty.items()}

    @staticmethod
    def _check_controls(cfg, dataset) -> None:
        """--control_directory given to a run on a cache must be the folder the cache's controls came from."""
        given = getattr(cfg, "control_directory", None)
        cached = dataset.manifest.get("source", {}).get("control_directory")
        if given is not None and (cached is None or os.path.realpath(given) != os.path.realpath(cached)):
            held = f"the controls of {cached!r}" if cached else "no controls from a folder"
            raise ValueError(f"--control_directory {given}: the latent cache {cfg.data_path!r} holds {held}; leave "
                             f"--control_directory out (the cache holds its controls' latents), or rebuild the cache "
                             f"with preprocess.py --control_directory {given}")

    def cached_preview_prompts(self, encoders, conditions, dataset) -> dict:
        """{caption: its conditions} of the preview prompts (and the empty caption), from each one's first item."""
        index = {c: i for i, c in distinct_captions(dataset, len(conditions) * 4)}
        table = {"": {k: v.cpu() for k, v in encoders.empty.items()}}
        for caption in conditions:
            item = dataset[index[caption]]  # ((mean, std), label, caption, *conditions[, control_mean])
            table[caption] = {k: v for k, v in encoders.from_cache(item[3:], "cpu").items() if k in table[""]}
        return table
