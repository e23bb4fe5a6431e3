"""Sampling from a trained DiT: resolve the checkpoint and its settings, then generate images by fixed global
indices so that N processes produce exactly the images one process would."""
import json
import logging
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from opendit import config as cfglib
from opendit.checkpoint import latest_run_checkpoint, load_weights
from opendit.diffusion import create_diffusion
from opendit.encoders.vae import decode, load_vae
from opendit.kernels import configure_kernels
from opendit.models import build_model, model_spec
from opendit.models.convert_diffusers import is_diffusers_dir, load_diffusers_dit
from opendit.training.objective import latent_geometry

logger = logging.getLogger("opendit")

# What an official DiT .pt implies when nothing else says otherwise.
OFFICIAL_DEFAULTS = dict(model="DiT-XL/2", num_classes=1000, vae="stabilityai/sd-vae-ft-ema", learn_sigma=True)


def resolve_weights(ckpt: str, outputs: str = "outputs") -> tuple[Path, dict, dict | None]:
    """ckpt ("latest" = newest checkpoint under outputs) -> (weights path, the training config found beside it
    or inside it ({} if none), the state_dict when reading the settings already loaded it (else None))."""
    path = Path(latest_run_checkpoint(outputs) if ckpt == "latest" else ckpt)
    if is_diffusers_dir(str(path)):  # a diffusers DiT (e.g. facebook/DiT-XL-2-256): its config gives the settings
        spec, state = load_diffusers_dit(str(path))
        kw = spec["kwargs"]
        settings = dict(OFFICIAL_DEFAULTS, image_size=kw["input_size"] * 8, num_classes=kw["num_classes"],
                        learn_sigma=kw["learn_sigma"])
        if spec["name"] is not None:
            settings["model"] = spec["name"]
        return path, settings, state
    if path.is_dir():
        # the EMA export written beside the DCP shards; without it (a crash between the two) read the shards
        weights = path / "ema.safetensors" if (path / "ema.safetensors").is_file() else path
        trained = path / "config.yaml"
        return weights, (cfglib.load_yaml(cfglib.TrainConfig, trained).__dict__ if trained.is_file() else {}), None
    if not path.is_file():
        raise FileNotFoundError(f"--ckpt {ckpt} does not exist; pass an EMA export (.safetensors), a training "
                                f"checkpoint folder, an official DiT .pt, or a diffusers DiT folder")
    sidecar = path.with_suffix(".json")  # written by export_weights beside an export
    meta = json.loads(sidecar.read_text()).get("config", {}) if sidecar.is_file() else {}
    return path, meta, None


def settings_for(cfg: cfglib.SampleConfig, trained: dict, ckpt_path: Path) -> dict:
    """Flags win; then the checkpoint's training config; then official-DiT defaults for a bare .pt."""
    base = dict(OFFICIAL_DEFAULTS, image_size=256) if ckpt_path.suffix == ".pt" and not trained else {}
    base.update({k: trained[k] for k in ("model", "image_size", "num_classes", "vae", "learn_sigma",
                                         "vae_scale", "dataset") if k in trained})
    for k in ("model", "image_size", "num_classes", "vae", "learn_sigma", "in_channels"):
        if getattr(cfg, k) is not None:
            base[k] = getattr(cfg, k)
    missing = [k for k in ("model", "image_size", "num_classes") if k not in base]
    if missing:
        raise ValueError(f"cannot tell {missing} from {ckpt_path}; pass them as flags (--model --image_size "
                         f"--num_classes)")
    base.setdefault("vae", "none")
    base.setdefault("learn_sigma", True)
    base.setdefault("vae_scale", 0.18215)
    if "in_channels" not in base:  # pixel-space digits are 1-channel, other folders RGB
        base["in_channels"] = 1 if base.get("dataset") == "digits" else 3
    return base


