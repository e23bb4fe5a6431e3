"""The pieces a family's own tests start from: a registered debug model built through its family, with the tiny text
encoder its constants name and a VAE folder (or pixel space)."""
from pathlib import Path

import torch

from opendit import config as cfglib


def debug_parts(model: str, root, vae: str = "none", image_size: int = 16, **options):
    """(family, cfg, encoders, the model in eval mode, seeded 0) of the debug `model` on the captioned digits (a video
    family's on 5-frame moving digits); its text encoder written in root/text; options override the run's."""
    from opendit.families import family_of
    from opendit.families.wrapped.tiny_text import write_text_encoder
    family = family_of(model)
    video = "moving_digits" in family.datasets
    data = dict(dataset="moving_digits", num_frames=5) if video else dict(dataset="captioned_digits")
    text = write_text_encoder(model, Path(root) / "text", "moving_digits" if video else "digits")
    cfg = family.resolve_config(cfglib.TrainConfig(**{**data, **options}, model=model, image_size=image_size, vae=vae,
                                                   text_encoder=text, outputs="unused"))
    encoders = family.load_encoders(cfg, torch.device("cpu"), training=True)
    torch.manual_seed(0)
    return family, cfg, encoders, family.build_model(cfg, family.latent_shape(cfg, encoders)).eval()
