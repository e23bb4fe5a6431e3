"""Image DiT (Peebles & Xie): model.py the network (the official release's keys), weights.py diffusers'
DiTTransformer2DModel layout, family.py its models, options, objective and samplers."""
from opendit.families.dit.family import DiTFamily

__all__ = ["DiTFamily"]
