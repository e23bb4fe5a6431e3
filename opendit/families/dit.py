"""Image DiT as a model family: the DiT paper's models on images, class labels, Gaussian diffusion.

Besides opendit's own checkpoints, sampling reads what the DiT release and diffusers publish: an official
`.pt` (DiT-XL-2-256x256.pt) implies DiT-XL/2, 1000 classes and sd-vae-ft-ema; a diffusers DiT folder
(facebook/DiT-XL-2-256) brings its settings in its config.json and is converted on load.
"""
from pathlib import Path

from opendit.checkpoint import load_weights
from opendit.families.base import ModelSpec, match_registry
from opendit.families.image import ImageDiffusionFamily
from opendit.models.dit import DiT

# (depth, hidden, heads): the DiT paper's four sizes, plus Ti (DeiT-Tiny widths) for CPU demos
_SIZES = {"Ti": (12, 192, 3), "S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}


def _spec(name: str, depth: int, hidden: int, heads: int, patch: int) -> ModelSpec:
    return ModelSpec(name, "dit", DiT, dict(depth=depth, hidden_size=hidden, num_heads=heads, patch_size=patch))


DIT_MODELS = {f"DiT-{size}/{patch}": _spec(f"DiT-{size}/{patch}", d, h, n, patch)
              for size, (d, h, n) in _SIZES.items() for patch in (2, 4, 8)}
DIT_MODELS["DiT-debug"] = _spec("DiT-debug", 2, 64, 4, 2)

# What an official DiT .pt implies when nothing else says otherwise.
OFFICIAL_DEFAULTS = dict(model="DiT-XL/2", dataset="folder", num_classes=1000, vae="stabilityai/sd-vae-ft-ema",
                         learn_sigma=True)


class DiTFamily(ImageDiffusionFamily):
    name = "dit"
    models = DIT_MODELS

    def build_model(self, cfg, latent_shape):
        channels, size, _ = latent_shape
        return self.models[cfg.model].build(input_size=size, in_channels=channels, num_classes=cfg.num_classes,
                                            learn_sigma=cfg.learn_sigma, class_dropout_prob=cfg.class_dropout_prob)

    def train_flops_per_sample(self, model) -> float:
        from opendit.perf import dit_train_flops_per_image

        return dit_train_flops_per_image(model)

    def recognize_checkpoint(self, path: str):
        from opendit.models.convert_diffusers import is_diffusers_dir, load_diffusers_dit

        if is_diffusers_dir(path):  # e.g. facebook/DiT-XL-2-256: its config gives the settings
            spec, state = load_diffusers_dit(path)
            kw = spec["kwargs"]
            settings = dict(OFFICIAL_DEFAULTS, image_size=kw["input_size"] * 8, num_classes=kw["num_classes"],
                            learn_sigma=kw["learn_sigma"])
            if spec["name"] is not None:
                settings["model"] = spec["name"]
            return settings, state
        if Path(path).suffix == ".pt":  # DiT-XL-2-256x256.pt, DiT-XL-2-512x512.pt
            state = load_weights(path, mmap=True)  # keys and shapes only: the tensors stay on disk
            return (settings_from_shapes(state), None) if "pos_embed" in state and "temp_embed" not in state else None
        return None


def settings_from_shapes(state: dict) -> dict:
    """An official DiT state dict -> the settings it was trained with: the model name (by depth, width and
    patch), classes (embedding rows - 1), learned sigma, and the image size (latent side x 8, SD's VAE)."""
    hidden, patch = state["pos_embed"].shape[-1], state["x_embedder.proj.weight"].shape[-1]
    depth = sum(1 for k in state if k.endswith(".attn.qkv.weight"))
    in_channels = state["x_embedder.proj.weight"].shape[1]
    side = int(state["pos_embed"].shape[1] ** 0.5) * patch
    name = match_registry(DIT_MODELS, depth=depth, hidden_size=hidden, patch_size=patch)
    return dict(OFFICIAL_DEFAULTS, image_size=side * 8,
                num_classes=state["y_embedder.embedding_table.weight"].shape[0] - 1,
                learn_sigma=state["final_layer.linear.weight"].shape[0] == 2 * in_channels * patch * patch,
                **({"model": name} if name else {}))
