"""Families whose model is diffusers' own transformer class (the diffusers-transformer kind, kind.py), one glue
per model (glue.py's ModelGlue): FLUX.2 [klein] (flux2.py)."""
from opendit.families.wrapped.flux2 import Flux2KleinGlue
from opendit.families.wrapped.kind import DiffusersFamily

FLUX2 = DiffusersFamily("flux2", Flux2KleinGlue())

__all__ = ["FLUX2", "DiffusersFamily"]
