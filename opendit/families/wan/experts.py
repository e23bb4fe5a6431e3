"""Wan2.2's two-expert A14B releases: their folders, and which expert samples at which time."""
import json
from pathlib import Path

import torch
import torch.nn as nn


def expert_folders(path) -> dict | None:
    """A two-expert Wan2.2 A14B folder -> {"high": folder, "low": folder, "boundary": float or None}: the official
    layout (high_noise_model/, low_noise_model/) or a diffusers pipeline (transformer/ the high-noise expert,
    transformer_2/ the low-noise one, boundary_ratio in model_index.json); None for anything else."""
    p = Path(path)
    if (p / "high_noise_model").is_dir() and (p / "low_noise_model").is_dir():
        return {"high": p / "high_noise_model", "low": p / "low_noise_model", "boundary": None}
    if (p / "transformer_2").is_dir() and (p / "model_index.json").is_file():
        return {"high": p / "transformer", "low": p / "transformer_2",
                "boundary": json.loads((p / "model_index.json").read_text()).get("boundary_ratio")}
    return None


class Experts:
    """The model(s) sampling runs: one, or a two-expert A14B model's high-noise expert (loaded.model) for t >=
    the run's boundary and its low-noise one (loaded.companions["low_noise"]) below, each with its guidance scale
    (--cfg_scale, --cfg_scale_low). On a GPU only the expert in use is on it; the idle one waits on the CPU."""

    def __init__(self, loaded, sample_cfg, device):
        self.high, self.low = loaded.model, loaded.companions.get("low_noise")
        self.boundary, self.device = loaded.cfg.expert_boundary, torch.device(device)
        self.scales = (sample_cfg.cfg_scale, sample_cfg.cfg_scale if self.low is None else sample_cfg.cfg_scale_low)
        self.guided = max(self.scales) > 1.0

    def at(self, t: float) -> tuple[nn.Module, float]:
        """(model, guidance scale) at time t in [0, 1]."""
        if self.low is None or t >= self.boundary:
            model, other, scale = self.high, self.low, self.scales[0]
        else:
            model, other, scale = self.low, self.high, self.scales[1]
        if next(model.parameters()).device != self.device:
            if other is not None and next(other.parameters()).device.type != "cpu":
                other.to("cpu")
            model.to(self.device)
        return model, scale
