"""What the diffusers-transformer kind trains with: its encoders (WrappedEncoders: the model's VAE or PixelSpace,
the text encoder or a preview's FixedPrompts, the empty caption's conditions, a cache's conditions) and its objective
(WrappedObjective: rectified flow in the glue's token space, caption dropout, an editing pair's references)."""
from dataclasses import dataclass, field

import torch

from opendit.diffusion.flow import RectifiedFlow
from opendit.encoders.vae import posterior_sample
from opendit.families.wrapped.cache import CONTROL_MEAN, DROPPED, cached_references
from opendit.families.wrapped.glue import ModelGlue, PixelSpace
from opendit.families.wrapped.references import control_images, reference_latents


class FixedPrompts:
    """Stands in for a text encoder when only known captions will be asked for (a training preview's prompts,
    encoded on every rank, sampled on rank 0 alone): caption -> its conditions."""

    def __init__(self, table: dict[str, dict[str, torch.Tensor]]):
        self.table = table

    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        return {k: torch.stack([self.table[c][k] for c in captions]) for k in self.table[captions[0]]}


@dataclass
class WrappedEncoders:
    vae: torch.nn.Module | None  # the model's autoencoder, or PixelSpace
    text: object | None  # glue.TextEncoder, or FixedPrompts (previews)
    glue: ModelGlue
    empty: dict | None = None  # the empty caption's conditions, each [...] (no batch dimension)
    cached: tuple[str, ...] = ()  # training on a cache: the names of its conditions, in its items' order
    dtypes: dict = field(default_factory=dict)  # and their dtypes (a cache stores masks as floats)

    def encode(self, captions: list[str], device, references=None) -> dict[str, torch.Tensor]:
        """captions -> the prompt's conditions {name: [B, ...]} on device (glue.encode_prompts, run where the text
        encoder is); references: each caption's reference images (PIL), where the prompt sees them."""
        found = self.text(captions) if isinstance(self.text, FixedPrompts) else \
            self.glue.encode_prompts(self.text, captions, self.text.device, references)
        return {k: v.to(device) for k, v in found.items()}

    def from_cache(self, arrays, device) -> dict[str, torch.Tensor]:
        """A cached item's (or batch's) condition arrays -> the conditions, as encode gives them."""
        return {k: v.to(device, self.dtypes[k], non_blocking=True) for k, v in zip(self.cached, arrays)}

    def empty_conditions(self, device) -> dict[str, torch.Tensor]:
        if self.empty is None:
            self.empty = {k: v[0] for k, v in self.encode([""], "cpu").items()}
        self.empty = {k: v.to(device) for k, v in self.empty.items()}  # kept there: later steps copy nothing
        return self.empty


class WrappedObjective:
    """Rectified flow in the glue's token space: x_t = (1 - t) x + t noise, target noise - x, per-sample MSE. A
    batch is (images [B, C, H, W] in [-1, 1], captions), or a cached one ((mean, std), labels, captions, the
    conditions); with `pairs`, editing pairs (targets, controls [B, K, C, H, W], instructions)."""

    def __init__(self, encoders: WrappedEncoders, cfg, pairs: bool = False):
        self.encoders, self.cfg, self.glue, self.pairs = encoders, cfg, encoders.glue, pairs
        self.flow = RectifiedFlow(distribution=cfg.timestep_sampling, shift=False)

    def prepare(self, batch, device, train: bool = True):
        """-> (x [B, C', h', w'], the conditions): the prompts' (caption dropout applied) and an editing pair's
        controls in model space ("references")."""
        vae, references, dropped = self.encoders.vae, None, None
        seen = self.pairs and self.glue.prompt_references  # the prompt sees the controls (not from a cache)
        if isinstance(batch[0], (list, tuple)):  # a cache: one posterior sample, drawn as encode_images draws it
            mean, std = (t.to(device, non_blocking=True) for t in batch[0])
            z = mean if isinstance(vae, PixelSpace) else posterior_sample(mean, std)  # pixels: as they are
            cond = self.encoders.from_cache(batch[3:], device)
            if CONTROL_MEAN in cond:  # a cache of pairs: the controls' posterior means [B, K, C, h, w]
                references = cached_references(self.glue, vae, cond.pop(CONTROL_MEAN))
            # a pair's empty instruction with its pictures, where the prompt sees them: what dropout gives instead
            dropped = {k.removeprefix(DROPPED): cond.pop(k) for k in list(cond) if k.startswith(DROPPED)}
        else:
            images = batch[0].to(device, non_blocking=True)
            z = images if isinstance(vae, PixelSpace) else self.glue.encode_images(vae, images)
            # the captions: last in an image's or a clip's item
            cond = None if seen else self.encoders.encode(list(batch[-1]), device)
        x = self.glue.to_model_space(vae, z).float()
        p = self.cfg.caption_dropout_prob if train else 0.0
        drop = (torch.rand(len(x)) < p).to(device)  # the global RNG: the same on every SP rank
        if seen:  # the instruction dropped, not the pictures the prompt shows
            captions = ["" if gone else c for gone, c in zip(drop.tolist(), batch[-1])]
            cond = self.encoders.encode(captions, device, control_images(batch[1]))
        else:
            empty = dropped or self.encoders.empty_conditions(device)
            cond = {k: torch.where(drop.view(-1, *[1] * (v.ndim - 1)), empty[k], v) for k, v in cond.items()}
        if self.pairs:  # (targets, controls, instructions)
            cond["references"] = reference_latents(self.glue, vae, batch[1].to(device, non_blocking=True))
        if references is not None:  # a cache's, never dropped either
            cond["references"] = references
        return x, cond

    def losses(self, model, x, cond, t_frac=None, noise=None):
        t = self.flow.sample_t(len(x), x.device) if t_frac is None else t_frac.to(x.device, torch.float32)

        def velocity(x_t, t):
            out = model(**self.glue.forward_kwargs(model, x_t, t, cond, self.cfg))
            return self.glue.from_output(out[0] if isinstance(out, tuple) else out, x_t.shape)
        return self.flow.losses(velocity, x, t, noise), t
