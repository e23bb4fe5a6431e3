"""Model code: shared layers (layers.py, blocks.py, pos_embed.py), one file per architecture (dit.py, vdit.py,
latte.py, flux.py) and converters to and from diffusers' layouts (convert_diffusers.py, convert_flux_diffusers.py).

Models are plain math: they import no family, registry or booster. Importing a shared layer imports no
architecture. Model names live with their families: opendit.families.build_model("DiT-XL/2", ...) builds one.
"""
