"""Families whose model is diffusers' own transformer class (the diffusers-transformer kind, kind.py).

A model is one file here holding its `MODEL` (declared.py: data and a feed of five functions) and one name in DECLARED
below (FLUX.2 [klein] and [dev], HunyuanVideo-1.5 and Wan2.1 through the video kind (video.py), FLUX.1 beside the
native FLUX family, Z-Image, Qwen-Image, ...).
"""
import importlib

from opendit.families.wrapped.declared import declared_family
from opendit.families.wrapped.kind import DiffusersFamily
from opendit.families.wrapped.video import DiffusersVideoFamily

# the declared models: one module of this package each, the registry line of a new model (in the order of the
# registry and the docs' tables)
DECLARED = ("flux2", "hunyuanvideo15", "wan21", "flux1", "zimage", "qwenimage", "chroma", "krea2", "sana",
            "ernieimage", "sd35", "ideogram4", "flux3", "kandinsky5", "kandinsky5_image", "qwenimage21", "ltx2")


def wrapped_families() -> tuple:
    """Every built-in family of the kind, in DECLARED's order."""
    return tuple(declared_family(importlib.import_module(f"{__name__}.{name}").MODEL) for name in DECLARED)


__all__ = ["DECLARED", "DiffusersFamily", "DiffusersVideoFamily", "declared_family", "wrapped_families"]
