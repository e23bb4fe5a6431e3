"""Helpers the throughput benchmarks share (imported from benchmarks/, beside them)."""
import gc
import math

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
