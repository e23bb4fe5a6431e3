"""A second model family defined outside opendit, as a user would add one: text-to-image on a data set of its own.

Family "shapes", model "Shapes-S": a small diffusion transformer built from opendit's shared layers, conditioned on
captions through the family's own text encoder (a fixed random vector per word, averaged: no weights to load),
trained with opendit's Gaussian diffusion on its own built-in dataset "shapes" (8x8 grey bars, captioned "a
vertical bar on the left", ...), with its own option --word_dim. It caches its text embeddings with
preprocess.py, previews from prompts, validates, resumes and samples. Nothing in opendit knows it: importing this
module registers it (OPENDIT_FAMILIES=tests.text_family makes the entry scripts know it), and train.py,
sample.py, preprocess.py and opendit/training/ run it unchanged.
"""
import dataclasses
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from opendit.data import LATENTS, DatasetSpec, dataset_map
from opendit.diffusion.objective import DiffusionObjective
from opendit.families import ModelSpec, register_family
from opendit.families.base import preview_prompts
from opendit.families.gaussian import GaussianDiffusionFamily, GaussianTrainOptions
from opendit.families.latent import is_none
from opendit.models.blocks import AdaLNZeroBlock, FinalLayer
from opendit.models.layers import Attention, PatchEmbed, TimestepEmbedder
from opendit.models.pos_embed import sincos_2d
from opendit.parallel import ParallelPlan
from opendit.options import opt

CAPTIONS = ("a vertical bar on the left", "a vertical bar on the right", "a horizontal bar at the top",
            "a horizontal bar at the bottom")


class ShapesDataset(Dataset):
    """item = (float32 [1, S, S] in [-1, 1], the caption's index, the caption): a bar two pixels wide on an
    8x8 grid (upscaled to S), with a little noise fixed per item. num_classes 0: captions condition."""
    num_classes, channels = 0, 1

    def __init__(self, image_size: int = 8, seed: int = 0, items: int = 64):
        if image_size % 8:
            raise ValueError(f"--image_size {image_size}: the shapes are drawn on an 8x8 grid; pass a multiple of 8")
        self.image_size, self.seed, self.items = image_size, seed, items

    def __len__(self):
        return self.items

    def caption(self, i: int) -> str:
        return CAPTIONS[i % len(CAPTIONS)]

    def __getitem__(self, i: int):
        kind = i % len(CAPTIONS)
        grid = torch.full((8, 8), -1.0)
        bar = [slice(1, 3), slice(5, 7)][kind % 2]
        if kind < 2:
            grid[:, bar] = 1.0
        else:
            grid[bar, :] = 1.0
        noise = torch.randn(8, 8, generator=torch.Generator().manual_seed(self.seed * 1000 + i))
        x = (grid + 0.1 * noise).clamp(-1, 1)
        scale = self.image_size // 8
        return x.repeat_interleave(scale, 0).repeat_interleave(scale, 1)[None], kind, self.caption(i)


SHAPES = DatasetSpec("shapes", "built in: 8x8 grey bars captioned \"a vertical bar on the left\", ...",
                     lambda path, size, **kw: ShapesDataset(size, **kw), channels=1)


class WordEncoder:
    """captions -> the mean of a fixed random vector per word, float32 [B, dim] (the empty caption: zeros)."""

    def __init__(self, dim: int):
        self.dim = dim

    def vector(self, word: str) -> torch.Tensor:
        return torch.randn(self.dim, generator=torch.Generator().manual_seed(zlib.crc32(word.encode())))

    def __call__(self, captions: list[str]) -> torch.Tensor:
        return torch.stack([torch.stack([self.vector(w) for w in c.split()]).mean(0) if c.split()
                            else torch.zeros(self.dim) for c in captions])


