"""Image transforms shared by the image datasets: ADM center crop and PIL -> [-1, 1] tensor."""
import numpy as np
import torch
from PIL import Image


def center_crop_arr(image: Image.Image, image_size: int) -> Image.Image:
    """ADM / DiT center crop: the result is image_size x image_size (resize_crop to a square)."""
    return resize_crop(image, image_size, image_size)


def resize_crop(image: Image.Image, width: int, height: int, position: tuple[float, float] | None = None
                ) -> Image.Image:
    """Resize until a width x height box fits inside, then crop its center: ADM's crop, for any box.

    Halving with a BOX filter while both sides are still >= twice the box anti-aliases large photos cheaply; one
    BICUBIC resize then makes the limiting side exactly its box side, and the other side is cropped symmetrically
    (the extra pixel of an odd margin goes to the right/bottom). For a square box this is ADM's center crop.
    position (x, y in [0, 1]): where the crop sits in the margin instead (a random crop); None: the center."""
    while image.size[0] >= 2 * width and image.size[1] >= 2 * height:
        image = image.resize(tuple(s // 2 for s in image.size), resample=Image.BOX)
    scale = max(width / image.size[0], height / image.size[1])
    size = (max(width, round(image.size[0] * scale)), max(height, round(image.size[1] * scale)))
    image = image.resize(size, resample=Image.BICUBIC)
    if position is None:
        left, top = (size[0] - width) // 2, (size[1] - height) // 2
    else:
        left, top = round((size[0] - width) * position[0]), round((size[1] - height) * position[1])
    return image.crop((left, top, left + width, top + height))


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
