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
"""
import torch

from opendit.data.captions import LabelledCaptions, distinct_captions
from opendit.families.latent import is_none

COND = "cond_"  # a cached condition's array name: cond_<the glue's key>


class CachedConditions:
    """preprocess.py's hooks and what training on a cache needs (see the module's docstring)."""

    def resolve_cache_config(self, cfg):
        if cfg.model not in self.models:
            raise ValueError(f"--model {cfg.model}: a {self.name} cache is for one model (its prompt embeddings "
                             f"are that model's); name one of: {', '.join(self.models)}")
        if is_none(cfg.text_encoder):
            raise ValueError(f"--text_encoder is required: {cfg.model}'s prompts are cached through it (its folder, "
                             f"or the model's pipeline folder)")
        return super().resolve_cache_config(cfg)

    def cache_encoders(self, cfg, device):
        return self.load_encoders(cfg, device, training=False)

    def cache_source(self, cfg, encoders):
        """(image [3, H, W] in [-1, 1], label (the digit of the captioned digits, else 0), caption), unflipped."""
        self.latent_shape(cfg, encoders)  # the image size fits the VAE and the patches, else a clear error
        spec = self.dataset_spec(cfg)
        if spec.pairs:
            raise ValueError(f"--dataset {cfg.dataset}: a latent cache of editing pairs (the controls' latents beside "
                             f"the targets') is not written yet; train on the pairs themselves (leave preprocess.py "
                             f"out)")
        dataset = spec(cfg.data_path, cfg.image_size, channels=3)
        if cfg.buckets:
            self.use_buckets(dataset, cfg, encoders)
        return LabelledCaptions(dataset)

    @torch.no_grad()
    def cache_encode(self, encoders, x, captions=None) -> dict:
        mean, std = self.glue.posterior(encoders.vae, x.to(next(encoders.vae.parameters()).device))
        out = {"mean": mean.cpu(), "std": std.cpu()}
        if captions is not None:
            out.update({COND + k: v.float() for k, v in encoders.encode(list(captions), "cpu").items()})
        return out

    def cache_extras(self, encoders) -> dict:
        """The empty caption's conditions (caption dropout while training)."""
        return {COND + k: v.float() for k, v in encoders.empty_conditions("cpu").items()}

    def use_cache(self, cfg, encoders, dataset) -> None:
        """Training on `dataset` (a cache): its conditions must be this model's (names and shapes), else an error
        naming both; encoders learn their order and the empty caption's."""
        declared = self.glue.random_conditions(self.models[cfg.model], 1, "meta")  # shapes, no RNG drawn
        found = {name.removeprefix(COND): name for name in dataset.embeddings if name.startswith(COND)}
        empty = {k: dataset.extra(found[k]) for k in declared if k in found}
        shapes = {k: tuple(v.shape) for k, v in empty.items()}
        if shapes != {k: tuple(v.shape[1:]) for k, v in declared.items()}:
            raise ValueError(f"latent cache {cfg.data_path!r} holds the conditions {shapes or 'none'}, not those of "
                             f"{cfg.model} ({ {k: tuple(v.shape[1:]) for k, v in declared.items()} }); rebuild it "
                             f"with preprocess.py --family {self.name} --model {cfg.model} --text_encoder ...")
        encoders.cached = tuple(k for k in (n.removeprefix(COND) for n in dataset.embeddings) if k in declared)
        encoders.dtypes = {k: v.dtype for k, v in declared.items()}  # masks come back as floats
        encoders.empty = {k: v.to(encoders.dtypes[k]) for k, v in empty.items()}

    def cached_preview_prompts(self, encoders, conditions, dataset) -> dict:
        """{caption: its conditions} of the preview prompts (and the empty caption), from each one's first item."""
        index = {c: i for i, c in distinct_captions(dataset, len(conditions) * 4)}
        table = {"": {k: v.cpu() for k, v in encoders.empty.items()}}
        for caption in conditions:
            item = dataset[index[caption]]  # ((mean, std), label, caption, *conditions)
            table[caption] = encoders.from_cache(item[3:], "cpu")
        return table
