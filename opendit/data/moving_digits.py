"""Moving digits: the built-in video demo, made from scikit-learn's real 8x8 digit scans (no download).

Each item is one digit scan, upscaled to 3/4 of the frame, sliding over a black canvas at a constant speed in
one of 8 directions and bouncing off the edges. The motion is small and regular (1 px per frame at 16 px,
scaled with the frame size) so a small video DiT learns it on a CPU in minutes.
"""
import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from opendit.data.digits import SPLITS, _load_raw, digits_split
from opendit.data.spec import DatasetSpec
from opendit.data.transforms import check_image_size
from opendit.data.video_io import clip_span
from opendit.seeding import mix_seed

# (caption words, (dx, dy) unit step in image coordinates: x to the right, y down)
DIRECTIONS = (("right", (1, 0)), ("left", (-1, 0)), ("down", (0, 1)), ("up", (0, -1)),
              ("down and right", (1, 1)), ("down and left", (-1, 1)), ("up and right", (1, -1)),
              ("up and left", (-1, -1)))


def _bounce(position: int, limit: int) -> int:
    """Fold an unbounded coordinate into 0..limit as a ball bouncing between two walls would move."""
    period = 2 * limit
    folded = position % period
    return folded if folded <= limit else period - folded


class MovingDigitsDataset(Dataset):
    """item = (float32 [channels, num_frames, S, S] in [-1, 1], int digit, caption), e.g.
    "the digit 3 moving up and left".

    The digit is digit_size pixels square (white ink on black: 0 -> -1, 16 -> 1) and moves
    `speed` = max(1, image_size // 16) * frame_interval pixels per frame along each axis of its direction
    (frame_interval > 1 is the same motion with frames skipped, as from a video). Its start position and
    direction are a pure function of (seed, index); the caption names the direction it starts in (a bounce
    reverses the axis that hits the wall). The motions do not change with the epoch: every epoch and
    every evaluation see the same clips. digit_size: the digit's side in pixels (default 3/4 of the frame);
    bounce=False: starts are drawn so that the whole clip stays clear of the walls, so the caption's direction
    holds in every frame (the text-to-video demo). border=True: a 1 px mid-grey frame around the canvas, drawn over the
    digit: a fixed mark of where the canvas ends, from which a model that sees only relative positions (RoPE, as
    Wan) learns where to put the digit far sooner. len = the number of digit scans in `split` (1797 for "all";
    "train" / "held_out" as digits_split's default split). channels=3 repeats the grey plane.
    """

    num_classes = 10
    classes = [str(digit) for digit in range(10)]

    def __init__(self, image_size: int = 32, num_frames: int = 16, channels: int = 1, seed: int = 0,
                 split: str = "all", frame_interval: int = 1, digit_size: int | None = None, bounce: bool = True,
                 border: bool = False):
        self.image_size = check_image_size(image_size)
        if self.image_size < 8:
            raise ValueError(f"moving digits need image_size >= 8 (the digit is 3/4 of the frame), got {image_size}")
        clip_span(num_frames, frame_interval)  # validates both
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {channels!r}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed!r}")
        self.num_frames, self.frame_interval = int(num_frames), int(frame_interval)
        self.channels = channels
        self.seed = int(seed)
        self.epoch = 0
        # default 3/4 of the frame: at 16 px a 12 px digit (bicubic from its 8x8 scan, smooth), moving over 4 px
        self.digit_size = 3 * self.image_size // 4 if digit_size is None else int(digit_size)
        if not 1 <= self.digit_size <= self.image_size:
            raise ValueError(f"digit_size {digit_size} must lie in 1..image_size ({self.image_size})")
        self.speed = max(1, self.image_size // 16) * self.frame_interval
        self._limit = self.image_size - self.digit_size  # top-left coordinates run over 0..limit
        self.bounce, self.border = bool(bounce), bool(border)
        if not self.bounce and self.speed * (self.num_frames - 1) > self._limit:
            raise ValueError(f"bounce=False: {self.num_frames} frames at {self.speed} px per frame travel "
                             f"{self.speed * (self.num_frames - 1)} px, more than the {self._limit} px the digit "
                             f"({self.digit_size} px) has in a {self.image_size} px frame; use fewer frames or a "
                             f"smaller digit_size")
        if split == "all":
            images, labels = _load_raw()
        else:
            train, held = digits_split()
            images, labels = train if split == "train" else held
        self._images = np.round(images * (255.0 / 16.0)).astype(np.uint8)  # [N, 8, 8], ink 0..255
        self._labels = labels
        self._bad = set()  # interface of the file-backed datasets: nothing here is ever unreadable

    @property
    def num_skipped(self) -> int:
        return len(self._bad)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)  # kept for the loader's interface; the clips do not depend on it

    def __len__(self) -> int:
        return len(self._labels)

    def motion(self, index: int):
        """-> (direction words, (x0, y0) top-left pixel at frame 0, (vx, vy) pixels per frame)."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} is outside 0..{len(self) - 1}")
        rng = np.random.default_rng(mix_seed(self.seed, index))
        words, (dx, dy) = DIRECTIONS[int(rng.integers(len(DIRECTIONS)))]
        if self.bounce:
            x0, y0 = (int(v) for v in rng.integers(0, self._limit + 1, size=2))
        else:  # a start from which the whole clip stays inside the frame
            travel = [self.speed * (self.num_frames - 1) * abs(d) for d in (dx, dy)]
            x0, y0 = (int(rng.integers(0, self._limit - span + 1)) + (span if d < 0 else 0)
                      for d, span in zip((dx, dy), travel))
        return words, (x0, y0), (dx * self.speed, dy * self.speed)

    def digit_position(self, index: int, frame: int):
        """(x, y): the digit's top-left pixel in `frame` of item `index`; always within 0..S - digit_size."""
        _, (x0, y0), (vx, vy) = self.motion(index)
        return _bounce(x0 + vx * frame, self._limit), _bounce(y0 + vy * frame, self._limit)

    def caption(self, index: int) -> str:
        return f"the digit {int(self._labels[index])} moving {self.motion(index)[0]}"

    def __getitem__(self, index: int):
        size = self.digit_size
        sprite = np.asarray(Image.fromarray(self._images[index]).resize((size, size), resample=Image.BICUBIC))
        frames = np.zeros((self.num_frames, self.image_size, self.image_size), np.uint8)  # [T, S, S]
        for t in range(self.num_frames):
            x, y = self.digit_position(index, t)
            frames[t, y:y + size, x:x + size] = sprite
        if self.border:
            frames[:, [0, -1], :] = frames[:, :, [0, -1]] = 128
        clip = torch.from_numpy(frames).float().div_(127.5).sub_(1.0).unsqueeze(0)  # [1, T, S, S]
        if self.channels == 3:
            clip = clip.expand(3, -1, -1, -1).contiguous()
        return clip, int(self._labels[index]), self.caption(index)


MOVING_DIGITS = DatasetSpec("moving_digits", "built in video demo: the digits sliding and bouncing over a black "
                                             "canvas in one of 8 directions, label = digit, captioned",
                            lambda path, size, **kw: MovingDigitsDataset(size, **kw), channels=1)
