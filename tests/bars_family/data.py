"""The family's built-in dataset: clips of a bar moving across an 8x8 grid, captioned with its direction."""
import torch
from torch.utils.data import Dataset

from opendit.data import DatasetSpec

CAPTIONS = ("a bar moving left", "a bar moving right", "a bar moving up", "a bar moving down")


class MovingBars(Dataset):
    """item = (float32 [1, T, S, S] in [-1, 1], the caption's index, the caption): a bar two pixels wide that
    moves frame_interval pixels a frame (wrapping around) on an 8x8 grid upscaled to S, from a start fixed per
    item. num_classes 0: captions condition."""
    num_classes, channels = 0, 1

    def __init__(self, image_size: int = 8, num_frames: int = 4, frame_interval: int = 1, seed: int = 0,
                 items: int = 32):
        if image_size % 8:
            raise ValueError(f"--image_size {image_size}: the bars move on an 8x8 grid; pass a multiple of 8")
        self.image_size, self.num_frames, self.step, self.seed, self.items = (image_size, num_frames, frame_interval,
                                                                              seed, items)

    def __len__(self):
        return self.items

    def caption(self, i: int) -> str:
        return CAPTIONS[i % len(CAPTIONS)]

    def __getitem__(self, i: int):
        kind = i % len(CAPTIONS)
        start = int(torch.randint(8, (1,), generator=torch.Generator().manual_seed(self.seed * 1000 + i)))
        sign = -1 if kind in (0, 2) else 1
        frames = []
        for f in range(self.num_frames):
            grid = torch.full((8, 8), -1.0)
            at = [(start + sign * f * self.step + d) % 8 for d in (0, 1)]
            if kind < 2:
                grid[:, at] = 1.0
            else:
                grid[at, :] = 1.0
            frames.append(grid)
        scale = self.image_size // 8
        clip = torch.stack(frames).repeat_interleave(scale, 1).repeat_interleave(scale, 2)
        return clip[None], kind, self.caption(i)


MOVING_BARS = DatasetSpec("moving_bars", "built in: 8x8 clips of a bar moving left, right, up or down, captioned",
                          lambda path, size, **kw: MovingBars(size, **kw), channels=1)