def load_model(cfg: cfglib.SampleConfig, device):
    weights_path, trained, state = resolve_weights(cfg.ckpt, cfg.outputs)
    s = settings_for(cfg, trained, weights_path)
    patch = model_spec(s["model"]).keywords["patch_size"]
    vae = load_vae(s["vae"], device)
    input_size, in_channels = latent_geometry(s["image_size"], vae, s["in_channels"], patch)
    model = build_model(s["model"], input_size=input_size, in_channels=in_channels, num_classes=s["num_classes"],
                        learn_sigma=s["learn_sigma"])
    model.load_state_dict(state if state is not None else load_weights(str(weights_path)), strict=True)
    configure_kernels(model, cfg.enable_modulate_kernel, cfg.enable_layernorm_kernel, cfg.enable_flashattn, device)
    logger.info("loaded %s (%s, %dpx, %d classes, vae %s)", weights_path, s["model"], s["image_size"],
                s["num_classes"], s["vae"])
    return model.to(device).eval(), vae, s


def global_batches(num_samples: int, batch_size: int, rank: int, world_size: int) -> list[range]:
    """Batches of global sample indices; batch k belongs to rank k % world_size (fixed, whatever the world)."""
    batches = [range(s, min(s + batch_size, num_samples)) for s in range(0, num_samples, batch_size)]
    return batches[rank::world_size]


@torch.no_grad()
def sample_batch(model, vae, diffusion, indices: range, labels: list[int], cfg: cfglib.SampleConfig,
                 settings: dict, device) -> np.ndarray:
    """Images for global indices -> uint8 [n, H, W, C]. Noise comes from a generator seeded by (seed, first
    index), so a batch is the same on any rank."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + indices.start)
    n, size, ch = len(indices), model.input_size, model.in_channels
    y = torch.tensor([labels[i % len(labels)] for i in indices], device=device)
    z = torch.randn(n, ch, size, size, generator=gen).to(device)
    guided = cfg.cfg_scale > 1.0
    if guided:
        z = torch.cat([z, z])
        y = torch.cat([y, torch.full_like(y, settings["num_classes"])])
        kwargs, net = dict(y=y, cfg_scale=cfg.cfg_scale), model.forward_with_cfg
    else:
        kwargs, net = dict(y=y), model.forward

    def fn(x, t, **kw):  # the sampler's math stays fp32 whatever the model's compute dtype
        return net(x, t, **kw).float()
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.mixed_precision]
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        if cfg.sampler == "ddpm":
            out = diffusion.p_sample_loop(fn, z.shape, z, kwargs, device=device, generator=gen)
        else:
            out = diffusion.ddim_sample_loop(fn, z.shape, z, kwargs, device=device, generator=gen, eta=cfg.ddim_eta)
    out = out[:n].float()
    images = decode(vae, out, scale=settings["vae_scale"]) if vae is not None else out.clamp(-1, 1)
    images = ((images + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return images


def make_diffusion(cfg: cfglib.SampleConfig, learn_sigma: bool):
    if cfg.sampler not in ("ddpm", "ddim"):
        raise ValueError(f"--sampler {cfg.sampler!r}: valid choices are ddpm, ddim")
    spacing = f"ddim{cfg.num_sampling_steps}" if cfg.sampler == "ddim" else str(cfg.num_sampling_steps)
    return create_diffusion(spacing, learn_sigma=learn_sigma)


def save_png(image: np.ndarray, path: Path) -> None:
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(path)


def write_grid(paths: list[Path], out: Path, ncol: int) -> None:
    images = [np.asarray(Image.open(p).convert("RGB")) for p in paths]
    h, w, _ = images[0].shape
    rows = (len(images) + ncol - 1) // ncol
    grid = np.full((rows * (h + 2) + 2, ncol * (w + 2) + 2, 3), 255, np.uint8)
    for i, im in enumerate(images):
        r, c = divmod(i, ncol)
        grid[2 + r * (h + 2): 2 + r * (h + 2) + h, 2 + c * (w + 2): 2 + c * (w + 2) + w] = im
    Image.fromarray(grid).save(out)
