"""Image DiT as a model family: the DiT paper's models on images, class labels, Gaussian diffusion.

Besides opendit's own checkpoints, sampling and --init_weights read what the DiT release and diffusers publish:
an official `.pt` (DiT-XL-2-256x256.pt) implies DiT-XL/2, 1000 classes and sd-vae-ft-ema; a diffusers DiT folder
(facebook/DiT-XL-2-256, or its transformer/) brings its settings in its config.json and is converted on load.

What the model's forward takes: forward(x [B, C, h, w] latents, t [B] timesteps in 0..999, y [B] labels, num_classes
the null class) -> [B, 2C or C, h, w] (eps, and the variance values with learn_sigma); forward_with_cfg(x, t, y,
cfg_scale) on [cond half; uncond half].
"""
from pathlib import Path

import torch
import torch.nn as nn

from opendit.checkpoint import load_weights
from opendit.data import DIGITS, FOLDER, LABELLED_STREAMS, LATENTS, dataset_map
from opendit.families.base import ModelSpec, match_registry
from opendit.families.gaussian import GaussianDiffusionFamily, GaussianTrainOptions, official_shapes
from opendit.models.blocks import DIT_SIZES, is_per_sample_layer
from opendit.families.dit.weights import DIT_WEIGHTS
from opendit.families.dit.model import DiT
from opendit.models.layers import Attention
from opendit.perf import matmul_macs


def _spec(name: str, depth: int, hidden: int, heads: int, patch: int) -> ModelSpec:
    return ModelSpec(name, "dit", DiT, dict(depth=depth, hidden_size=hidden, num_heads=heads, patch_size=patch))


DIT_MODELS = {f"DiT-{size}/{patch}": _spec(f"DiT-{size}/{patch}", d, h, n, patch)
              for size, (d, h, n) in DIT_SIZES.items() for patch in (2, 4, 8)}
DIT_MODELS["DiT-debug"] = _spec("DiT-debug", 2, 64, 4, 2)

# What an official DiT .pt implies when nothing else says otherwise.
OFFICIAL_DEFAULTS = dict(model="DiT-XL/2", dataset="folder", num_classes=1000, vae="stabilityai/sd-vae-ft-ema",
                         learn_sigma=True)


def dit_forward_macs(model: nn.Module) -> int:
    """Multiply-accumulates of one forward pass for ONE sample of `model` (a DiT), from its layers.

    Tokens per sample N come from the model's position table (pos_embed [1, N, D]); a token-wise Linear(in, out)
    costs N * in * out, a per-sample one (timestep MLP, adaLN modulation) in * out, the patch conv
    N * (D * C_in * p * p), and each attention layer 2 * N^2 * D (q k^T and p v)."""
    pos = getattr(model, "pos_embed", None)
    if pos is None or pos.dim() != 3:
        raise ValueError(f"{type(model).__name__} has no pos_embed [1, N, D]; dit_forward_macs counts DiT models "
                         f"(build one with opendit.families.build_model)")
    tokens = pos.shape[1]
    macs = matmul_macs(model, lambda name: 1 if is_per_sample_layer(name) else tokens)
    return macs + sum(2 * tokens * tokens * m.num_heads * m.head_dim for m in model.modules()
                      if isinstance(m, Attention))


def dit_train_flops_per_image(model, image_size: int | None = None, vae_downsample: int = 8,
                              in_channels: int = 4, learn_sigma: bool = True) -> float:
    """Training FLOPs per image (3 passes x 2 FLOP x forward MACs).

    model: a DiT module (its own geometry is used; image_size must be None), or a registry name such as
    "DiT-XL/2" with image_size in pixels; the latent side is image_size // vae_downsample (1 = pixel space).
    The model is then built on the meta device: no memory, no weights.
    """
    if isinstance(model, str):
        if image_size is None:
            raise ValueError(f"dit_train_flops_per_image({model!r}) needs image_size (pixels), e.g. 256")
        if image_size % vae_downsample:
            raise ValueError(f"image_size {image_size} is not divisible by vae_downsample {vae_downsample}")
        with torch.device("meta"):
            model = DIT_MODELS[model].build(input_size=image_size // vae_downsample, in_channels=in_channels,
                                            learn_sigma=learn_sigma)
    elif image_size is not None:
        raise ValueError("pass image_size only with a model name; a built model already fixes its input size")
    return 3 * 2 * float(dit_forward_macs(model))


class DiTFamily(GaussianDiffusionFamily):
    name = "dit"
    title, weight_formats = "DiT", "official DiT `.pt`, diffusers folders"
    models = DIT_MODELS
    datasets = dataset_map(DIGITS, FOLDER, LATENTS, *LABELLED_STREAMS)
    checkpoint_formats = ("an official DiT .pt", "a diffusers DiT folder (config.json, or transformer/)")
    weights = DIT_WEIGHTS
    cache_thresholds = {"teacache": 0.2, "fbcache": 0.16}  # benchmarks/README.md: digits, no accuracy lost
    defaults_help = {"cfg_scale": "DiT 4", "num_sampling_steps": "DiT 250",
                     "sampler": "DiT: ddpm (ancestral, default) or ddim", "vae_scale": "DiT: SD's 0.18215"}

    def build_model(self, cfg: GaussianTrainOptions, latent_shape):
        channels, size, _ = latent_shape
        return self.models[cfg.model].build(input_size=size, in_channels=channels, num_classes=cfg.num_classes,
                                            learn_sigma=cfg.learn_sigma, class_dropout_prob=cfg.class_dropout_prob)

    def train_flops_per_sample(self, model) -> float:
        return dit_train_flops_per_image(model)

    def recognize_checkpoint(self, path: str):
        if DIT_WEIGHTS.diffusers_folder(path):  # e.g. facebook/DiT-XL-2-256: its config gives the settings
            kw, state = DIT_WEIGHTS.load_diffusers(path)
            settings = dict(OFFICIAL_DEFAULTS, image_size=kw["input_size"] * 8, num_classes=kw["num_classes"],
                            learn_sigma=kw["learn_sigma"])
            name = match_registry(DIT_MODELS, **{k: kw[k] for k in ("depth", "hidden_size", "num_heads", "patch_size")})
            return ({**settings, "model": name} if name else settings), state
        if Path(path).suffix == ".pt":  # DiT-XL-2-256x256.pt, DiT-XL-2-512x512.pt
            state = load_weights(path, mmap=True)  # keys and shapes only: the tensors stay on disk
            return (settings_from_shapes(state), None) if "pos_embed" in state and "temp_embed" not in state else None
        return None


def settings_from_shapes(state: dict) -> dict:
    """An official DiT state dict -> the settings it was trained with: the model name (by depth, width and
    patch), classes (embedding rows - 1), learned sigma, and the image size (latent side x 8, SD's VAE)."""
    found = official_shapes(state)
    name = match_registry(DIT_MODELS, depth=found["depth"], hidden_size=found["hidden_size"],
                          patch_size=found["patch_size"])
    return dict(OFFICIAL_DEFAULTS, image_size=found["latent_side"] * 8, num_classes=found["num_classes"],
                learn_sigma=found["learn_sigma"], **({"model": name} if name else {}))
