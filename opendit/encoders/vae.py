"""Frozen image VAE (diffusers AutoencoderKL): pixels in [-1, 1] <-> scaled latents.

Latents are scaled so they have roughly unit variance, which the diffusion schedules assume:
z = (posterior sample - shift) * scale. SD's VAE (used by DiT) has scale 0.18215 and no shift;
FLUX's has scale 0.3611, shift 0.1159.
"""
import os

import torch

from opendit.encoders.vae_decode import DecodeOptions, decode_latents

SD_VAE_SCALE = 0.18215


def scale_latents(z: torch.Tensor, scale: float = SD_VAE_SCALE, shift: float = 0.0) -> torch.Tensor:
    """Raw VAE latents (a posterior sample or mean) -> the diffusion model's latents: (z - shift) * scale."""
    return (z - shift) * scale


def unscale_latents(z: torch.Tensor, scale: float = SD_VAE_SCALE, shift: float = 0.0) -> torch.Tensor:
    """The diffusion model's latents -> raw VAE latents for the decoder: z / scale + shift."""
    return z / scale + shift


def vae_scale_shift(vae) -> tuple[float, float]:
    """(scale, shift) from an AutoencoderKL's config (scaling_factor, shift_factor; a missing shift is 0): SD's
    VAE gives (0.18215, 0.0), FLUX's (0.3611, 0.1159). Use it when the folder's config is trusted; the
    training flags default to each model family's (its default_vae_scale and vae_shift)."""
    return float(vae.config.scaling_factor), float(getattr(vae.config, "shift_factor", None) or 0.0)


def _is_none(name_or_path) -> bool:
    return name_or_path is None or (isinstance(name_or_path, str) and name_or_path.strip().lower() == "none")


def _from_pretrained(name_or_path: str):
    from diffusers import AutoencoderKL  # lazy: diffusers is slow to import

    if os.path.isdir(name_or_path):
        if os.path.isfile(os.path.join(name_or_path, "config.json")):
            return AutoencoderKL.from_pretrained(name_or_path)
        if os.path.isfile(os.path.join(name_or_path, "vae", "config.json")):  # a whole pipeline folder
            return AutoencoderKL.from_pretrained(name_or_path, subfolder="vae")
        raise FileNotFoundError(
            f"VAE folder {name_or_path!r} has no config.json (nor vae/config.json); pass a folder written "
            f"by AutoencoderKL.save_pretrained, e.g. a download of stabilityai/sd-vae-ft-ema")
    if os.path.exists(name_or_path) or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
        raise FileNotFoundError(
            f"VAE path {name_or_path!r} is not a folder; pass a folder written by "
            f"AutoencoderKL.save_pretrained (config.json + weights) or a hub id like stabilityai/sd-vae-ft-ema")
    try:
        return AutoencoderKL.from_pretrained(name_or_path)
    except Exception as err:  # offline, unknown id, gated repo...: all mean "get the files locally"
        raise OSError(
            f"could not load the VAE {name_or_path!r} from the Hugging Face hub or its cache ({type(err).__name__}: "
            f"{err}); download it where there is network (huggingface-cli download {name_or_path} "
            f"--local-dir <folder>) and pass that local folder instead") from err


def load_vae(name_or_path, device="cpu", dtype: torch.dtype = torch.float32):
    """-> frozen AutoencoderKL in eval mode on device/dtype, or None for None / "none" (cached latents).

    name_or_path: a local folder (save_pretrained layout, or a pipeline folder with vae/) or a hub id.
    """
    if _is_none(name_or_path):
        return None
    vae = _from_pretrained(str(name_or_path))
    vae = vae.to(device=device, dtype=dtype).eval()
    vae.requires_grad_(False)
    return vae


def vae_geometry(vae) -> tuple[int, int | None]:
    """(spatial downsampling, latent channels) of an AutoencoderKL: (8, 4) for SD's VAE, (8, 16) for FLUX's;
    (1, None) without a VAE (pixel space keeps the data's channels)."""
    if vae is None:
        return 1, None
    return 2 ** (len(vae.config.block_out_channels) - 1), vae.config.latent_channels


@torch.no_grad()
def encode(vae, x: torch.Tensor, generator: torch.Generator | None = None,
           scale: float = SD_VAE_SCALE, shift: float = 0.0) -> torch.Tensor:
    """x: [B, 3, H, W] in [-1, 1] -> float32 latents [B, C_lat, H/f, W/f] (f = VAE downsampling).

    Samples the posterior (pass a generator on the VAE's device for reproducible noise)."""
    param = next(vae.parameters())
    posterior = vae.encode(x.to(device=param.device, dtype=param.dtype)).latent_dist
    return scale_latents(posterior.sample(generator=generator), scale, shift).float()


@torch.no_grad()
def decode(vae, z: torch.Tensor, scale: float = SD_VAE_SCALE, shift: float = 0.0,
           options: DecodeOptions = DecodeOptions()) -> torch.Tensor:
    """z: scaled latents [B, C_lat, h, w] -> float32 images [B, 3, h*f, w*f] clamped to [-1, 1]; tiled, options.batch
    images per decoder call and split over ranks as `options` say (opendit/encoders/vae_decode.py)."""
    param = next(vae.parameters())
    z = unscale_latents(z.to(device=param.device, dtype=param.dtype), scale, shift)
    return decode_latents(vae, z, options).float().clamp_(-1.0, 1.0)


def _frames(x: torch.Tensor) -> torch.Tensor:
    """[B, C, T, H, W] -> [B*T, C, H, W] (frame-major per clip)."""
    return x.permute(0, 2, 1, 3, 4).flatten(0, 1)


def _clips(x: torch.Tensor, batch: int) -> torch.Tensor:
    """[B*T, C, H, W] -> [B, C, T, H, W]."""
    return x.unflatten(0, (batch, -1)).permute(0, 2, 1, 3, 4)


@torch.no_grad()
def posterior_sample(mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """One draw of the posterior N(mean, std^2), mean + std * randn from the global RNG on mean's device: what
    diffusers' posterior.sample() draws, so training on a cached posterior equals encoding on the fly."""
    return mean + std * torch.randn(mean.shape, device=mean.device, dtype=mean.dtype)


def posterior_frames(vae, x: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Clips x [B, 3, T, H, W] in [-1, 1] -> the 2-D VAE's posterior (mean, std), float32 [B, C, T, h, w] on x's
    device, unscaled (scale_latents(mean + std * noise, scale, shift) gives the model's latents); `chunk` frames per
    encoder call bound the memory."""
    param = next(vae.parameters())
    frames = _frames(x).to(device=param.device, dtype=param.dtype)
    parts = [vae.encode(f).latent_dist for f in frames.split(chunk)]
    mean = torch.cat([p.mean for p in parts]).float()
    std = torch.cat([p.std for p in parts]).float()
    return _clips(mean, x.shape[0]).to(x.device), _clips(std, x.shape[0]).to(x.device)


@torch.no_grad()
def decode_frames(vae, z: torch.Tensor, scale: float = SD_VAE_SCALE, shift: float = 0.0,
                  options: DecodeOptions = DecodeOptions()) -> torch.Tensor:
    """Scaled latent clips z [B, C, T, h, w] -> float32 clips [B, 3, T, H, W] in [-1, 1], frame by frame: the B*T
    frames are independent images, options.batch per decoder call (what bounds the memory of a long clip), split
    over options.group's ranks by frames."""
    return _clips(decode(vae, _frames(z), scale, shift, options), z.shape[0])
