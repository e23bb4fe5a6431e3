"""Helpers the benchmarks share (imported from benchmarks/, beside them)."""
import gc
import math
import time
from pathlib import Path

import numpy as np
import torch


def sync(device: torch.device) -> None:
    """Wait for the device (timings must include the queued kernels)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """Drop what the last variant left behind and restart the peak-memory count."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def fmt(v, spec=".1f") -> str:
    """A table cell: "-" for a missing or NaN value."""
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def failure_status(e: Exception) -> str:
    """A failed variant's status cell: the exception's type and first line."""
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def write_zero_base(path: Path, model: str, **arch) -> float:
    """A weights file of `model`'s shapes (official ones unless `arch` overrides a value), all zeros in bf16 (no
    download and no random init of billions of parameters on the host; values change neither the memory nor,
    beyond a few percent, the time), written tensor by tensor: the host holds one tensor, not the weights -> seconds."""
    from opendit.checkpoint.folders import write_safetensors
    from opendit.families import family_of

    t0 = time.time()
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in family_of(model).models[model].build(**arch).state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(path, {k: (torch.bfloat16, s) for k, s in shapes.items()},
                      (torch.zeros(s, dtype=torch.bfloat16) for s in shapes.values()))
    return time.time() - t0


def sample_checkpoint(sample_cfg, conditions: list, n: int, chunk: int = 50) -> tuple[np.ndarray, float]:
    """n samples of a checkpoint on the CPU, sample i conditioned on conditions[i % len(conditions)], as sample.py
    makes them (its family's defaults fill what sample_cfg leaves out) -> (uint8 samples, seconds of sampling)."""
    from opendit.inference import complete_sample_config, load_model

    device = torch.device("cpu")
    loaded = load_model(sample_cfg, device)
    family = loaded.family
    sample_cfg = complete_sample_config(family, sample_cfg, loaded.cfg)
    sampler = family.make_sampler(sample_cfg, loaded.cfg)
    t0 = time.time()
    samples = np.concatenate([family.sample_batch(loaded, sampler, range(s, min(s + chunk, n)), conditions,
                                                  sample_cfg, device) for s in range(0, n, chunk)])
    return samples, time.time() - t0
