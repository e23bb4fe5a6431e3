"""Wan's frozen causal 3-D VAEs (diffusers AutoencoderKLWan): clips in [-1, 1] <-> normalised latents.

Wan2.1's VAE compresses 4x in time and 8x in space into 16 channels; Wan2.2's (TI2V-5B's) 4x in time and 16x in
space into 48 (a residual VAE over 2x2-patchified frames). Both are causal: the first frame alone, then 4 frames at
a time, so a clip of 1 + 4k frames gives 1 + k latent frames; the geometry is read from the config. Latents are
normalised per channel with the config's latents_mean / latents_std lists, as diffusers' WanPipeline does: z_norm =
(z - mean) / std, and decoding takes z_norm * std + mean. Nothing is downloaded: pass a local folder (the vae/ of
Wan-AI/Wan2.1-T2V-1.3B-Diffusers, or that whole pipeline folder).
"""
import glob
import os

import torch

from opendit.checkpoint.folders import model_folder, read_config
from opendit.encoders.vae_decode import DecodeOptions, VAEDecoding, decode_latents

WAN_VAE_CLASS = "AutoencoderKLWan"
NEEDS = (f"it needs config.json (\"_class_name\": \"{WAN_VAE_CLASS}\") and diffusion_pytorch_model*.safetensors, "
         f"as {WAN_VAE_CLASS}.save_pretrained writes them, or a Wan pipeline folder with vae/; download the vae/ of "
         f"Wan-AI/Wan2.1-T2V-1.3B-Diffusers where there is network and pass that local folder")


