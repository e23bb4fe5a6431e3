"""Video DiTs trained with Gaussian diffusion or rectified flow: vdit.py (OpenDiT's VDiT, full attention over all
tokens), latte.py (Latte, spatial and temporal blocks), family.py their models, options and samplers."""
from opendit.families.video.family import VideoDiffusionFamily

__all__ = ["VideoDiffusionFamily"]
