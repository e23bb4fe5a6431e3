"""Wan2.2's two-expert A14B releases: their folders, both experts as one trained module (--expert both), and which
expert samples at which time."""
import json
from pathlib import Path

import torch
import torch.nn as nn

from opendit.families.wan.model import WanModel


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


class ExpertPair(nn.Module):
    """Both experts of a two-expert model as one module (--expert both): state keys `high.` and `low.` + the
    expert's. A batch runs the expert whose share of the schedule its times fall in (t in 0..1000, high: t >=
    boundary x 1000): training draws each micro-batch's times on one side and names its expert (WanFlowObjective),
    the same on every rank, so sharded plugins gather one expert per micro-batch and the other's parameters get no
    gradient."""

    _block_lists = ("high_blocks", "low_blocks")
    parallel_plan = WanModel.parallel_plan
    partly_used = True  # a step trains one expert: DDP must expect unused parameters

    def __init__(self, high: WanModel, low: WanModel, boundary: float):
        super().__init__()
        self.high, self.low, self.boundary = high, low, boundary
        self.num_heads, self.model_type = high.num_heads, high.model_type
        self.patch_size, self.text_len, self.text_dim, self.in_dim = high.patch_size, high.text_len, high.text_dim, \
            high.in_dim

    @property
    def high_blocks(self) -> nn.ModuleList:
        return self.high.blocks

    @property
    def low_blocks(self) -> nn.ModuleList:
        return self.low.blocks

    def __setattr__(self, name, value):
        if name in self._block_lists:  # an expert's blocks, not a module of the pair's own (nn.Module would add one)
            (self.high if name == "high_blocks" else self.low).blocks = value
        else:
            super().__setattr__(name, value)

    @property
    def sequence_parallel(self):
        return self.high.sequence_parallel

    @sequence_parallel.setter
    def sequence_parallel(self, sp) -> None:  # enable_sequence_parallel sets the model's hook: both experts'
        self.high.sequence_parallel = self.low.sequence_parallel = sp

    def forward(self, x, t, *args, expert: str | None = None, **kwargs):
        """expert "high" or "low": that expert's forward (a training micro-batch); None: each sample's own, both
        experts run (validation: every rank runs both, as a sharded expert is gathered collectively)."""
        if expert is not None:
            return (self.high if expert == "high" else self.low)(x, t, *args, **kwargs)
        out_high, out_low = self.high(x, t, *args, **kwargs), self.low(x, t, *args, **kwargs)
        high = t.reshape(len(t), -1)[:, 0] >= self.boundary * 1000
        return torch.where(high.reshape(-1, *[1] * (out_high.ndim - 1)), out_high, out_low)


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
