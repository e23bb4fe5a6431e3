"""Reference images of an editing model (a diffusers-transformer model whose constants name `references`): the
controls of training pairs in model space, and sample.py's --image read once into each prompt's reference files and
handed to the pipeline as PIL images at the sample size."""
from pathlib import Path

import torch

from opendit.families.wrapped.glue import ModelGlue, PixelSpace
from opendit.images import image_paths


def image_of_the_set(references, height: int, width: int) -> dict:
    """A Declared.reference_call for a pipeline whose `image` is one set of reference images for its whole call
    (FLUX.2's, FLUX.3's; Qwen-Image-Edit's, which samples one prompt per call)."""
    return {} if references is None else dict(image=references[0])


def reference_latents(glue: ModelGlue, vae, controls: torch.Tensor) -> torch.Tensor:
    """Controls [B, K, C, H, W] in [-1, 1] -> [B, K, C', h', w'] in model space, as a pipeline encodes a reference
    image: resized as it resizes them (glue.reference_pixels, if it does), the posterior's mode (its mean; pixels
    themselves in pixel space), normalised and packed as latents are."""
    images = reference_inputs(glue, controls).flatten(0, 1)
    z = images if isinstance(vae, PixelSpace) else glue.posterior(vae, images)[0]
    return glue.to_model_space(vae, z.float()).float().unflatten(0, controls.shape[:2])


def reference_inputs(glue: ModelGlue, controls: torch.Tensor) -> torch.Tensor:
    """Controls [B, K, C, H, W] in [-1, 1] as the model's pipeline hands its reference images to the VAE: resized by
    glue.reference_pixels where it resizes them (Qwen-Image-Edit: to its own area), else as they are."""
    if glue.reference_pixels is None:
        return controls
    return torch.stack([glue.reference_pixels(images) for images in control_images(controls)]).to(controls.device)


def control_images(controls: torch.Tensor) -> list[list]:
    """Controls [B, K, C, H, W] in [-1, 1] -> each sample's as PIL images (grey for one channel), the pixels they
    were read from (a pipeline takes its reference images as PIL)."""
    from PIL import Image
    pixels = ((controls.detach().float().cpu() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    pixels = pixels.permute(0, 1, 3, 4, 2).numpy()
    return [[Image.fromarray(p[..., 0] if p.shape[-1] == 1 else p) for p in sample] for sample in pixels]


def reference_sets(image: str, prompts: int, model: str, most: int) -> list[list[Path]]:
    """sample.py's --image for `model` (taking at most `most` references) -> the reference files of each prompt (one
    set: every prompt's): a file, or files joined by commas (one set); a folder of images (one per prompt, in name
    order), or of folders (one per prompt, each holding that prompt's references)."""
    if "," in image:
        sets = [[p for part in image.split(",") for p in image_paths(part)]]
    else:
        folder = Path(image)
        subfolders = sorted(d for d in folder.iterdir() if d.is_dir()) if folder.is_dir() else []
        sets = [image_paths(str(d)) for d in subfolders] if subfolders else [[p] for p in image_paths(image)]
        if not folder.is_dir():
            sets = [[p for s in sets for p in s]]
        elif len(sets) != prompts:
            raise ValueError(f"--image {image} holds {len(sets)} reference {'folders' if subfolders else 'images'} "
                             f"for {prompts} prompts: give one per prompt, or a file (or files joined by commas) for "
                             f"all")
    if max(map(len, sets)) > most:
        raise ValueError(f"--image: {max(map(len, sets))} reference images for one prompt; {model} takes at most "
                         f"{most}")
    return sets


def reference_images(paths: list[Path], height: int, width: int, grey: bool) -> list:
    """Reference files -> PIL images resized and cropped to the sample size as training's controls are, grey where
    the model samples grey pixels."""
    from PIL import Image

    from opendit.data.transforms import resize_crop

    def reference(path):
        with Image.open(path) as image:
            image = resize_crop(image.convert("RGB"), width, height)
        return image.convert("L") if grey else image
    return [reference(path) for path in paths]
