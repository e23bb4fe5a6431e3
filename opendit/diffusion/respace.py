"""Timestep respacing: sample (or train) with a subset of a diffusion's steps, as DiT/IDDPM do.

A SpacedDiffusion keeps steps S = {s_0 < s_1 < ...} of a base schedule and rebuilds betas so that
its alphas_cumprod at index i equals the base's at s_i: beta_i = 1 - acp[s_i] / acp[s_{i-1}].
The model was trained on the base's step numbers, so every model call maps index i -> s_i.
"""
import numpy as np
import torch

from .gaussian import GaussianDiffusion


def _evenly_spaced(size: int, count: int) -> list:
    """`count` indices spread over [0, size) including both ends, rounded (IDDPM's rule)."""
    if count > size:
        raise ValueError(f"cannot take {count} steps from a section of {size} steps")
    if count <= 1:
        return [0] * count
    # Accumulate the float stride (not i * stride): for some counts (21, 23, 31, ...) rounding
    # differs, and accumulating reproduces the exact steps DiT/IDDPM checkpoints were sampled with.
    stride, position, taken = (size - 1) / (count - 1), 0.0, []
    for _ in range(count):
        taken.append(round(position))
        position += stride
    return taken


def space_timesteps(num_timesteps: int, section_counts) -> set:
    """Which of the base steps 0..num_timesteps-1 to keep.

    section_counts: "ddimN" (N steps at a fixed integer stride, starting at 0, as DDIM does);
    "N" or "N1,N2,..." / a list of ints (split the steps into equal sections and take Ni evenly
    spaced steps from section i); or an int. E.g. space_timesteps(1000, "10,15,20") keeps 10 steps
    of the first 334, 15 of the next 333 and 20 of the last 333.
    """
    if isinstance(section_counts, str):
        text = section_counts.strip()
        if text.startswith("ddim"):
            desired = int(text[len("ddim"):])
            for stride in range(1, num_timesteps + 1):
                if len(range(0, num_timesteps, stride)) == desired:
                    return set(range(0, num_timesteps, stride))
            raise ValueError(f"cannot make exactly {desired} DDIM steps of equal integer stride from "
                             f"{num_timesteps}; pick a count such as {num_timesteps // 20} or use '{desired}'")
        try:
            section_counts = [int(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"timestep_respacing {section_counts!r} must look like '250', 'ddim50' "
                             "or '10,20,30'") from None
    elif isinstance(section_counts, int):
        section_counts = [section_counts]
    section_counts = list(section_counts)
    if not section_counts or any(c < 0 for c in section_counts) or sum(section_counts) == 0:
        raise ValueError(f"timestep_respacing {section_counts} must hold non-negative counts summing to > 0")

    size_per, extra = divmod(num_timesteps, len(section_counts))
    steps, start = [], 0
    for i, count in enumerate(section_counts):
        size = size_per + (1 if i < extra else 0)
        steps += [start + k for k in _evenly_spaced(size, count)]
        start += size
    return set(steps)


class _WrappedModel:
    """Calls model(x, timestep_map[t], **kwargs): respaced index -> the base step it was trained on."""

    def __init__(self, model, timestep_map):
        self.model = model
        self.timestep_map = timestep_map  # list of base steps, ascending

    def __call__(self, x, t, **kwargs):
        table = torch.tensor(self.timestep_map, device=t.device, dtype=t.dtype)
        return self.model(x, table[t], **kwargs)


class SpacedDiffusion(GaussianDiffusion):
    """A GaussianDiffusion over `use_timesteps` of the base schedule given by `betas`."""

    def __init__(self, use_timesteps, *, betas, **kwargs):
        self.use_timesteps = set(int(s) for s in use_timesteps)
        base = GaussianDiffusion(betas=betas, **kwargs)
        self.original_num_steps = base.num_timesteps
        if not self.use_timesteps or min(self.use_timesteps) < 0 or max(self.use_timesteps) >= base.num_timesteps:
            raise ValueError(f"use_timesteps must be a non-empty subset of 0..{base.num_timesteps - 1}")
        self.timestep_map = sorted(self.use_timesteps)
        kept = base.alphas_cumprod[self.timestep_map]  # float64 [S]
        new_betas = 1.0 - kept / np.append(1.0, kept[:-1])
        super().__init__(betas=new_betas, **kwargs)

    def _wrap(self, model_fn):
        if isinstance(model_fn, _WrappedModel):
            return model_fn
        return _WrappedModel(model_fn, self.timestep_map)

    def p_mean_variance(self, model_fn, *args, **kwargs):
        return super().p_mean_variance(self._wrap(model_fn), *args, **kwargs)

    def training_losses(self, model_fn, *args, **kwargs):
        return super().training_losses(self._wrap(model_fn), *args, **kwargs)
