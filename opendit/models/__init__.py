"""A flat registry of model names -> constructors."""
from functools import partial

from opendit.models.dit import DiT

# (depth, hidden, heads): the DiT paper's four sizes, plus Ti (DeiT-Tiny widths) for CPU demos
_DIT_SIZES = {"Ti": (12, 192, 3), "S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}

MODELS = {
    f"DiT-{size}/{patch}": partial(DiT, depth=d, hidden_size=h, num_heads=n, patch_size=patch)
    for size, (d, h, n) in _DIT_SIZES.items()
    for patch in (2, 4, 8)
}
MODELS["DiT-debug"] = partial(DiT, depth=2, hidden_size=64, num_heads=4, patch_size=2)


def model_spec(name: str):
    """The registry entry (a partial whose .keywords hold patch_size, num_heads, ...); unknown names list the
    valid ones."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODELS)}")
    return MODELS[name]


def build_model(name: str, **kwargs):
    """Build a registered model; kwargs go to its constructor (input_size, in_channels, num_classes, ...)."""
    return model_spec(name)(**kwargs)
