"""Tiny random autoencoders of the diffusers classes the families of the kind declare (`glue.vae_class`), for the
tests that need a real VAE (latent caches, the pipelines' own decoding): {class name: writer(folder) -> folder}."""
from tests.test_flux2_family import save_tiny_flux2_vae
from tests.test_qwenimage_family import save_tiny_qwen_vae
from tests.test_zimage_family import save_tiny_flux_vae

VAE_WRITERS = {"AutoencoderKL": save_tiny_flux_vae, "AutoencoderKLFlux2": save_tiny_flux2_vae,
               "AutoencoderKLQwenImage": save_tiny_qwen_vae}
