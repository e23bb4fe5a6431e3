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


def assert_official_file_loads(family, model, official_layout, path) -> None:
    """The model's weights written in the release's single-file layout (`official_layout`: state dict -> that
    layout) are recognised as the family's and load back as the model's own, every tensor."""
    from safetensors.torch import save_file
    save_file(official_layout(model.state_dict()), path)
    assert family.recognize_checkpoint(str(path)) is not None
    loaded = family.load_weights(str(path))
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def release_converted(family, release: str, official_layout, in_channels: int) -> tuple[dict, dict]:
    """({key: shape} the converter makes of the registered `release` model's official layout, {key: shape} of the
    model), the model built on the meta device."""
    with torch.device("meta"):
        model = family.models[release].build(in_channels=in_channels)
    converted = family.glue.convert_official(official_layout(model.state_dict()))
    return {k: v.shape for k, v in converted.items()}, {k: v.shape for k, v in model.state_dict().items()}
