"""Model code: shared layers (layers.py, blocks.py, pos_embed.py) and one file per architecture (dit.py).

Importing a shared layer does not import any architecture. Model names live with their families
(opendit.families); `build_model`, `model_spec` and `MODELS` here look them up across all families.
"""


def model_spec(name: str):
    """The registry entry (an opendit.families.ModelSpec) of a model name; unknown names list the valid ones."""
    from opendit.families import model_spec as spec

    return spec(name)


def build_model(name: str, **kwargs):
    """Build a registered model; kwargs go to its constructor (input_size, in_channels, num_classes, ...)."""
    return model_spec(name).build(**kwargs)


def __getattr__(name):
    if name == "MODELS":  # {name: ModelSpec} of every registered family, looked up when asked for
        from opendit.families import all_models

        return all_models()
    if name in ("Flux", "FLUX_CONFIGS"):  # FLUX.1, imported when asked for (like every architecture here)
        return getattr(__import__("opendit.models.flux", fromlist=[name]), name)
    raise AttributeError(f"module 'opendit.models' has no attribute {name!r}")
