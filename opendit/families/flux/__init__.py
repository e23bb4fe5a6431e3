"""FLUX.1: model.py the network (the official release's keys), weights.py diffusers' FluxTransformer2DModel layout,
family.py its models, options, rectified-flow objective and Euler sampler, tiny_t5.py a tiny random T5 for demos."""
from opendit.families.flux.family import FluxFamily

__all__ = ["FluxFamily"]
