"""Wan2.1 text-to-video: model.py the network (the official release's keys), weights.py diffusers'
WanTransformer3DModel layout, vae.py its causal 3-D VAE, family.py its models, options, objective and sampler,
tiny_umt5.py a tiny random UMT5 for demos."""
from opendit.families.wan.family import WanFamily

__all__ = ["WanFamily"]
