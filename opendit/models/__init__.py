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


def build_model(name: str, **kwargs):
    """Build a registered model; kwargs go to its constructor (input_size, in_channels, num_classes, ...)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODELS)}")
    return MODELS[name](**kwargs)
