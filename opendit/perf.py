"""Model FLOPs, matmul peak and MFU. Each model family counts its own model's FLOPs (its
train_flops_per_sample, with matmul_macs below); MFUMeter turns them into TFLOP/s and MFU for the training log.

Counting convention (the DiT paper's): only matmuls count — every nn.Linear, the patch
embedding convolution and the two attention products (q k^T and p v); norms, activations, softmax and
the optimizer are free. A training step costs 3 forward passes (forward, and a backward that needs two
matmuls per forward matmul), each multiply-accumulate (MAC) is 2 FLOP. DiT-XL/2 at 256 px (32x32
latents, 256 tokens) is 118.6 GMAC forward -> 3 x 2 x 118.6 = 712 GFLOP per training image.
Activation checkpointing recomputes a forward but does not change these *model* FLOPs (that is MFU,
not hardware FLOP utilisation).
"""
import time
from collections.abc import Callable

import torch
import torch.nn as nn


def matmul_macs(model: nn.Module, rows_of: Callable[[str], int]) -> int:
    """Multiply-accumulates of every nn.Linear and patch convolution of `model` for one sample: a Linear(in, out)
    named `name` costs rows_of(name) * in * out, a convolution rows_of(name) * weight.numel() (one output
    position per row). Attention products are the caller's (they depend on how the model lays out sequences)."""
    macs = 0
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            macs += rows_of(name) * m.in_features * m.out_features
        elif isinstance(m, (nn.Conv2d, nn.Conv3d)):
            macs += rows_of(name) * m.weight.numel()
    return macs


def mfu(flops_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOP utilisation: achieved model FLOP/s over the peak (both per device)."""
    if peak_flops_per_s <= 0:
        raise ValueError(f"peak_flops_per_s must be positive, got {peak_flops_per_s}")
    return flops_per_s / peak_flops_per_s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bf16_matmul_peak(device="cuda", n: int = 8192, iters: int = 20, dtype=torch.bfloat16) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` on `device` (best of `iters` timed runs after a warm-up).

    The reference "peak" for MFU: what this device really reaches on the friendliest GEMM, measured in
    the same run as the model (on one H200 an 8192^3 bf16 matmul reaches ~790 TFLOP/s). On a CPU pass a
    small n (e.g. 512): the number only makes the smoke-test table complete.
    """
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


class MFUMeter:
    """Turns images trained per interval into TFLOP/s per device and MFU, for the training log.

    flops_per_image: the family's train_flops_per_sample(model); world_size: devices sharing the global batch;
    peak_flops_per_s: per device (None: measure_bf16_matmul_peak on CUDA, no MFU on CPU).
    """

    def __init__(self, flops_per_image: float, world_size: int = 1, peak_flops_per_s: float | None = None,
                 device="cuda"):
        device = torch.device(device)
        if peak_flops_per_s is None and device.type == "cuda":
            peak_flops_per_s = measure_bf16_matmul_peak(device)
        self.flops_per_image, self.world_size, self.peak = flops_per_image, world_size, peak_flops_per_s
        self._t0 = time.perf_counter()

    def reset(self) -> None:
        """Start the interval now (call when the training loop starts, so set-up time is not counted)."""
        self._t0 = time.perf_counter()

    def update(self, images: int) -> dict:
        """images: global images trained since the last call (or construction) -> metrics for the log."""
        now = time.perf_counter()
        dt, self._t0 = max(now - self._t0, 1e-9), now
        return self.metrics(images / dt)

    def metrics(self, img_per_s: float) -> dict:
        """{"tflops": model TFLOP/s per device, "mfu": fraction of the peak (absent without a peak)}; {} when the
        family does not count its FLOPs (flops_per_image 0)."""
        if not self.flops_per_image:
            return {}
        flops = img_per_s * self.flops_per_image / self.world_size
        out = {"tflops": flops / 1e12}
        if self.peak:
            out["mfu"] = mfu(flops, self.peak)
        return out
