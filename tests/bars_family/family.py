"""The "bars" family: model "Bars-S" (model.py) trained with opendit's Gaussian diffusion on clips through its own
PoolVAE and LetterEncoder (encoders.py), on its own dataset "moving_bars" (data.py), with its own option
--text_width. The clip options, bucket frames and the writer of clips come from opendit's ClipFamily."""
import dataclasses
from dataclasses import dataclass

import torch

from opendit.data import LATENTS, dataset_map
from opendit.diffusion.objective import DiffusionObjective
from opendit.encoders.vae import posterior_sample
from opendit.families import ModelSpec
from opendit.families.base import preview_prompts
from opendit.families.clips import ClipCacheOptions, ClipFamily, ClipSampleOptions, ClipTrainOptions
from opendit.families.gaussian import GaussianDiffusionFamily, GaussianSampleOptions, GaussianTrainOptions
from opendit.families.latent import check_multiple
from opendit.options import opt
from tests.bars_family.data import MOVING_BARS
from tests.bars_family.encoders import LetterEncoder, PoolVAE
from tests.bars_family.model import BarsDiT

TEXT_WIDTH = "width of the bars family's letter-vector text encoder"


@dataclass(frozen=True)
class BarsTrainOptions(ClipTrainOptions, GaussianTrainOptions):
    text_width: int | None = opt(None, TEXT_WIDTH + "; default: a cache's, else 16", check="positive")


@dataclass(frozen=True)
class BarsSampleOptions(ClipSampleOptions, GaussianSampleOptions):
    pass


@dataclass(frozen=True)
class BarsCacheOptions(ClipCacheOptions):
    text_width: int = opt(16, TEXT_WIDTH, check="positive")


@dataclass
class BarsEncoders:
    vae: PoolVAE
    text: LetterEncoder | None  # None while training on a cache (it holds the embeddings)


class BarsObjective(DiffusionObjective):
    """A batch is (clips, caption indices, captions) or a cached one ((mean, std), indices, captions, letters);
    one posterior draw either way; each caption's vector is replaced by zeros with probability drop_prob."""

    def __init__(self, encoders: BarsEncoders, learn_sigma: bool, drop_prob: float):
        super().__init__(None, 1.0, learn_sigma, labels=False)
        self.encoders, self.drop_prob = encoders, drop_prob

    def prepare(self, batch, device, train: bool = True):
        x = batch[0]
        mean, std = [t.to(device) for t in x] if isinstance(x, (list, tuple)) else \
            self.encoders.vae.posterior(x.to(device))
        text = batch[3].to(device) if len(batch) == 4 else self.encoders.text(list(batch[2])).to(device)
        drop = (torch.rand(len(text)) < (self.drop_prob if train else 0.0)).to(device)  # the same on SP ranks
        return posterior_sample(mean, std), {"text": torch.where(drop[:, None], torch.zeros_like(text), text)}


class BarsFamily(ClipFamily, GaussianDiffusionFamily):
    name = "bars"
    models = {"Bars-S": ModelSpec("Bars-S", "bars", BarsDiT, dict(depth=2, hidden_size=32, num_heads=2,
                                                                   patch_size=2))}
    datasets = dataset_map(MOVING_BARS, LATENTS)
    class_conditional = False
    default_image_size, default_vae_scale, default_num_frames = 8, 1.0, 4
    defaults_help = {"fps": "bars 4"}
    train_options, sample_options, cache_options = BarsTrainOptions, BarsSampleOptions, BarsCacheOptions
    cache_keys = (*ClipFamily.cache_keys, "text_width")

    # ---- configuration, data, model -----------------------------------------------------------------------------
    def fill_defaults(self, cfg):
        return dataclasses.replace(super().fill_defaults(cfg), text_width=cfg.text_width or 16)

    def load_encoders(self, cfg, device, training: bool) -> BarsEncoders:
        cached = training and self.dataset_spec(cfg).cache
        return BarsEncoders(PoolVAE(), None if cached else LetterEncoder(cfg.text_width))

    def dataset_options(self, cfg, encoders, spec) -> dict:
        options = {"seed": cfg.global_seed}
        return options if spec.cache else {**options, "num_frames": cfg.num_frames,
                                           "frame_interval": cfg.frame_interval}

    def size_step(self, cfg, encoders) -> int:
        return PoolVAE.spatial_downsampling * self.patch_size(cfg)

    def latent_shape(self, cfg, encoders, dataset=None, data_channels=None) -> tuple[int, ...]:
        cached = getattr(dataset, "latent_shape", None)
        if cached is not None:
            return tuple(cached)
        size = check_multiple("--image_size", cfg.image_size, self.size_step(cfg, encoders),
                              "the VAE's downsampling x the patch size")
        return PoolVAE.latent_channels, cfg.num_frames, size // PoolVAE.spatial_downsampling, \
            size // PoolVAE.spatial_downsampling

    def build_model(self, cfg, latent_shape):
        return self.models[cfg.model].build(in_channels=latent_shape[0], text_dim=cfg.text_width,
                                            learn_sigma=cfg.learn_sigma)

    def objective(self, cfg, encoders: BarsEncoders) -> BarsObjective:
        return BarsObjective(encoders, cfg.learn_sigma, cfg.class_dropout_prob)

    # ---- sampling and previews: prompts ----------------------------------------------------------------------
    def sample_defaults(self, sample_cfg, cfg) -> dict:
        return {**super().sample_defaults(sample_cfg, cfg), "fps": 4}

    def sample_shape(self, loaded, sample_cfg) -> tuple[int, ...]:
        c, h, w = super().sample_shape(loaded, sample_cfg)  # checks --height / --width
        return c, sample_cfg.num_frames or loaded.cfg.num_frames, h, w

    def sampling_encoders(self, cfg, encoders, device) -> BarsEncoders:
        return dataclasses.replace(encoders, text=encoders.text or LetterEncoder(cfg.text_width))

    def conditions(self, sample_cfg, cfg) -> list:
        if not sample_cfg.prompts:
            raise ValueError(f"{cfg.model} samples from captions: pass --prompt \"a bar moving left\"")
        return list(sample_cfg.prompts)

    def condition_inputs(self, loaded, picked: list, device) -> dict:
        return {"text": loaded.encoders.text(picked).to(device)}

    def null_inputs(self, loaded, n: int, device) -> dict:
        return {"text": torch.zeros(n, loaded.cfg.text_width, device=device)}

    def decode(self, loaded, latents: torch.Tensor) -> torch.Tensor:
        return loaded.encoders.vae.decode(latents)

    def preview_conditions(self, cfg, dataset, rows: int) -> list:
        return preview_prompts(dataset, rows, cfg.model)

    def preview_encoders(self, cfg, encoders, conditions, dataset) -> BarsEncoders:
        return self.sampling_encoders(cfg, encoders, None)

    # ---- caching: the clips' posteriors and each caption's vector ------------------------------------------------
    def resolve_cache_config(self, cfg):
        return dataclasses.replace(cfg, vae_scale=1.0)

    def cache_encoders(self, cfg, device) -> BarsEncoders:
        return BarsEncoders(PoolVAE(), LetterEncoder(cfg.text_width))

    def cache_source(self, cfg, encoders):
        return MOVING_BARS(None, cfg.image_size, num_frames=cfg.num_frames, frame_interval=cfg.frame_interval)

    def cache_encode(self, encoders: BarsEncoders, x, captions=None) -> dict:
        mean, std = encoders.vae.posterior(x)
        out = {"mean": mean.cpu(), "std": std.cpu()}
        if captions is not None:
            out["letters"] = encoders.text(list(captions))
        return out