class TextDiT(nn.Module):
    """x [B, C, S, S], t [B], text [B, text_dim] -> [B, 2C or C, S, S]; the text vector joins the timestep's."""
    _block_lists = ("blocks",)
    parallel_plan = ParallelPlan(attention=(Attention,), split=("image tokens",), replicated=("condition",))
    sequence_parallel = None

    def __init__(self, input_size, in_channels, depth, hidden_size, num_heads, patch_size, text_dim,
                 learn_sigma=True):
        super().__init__()
        self.in_channels, self.patch_size, self.grid = in_channels, patch_size, input_size // patch_size
        self.out_channels = in_channels * (2 if learn_sigma else 1)
        self.x_embedder = PatchEmbed(patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.text_embedder = nn.Linear(text_dim, hidden_size)
        self.register_buffer("pos", sincos_2d(hidden_size, self.grid).unsqueeze(0), persistent=False)
        self.blocks = nn.ModuleList(AdaLNZeroBlock(hidden_size, num_heads) for _ in range(depth))
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)

    def forward(self, x, t, text):
        tokens, c = self.x_embedder(x) + self.pos.to(x.dtype), self.t_embedder(t) + self.text_embedder(text)
        sp = self.sequence_parallel
        if sp is not None:
            tokens = sp.split(tokens)
        for block in self.blocks:
            tokens = block(tokens, c)
        out = self.final_layer(tokens, c)
        if sp is not None:
            out = sp.gather(out)
        b, g, p = x.shape[0], self.grid, self.patch_size
        out = out.view(b, g, g, p, p, self.out_channels)
        return torch.einsum("bhwpqc->bchpwq", out).reshape(b, self.out_channels, g * p, g * p)

    def forward_with_cfg(self, x, t, text, cfg_scale: float):
        """x holds [cond half; uncond half] (the second half's text is the empty caption's)."""
        half = x[: len(x) // 2]
        out = self(torch.cat([half, half]), t, text)
        eps, rest = out[:, :self.in_channels], out[:, self.in_channels:]
        cond, uncond = eps.chunk(2)
        guided = uncond + cfg_scale * (cond - uncond)
        return torch.cat([torch.cat([guided, guided]), rest], dim=1)


@dataclass(frozen=True)
class ShapesTrainOptions(GaussianTrainOptions):
    word_dim: int | None = opt(None, "width of the shapes family's word-vector text encoder; default: a cache's, "
                                     "else 16", check="positive")


@dataclass(frozen=True)
class ShapesCacheOptions:
    word_dim: int = opt(16, "width of the shapes family's word-vector text encoder", check="positive")


@dataclass
class ShapesEncoders:
    vae: None  # pixel space only
    text: WordEncoder | None  # None while training on a cache (it holds the embeddings)


class ShapesObjective(DiffusionObjective):
    """A batch is (images, caption indices, captions) or a cached one ((mean, std), indices, captions, words);
    each caption's vector is replaced by the empty caption's (zeros) with probability drop_prob."""

    def __init__(self, text, learn_sigma: bool, drop_prob: float):
        super().__init__(None, 1.0, learn_sigma, labels=False)
        self.text, self.drop_prob = text, drop_prob

    def prepare(self, batch, device, train: bool = True):
        x, _ = super().prepare(batch[:2], device, train)
        text = batch[3].to(device) if len(batch) == 4 else self.text(list(batch[2])).to(device)
        drop = (torch.rand(len(text)) < (self.drop_prob if train else 0.0)).to(device)
        return x, {"text": torch.where(drop[:, None], torch.zeros_like(text), text)}


class ShapesFamily(GaussianDiffusionFamily):
    name = "shapes"
    models = {"Shapes-S": ModelSpec("Shapes-S", "shapes", TextDiT,
                                    dict(depth=2, hidden_size=32, num_heads=2, patch_size=2))}
    datasets = dataset_map(SHAPES, LATENTS)
    class_conditional = False
    default_image_size = 8
    default_vae_scale = 1.0
    train_options = ShapesTrainOptions
    cache_options = ShapesCacheOptions
    cache_keys = ("word_dim",)

    def fill_defaults(self, cfg):
        return dataclasses.replace(super().fill_defaults(cfg), word_dim=cfg.word_dim or 16)

    def load_encoders(self, cfg, device, training: bool) -> ShapesEncoders:
        if not is_none(cfg.vae):
            raise ValueError(f"--vae {cfg.vae}: the shapes family works in pixel space; leave --vae out")
        cached = training and self.dataset_spec(cfg).cache
        return ShapesEncoders(vae=None, text=None if cached else WordEncoder(cfg.word_dim))

    def build_model(self, cfg, latent_shape):
        channels, size, _ = latent_shape
        return self.models[cfg.model].build(input_size=size, in_channels=channels, text_dim=cfg.word_dim,
                                            learn_sigma=cfg.learn_sigma)

    def train_flops_per_sample(self, model) -> float:
        tokens = model.grid ** 2  # 3 passes x 2 FLOP per multiply-accumulate of every token-wise Linear
        return 6.0 * tokens * sum(m.weight.numel() for m in model.blocks.modules() if isinstance(m, nn.Linear))

    def objective(self, cfg, encoders: ShapesEncoders) -> ShapesObjective:
        return ShapesObjective(encoders.text, cfg.learn_sigma, cfg.class_dropout_prob)

    # ---- sampling and previews: prompts ----------------------------------------------------------------------
    def conditions(self, sample_cfg, cfg) -> list:
        if not sample_cfg.prompts:
            raise ValueError(f"{cfg.model} samples from captions: pass --prompt \"a vertical bar on the left\"")
        return list(sample_cfg.prompts)

    def condition_inputs(self, loaded, picked: list, device) -> dict:
        return {"text": loaded.encoders.text(picked).to(device)}

    def null_inputs(self, loaded, n: int, device) -> dict:
        return {"text": loaded.encoders.text([""]).to(device).expand(n, -1)}

    def preview_conditions(self, cfg, dataset, rows: int) -> list:
        return preview_prompts(dataset, rows, cfg.model)

    def preview_encoders(self, cfg, encoders, conditions, dataset) -> ShapesEncoders:
        return dataclasses.replace(encoders, text=encoders.text or WordEncoder(cfg.word_dim))

    # ---- caching: the images as they are (std 0) and each caption's word vector ---------------------------------
    def resolve_cache_config(self, cfg):
        if not is_none(cfg.vae):
            raise ValueError(f"--vae {cfg.vae}: the shapes family caches pixels; pass --vae none")
        return dataclasses.replace(cfg, vae_scale=1.0)

    def cache_encoders(self, cfg, device) -> ShapesEncoders:
        return ShapesEncoders(vae=None, text=WordEncoder(cfg.word_dim))

    def cache_source(self, cfg, encoders):
        return SHAPES(None, cfg.image_size)

    def cache_encode(self, encoders: ShapesEncoders, x, captions=None) -> dict:
        out = {"mean": x.float(), "std": torch.zeros_like(x, dtype=torch.float32)}
        if captions is not None:
            out["words"] = encoders.text(list(captions))
        return out


register_family(ShapesFamily())
