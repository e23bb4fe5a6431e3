"""Families whose model is diffusers' own transformer class (the diffusers-transformer kind, kind.py).

A declared model is one file here holding its `MODEL` (declared.py: data and a feed of five functions) and one
name in DECLARED below (FLUX.1 beside the native FLUX family, Z-Image, Qwen-Image, ...). FLUX.2 [klein] and [dev]
(flux2.py) and, through the video kind (video.py), HunyuanVideo-1.5 (hunyuanvideo15.py) and Wan2.1 (wan21.py) are
still glue classes (glue.py's ModelGlue).
"""
import importlib

from opendit.families.wrapped.declared import declared_family
from opendit.families.wrapped.flux2 import Flux2Glue
from opendit.families.wrapped.hunyuanvideo15 import HunyuanVideo15Glue
from opendit.families.wrapped.kind import DiffusersFamily
from opendit.families.wrapped.video import DiffusersVideoFamily
from opendit.families.wrapped.wan21 import Wan21Glue

# the declared models: one module of this package each, the registry line of a new model
DECLARED = ("flux1", "zimage", "qwenimage", "chroma", "krea2", "sana", "ernieimage", "sd35", "ideogram4", "flux3",
            "kandinsky5", "kandinsky5_image", "qwenimage21", "ltx2")

GLUED = (DiffusersFamily("flux2", Flux2Glue()),
         DiffusersVideoFamily("hunyuanvideo15", HunyuanVideo15Glue()), DiffusersVideoFamily("wan21", Wan21Glue()))


def wrapped_families() -> tuple:
    """Every built-in family of the kind, the glued ones first, then DECLARED in its order."""
    return (*GLUED, *(declared_family(importlib.import_module(f"{__name__}.{name}").MODEL) for name in DECLARED))


__all__ = ["DECLARED", "DiffusersFamily", "DiffusersVideoFamily", "declared_family", "wrapped_families"]