class CausalVideoDecoding(VAEDecoding):
    """How AutoencoderKLWan decodes (opendit.encoders.vae_decode asks): 8x down in space; tiles of every latent
    frame, decoded frame after frame through the causal feature cache; never split in time."""

    def downsampling(self, vae) -> int:
        return vae.spatial_compression_ratio

    def tile_settings(self, vae, size: int) -> dict:
        return {"tile_sample_min_height": size, "tile_sample_min_width": size,
                "tile_sample_stride_height": size * 3 // 4, "tile_sample_stride_width": size * 3 // 4}

    def tile_shape(self, vae):
        f = vae.spatial_compression_ratio
        return ((vae.tile_sample_min_height // f, vae.tile_sample_min_width // f),
                (vae.tile_sample_stride_height // f, vae.tile_sample_stride_width // f))

    def decode_tile(self, vae, tile: torch.Tensor) -> torch.Tensor:
        vae.clear_cache()  # latent frames in order, each reading the causal cache of those before it
        frames = []
        for k in range(tile.shape[2]):
            vae._conv_idx = [0]
            frames.append(vae.decoder(vae.post_quant_conv(tile[:, :, k:k + 1]), feat_cache=vae._feat_map,
                                      feat_idx=vae._conv_idx, first_chunk=k == 0))
        vae.clear_cache()
        return torch.cat(frames, 2)


def described(vae):
    """The AutoencoderKLWan `vae`, carrying how it decodes (shared decoding asks it, see VAEDecoding)."""
    vae.opendit_decoding = CausalVideoDecoding()
    return vae


def _is_none(path) -> bool:
    return path is None or str(path).strip().lower() == "none"


def is_wan_vae(path) -> bool:
    """Whether `path` is a local folder (or pipeline folder with vae/) whose config.json is an AutoencoderKLWan's;
    False for None / "none", a hub id, a missing folder or another VAE (SD's 2-D AutoencoderKL). No weights read."""
    folder = None if _is_none(path) else model_folder(str(path), "vae")
    return folder is not None and read_config(folder).get("_class_name") == WAN_VAE_CLASS


def _wan_folder(path: str) -> str:
    """The folder holding a Wan VAE's config.json; FileNotFoundError / ValueError naming --vae, the path and the
    files otherwise."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--vae {path!r} does not exist; pass a local Wan VAE folder: {NEEDS}")
    folder = model_folder(path, "vae")
    if folder is None:
        raise FileNotFoundError(f"--vae {path!r} has no config.json (nor vae/config.json): {NEEDS}")
    config = read_config(folder)
    if config.get("_class_name") != WAN_VAE_CLASS:
        name = config.get("_class_name") or config.get("model_type")  # a diffusers class, or a transformers model
        raise ValueError(f"--vae {path!r}: {os.path.join(folder, 'config.json')} describes a {name!r} model, not "
                         f"Wan's causal 3-D VAE ({WAN_VAE_CLASS}); {NEEDS}")
    return folder


def wan_vae_config(path) -> dict:
    """The config.json of the Wan VAE at `path` (no weights read); the errors of load_wan_vae for a wrong path."""
    return read_config(_wan_folder(str(path)))


def load_wan_vae(path, device="cpu", dtype: torch.dtype = torch.float32):
    """-> a frozen AutoencoderKLWan in eval mode on device / dtype (no gradients), or None for None / "none" (pixel
    space). path: a folder written by save_pretrained (config.json + weights) or a Wan pipeline folder with vae/."""
    if _is_none(path):
        return None
    folder = _wan_folder(str(path))
    if not glob.glob(os.path.join(folder, "diffusion_pytorch_model*")):
        raise FileNotFoundError(f"--vae {str(path)!r} has no weights (no diffusion_pytorch_model*.safetensors in "
                                f"{folder!r}): {NEEDS}")
    from diffusers import AutoencoderKLWan  # lazy: diffusers is slow to import

    vae = AutoencoderKLWan.from_pretrained(folder, torch_dtype=dtype).to(device).eval()
    vae.requires_grad_(False)
    return described(vae)


def wan_factors(vae_or_config) -> tuple[int, int, int]:
    """(z_dim, temporal factor, spatial factor): (16, 4, 8) for Wan2.1's VAE (diffusers' defaults where the config
    leaves them out, as Wan2.1's does)."""
    config = getattr(vae_or_config, "config", vae_or_config)
    return (int(config.get("z_dim", 16)), int(config.get("scale_factor_temporal") or 4),
            int(config.get("scale_factor_spatial") or 8))


def wan_latent_shape(vae_or_config, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
    """(z_dim, 1 + (T - 1) // 4, H // 8, W // 8): the latent shape of one clip of T frames of H x W pixels, given an
    AutoencoderKLWan or its config (a dict, e.g. wan_vae_config's). ValueError naming --num_frames unless T = 1 + 4k,
    naming --image_size unless H and W are multiples of 8."""
    z_dim, ft, fs = wan_factors(vae_or_config)
    if num_frames < 1 or (num_frames - 1) % ft:
        low = 1 + ft * max(0, (num_frames - 1) // ft)
        raise ValueError(f"--num_frames {num_frames}: Wan's VAE encodes clips of 1 + {ft}k frames (the first frame "
                         f"alone, then {ft} at a time): valid counts are 1, {1 + ft}, {1 + 2 * ft}, {1 + 3 * ft}, ...; "
                         f"use {low} or {low + ft}")
    if height % fs or width % fs:
        raise ValueError(f"--image_size {height}x{width}: Wan's VAE needs a height and width that are multiples of "
                         f"{fs} (it downsamples {fs}x); use e.g. {max(fs, height // fs * fs)}x"
                         f"{max(fs, width // fs * fs)}")
    return z_dim, 1 + (num_frames - 1) // ft, height // fs, width // fs


def _stats(vae, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The config's latents_mean, latents_std as float32 [1, z_dim, 1, 1, 1] on device."""
    return tuple(torch.tensor(vae.config[key], dtype=torch.float32, device=device).view(1, -1, 1, 1, 1)
                 for key in ("latents_mean", "latents_std"))


@torch.no_grad()
def wan_posterior(vae, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """video float [B, 3, T, H, W] in [-1, 1] (T = 1 + 4k; H, W multiples of 8) -> the posterior's (mean, std),
    normalised ((mean - latents_mean) / latents_std, std / latents_std), float32 [B, z_dim, 1 + k, H/8, W/8] on
    video's device: a latent sample is mean + std * randn, what a cache stores and training draws."""
    channels = vae.config.in_channels // (vae.config.get("patch_size") or 1) ** 2  # Wan2.2's patchifies RGB
    if video.ndim != 5 or video.shape[1] != channels:
        raise ValueError(f"video must be [B, {channels}, T, H, W] in [-1, 1], got shape {tuple(video.shape)}")
    wan_latent_shape(vae, *video.shape[2:])  # checks T, H, W
    param = next(vae.parameters())
    posterior = vae.encode(video.to(device=param.device, dtype=param.dtype)).latent_dist
    mean, std = _stats(vae, video.device)
    return (posterior.mean.float().to(video.device) - mean) / std, posterior.std.float().to(video.device) / std


@torch.no_grad()
def wan_decode(vae, latents: torch.Tensor, options: DecodeOptions = DecodeOptions()) -> torch.Tensor:
    """Normalised latents [B, z_dim, 1 + k, h, w] -> float32 clips [B, 3, 1 + 4k, 8h, 8w] in [-1, 1] on latents'
    device (decoded from latents * latents_std + latents_mean); spatially tiled, options.batch clips per decoder call
    and split over ranks by clips or tiles (never by frames: the VAE is causal in time) as `options` say."""
    z_dim = wan_factors(vae)[0]
    if latents.ndim != 5 or latents.shape[1] != z_dim:
        raise ValueError(f"latents must be [B, {z_dim}, frames, h, w], got shape {tuple(latents.shape)}")
    mean, std = _stats(vae, latents.device)
    param = next(vae.parameters())
    z = (latents.float() * std + mean).to(device=param.device, dtype=param.dtype)
    return decode_latents(described(vae), z, options).float().to(latents.device)


# The released VAEs' parameter counts (diffusers' AutoencoderKLWan with the published configs, built on the meta
# device), for planning memory without reading them: Wan2.1's and Wan2.2's (base_dim 160, decoder_base_dim 256).
VAE_PARAMS = {16: 126_892_531, 48: 704_688_668}  # by z_dim


def save_tiny_wan_vae(folder, seed: int = 0, z_dim: int | None = None, base_dim: int = 4, wan22: bool = False) -> str:
    """Write a random AutoencoderKLWan for tests and CPU demos: Wan2.1's layout (4 levels: 8x in space, 4x in time;
    z_dim 16) or with wan22 Wan2.2's (residual, 2x2-patchified frames: 16x in space; z_dim 48), base_dim channels at
    every level and one residual block per level (22k parameters at base_dim 4, Wan2.1), and fixed latents_mean /
    latents_std lists of length z_dim drawn from `seed`; returns the folder."""
    from diffusers import AutoencoderKLWan

    z_dim = z_dim or (48 if wan22 else 16)
    layout = dict(decoder_base_dim=base_dim, is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                  scale_factor_spatial=16) if wan22 else {}
    gen = torch.Generator().manual_seed(seed)
    mean = [round(v, 4) for v in (0.5 * torch.randn(z_dim, generator=gen)).tolist()]
    std = [round(v, 4) for v in (0.5 + torch.rand(z_dim, generator=gen)).tolist()]
    torch.manual_seed(seed)
    AutoencoderKLWan(base_dim=base_dim, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1, latents_mean=mean,
                     latents_std=std, **layout).save_pretrained(folder)
    return str(folder)
