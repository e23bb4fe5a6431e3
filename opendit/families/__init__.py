"""Model families and the one registry of model names (see opendit.families.base for the interface).

Built in: "dit" (image DiT), "video" (VDiT, Latte), "flux" (FLUX.1) and "wan" (Wan2.1 text-to-video); shared
parts in latent.py (images through a frozen VAE) and gaussian.py (Gaussian diffusion), sampling outputs in
writers.py. A family defined
elsewhere registers itself with `register_family(family)` when its module is imported; name such modules in the
environment variable OPENDIT_FAMILIES (comma-separated, e.g. OPENDIT_FAMILIES=my_pkg.my_family) and train.py /
sample.py / preprocess.py know its models, options and datasets.
"""
import importlib
import os

from opendit.families.base import (DiffusionModel, LoadedModel, ModelFamily, ModelSpec, Objective,
                                   check_model_contract)
from opendit.families.dit import DiTFamily
from opendit.families.flux import FluxFamily
from opendit.families.video import VideoDiffusionFamily
from opendit.families.wan import WanFamily
from opendit.families.wrapped import wrapped_families

FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add (or replace, by name) a family; its model names must not belong to another family."""
    if not family.name or not family.models:
        raise ValueError(f"{type(family).__name__} needs a name and at least one model in .models")
    taken = {m: f.name for f in FAMILIES.values() if f.name != family.name for m in f.models}
    clash = sorted(set(family.models) & set(taken))
    if clash:
        raise ValueError(f"model names {clash} of family {family.name!r} already belong to family "
                         f"{taken[clash[0]]!r}; rename them")
    FAMILIES[family.name] = family
    return family


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; valid: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def all_models() -> dict[str, ModelSpec]:
    return {name: spec for family in FAMILIES.values() for name, spec in family.models.items()}


def model_spec(name: str) -> ModelSpec:
    models = all_models()
    if name not in models:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(models)}")
    return models[name]


def build_model(name: str, **kwargs):
    """Build a registered model; kwargs go to its constructor (input_size, in_channels, num_classes, ...)."""
    return model_spec(name).build(**kwargs)


def family_of(model_name: str) -> ModelFamily:
    """The family that registers `model_name` (an unknown name is an error listing the valid ones)."""
    return FAMILIES[model_spec(model_name).family]


def all_datasets() -> dict:
    """{name: DatasetSpec} of every registered family's datasets (the first family's spec of a shared name)."""
    found = {}
    for family in FAMILIES.values():
        for name, spec in family.datasets.items():
            found.setdefault(name, spec)
    return found


def all_samplers() -> tuple[str, ...]:
    return tuple(dict.fromkeys(s for f in FAMILIES.values() for s in f.samplers))


register_family(DiTFamily())
register_family(VideoDiffusionFamily())
register_family(FluxFamily())
register_family(WanFamily())
for _family in wrapped_families():
    register_family(_family)
for _module in filter(None, (m.strip() for m in os.environ.get("OPENDIT_FAMILIES", "").split(","))):
    importlib.import_module(_module)  # registers itself

__all__ = ["FAMILIES", "DiffusionModel", "LoadedModel", "ModelFamily", "ModelSpec", "Objective", "all_datasets",
           "all_models", "all_samplers", "build_model", "check_model_contract", "family_of", "get_family",
           "model_spec", "register_family"]
