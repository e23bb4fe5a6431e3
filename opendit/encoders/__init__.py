"""Frozen encoders: the image VAE (and, beside it, text encoders)."""
from opendit.encoders.vae import SD_VAE_SCALE, decode, encode, load_vae, vae_geometry

__all__ = ["SD_VAE_SCALE", "decode", "encode", "load_vae", "vae_geometry"]
