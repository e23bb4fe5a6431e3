"""Frozen encoders: the image VAE (and, beside it, text encoders)."""
from opendit.encoders.text import CLIPTextEncoder, load_text_encoder
from opendit.encoders.vae import SD_VAE_SCALE, decode, encode, load_vae, vae_geometry

__all__ = ["CLIPTextEncoder", "SD_VAE_SCALE", "decode", "encode", "load_text_encoder", "load_vae", "vae_geometry"]
