"""Image transforms shared by the image datasets: ADM center crop and PIL -> [-1, 1] tensor."""
import numpy as np
import torch
from PIL import Image


def center_crop_arr(image: Image.Image, image_size: int) -> Image.Image:
    """ADM / DiT center crop: the result is image_size x image_size.

    Halving with a BOX filter while the short side is still >= 2 * image_size anti-aliases large
    photos cheaply; one BICUBIC resize then brings the short side to exactly image_size, and the
    long side is cropped symmetrically (the extra pixel of an odd margin goes to the right/bottom).
    """
    while min(image.size) >= 2 * image_size:
        image = image.resize(tuple(s // 2 for s in image.size), resample=Image.BOX)
    scale = image_size / min(image.size)
    image = image.resize(tuple(round(s * scale) for s in image.size), resample=Image.BICUBIC)
    width, height = image.size
    left = (width - image_size) // 2
    top = (height - image_size) // 2
    return image.crop((left, top, left + image_size, top + image_size))


def to_signed_tensor(image: Image.Image) -> torch.Tensor:
    """uint8 PIL image (RGB or L) -> float32 [C, H, W] in [-1, 1]."""
    arr = np.asarray(image, dtype=np.uint8)
    if arr.ndim == 2:  # L mode: [H, W] -> [H, W, 1]
        arr = arr[:, :, None]
    tensor = torch.from_numpy(arr.copy()).permute(2, 0, 1)  # [C, H, W] uint8
    return tensor.float().div_(127.5).sub_(1.0)


def check_image_size(image_size) -> int:
    """image_size must be a positive int (bools are rejected: True would silently mean 1)."""
    if isinstance(image_size, bool) or not isinstance(image_size, (int, np.integer)) or image_size <= 0:
        raise ValueError(f"image_size must be a positive int, got {image_size!r}; pass e.g. --image_size 256")
    return int(image_size)
