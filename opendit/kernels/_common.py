"""Launch-size helpers shared by the Triton kernel files (import only after triton is known to work)."""
import os

import torch
import triton


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (slow, fp32 only, no autotune)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def block_size(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def num_warps(block_elems: int) -> int:
    """Warps for a program that touches `block_elems` elements: ~256 elements per warp, 1..16."""
    return max(1, min(16, block_elems // 256))


def rows_per_program(total_rows: int, rows_per_group: int, device: torch.device) -> int:
    """Rows one backward program walks through while summing weight / per-sample grads.

    More rows -> smaller partial-sum buffers but fewer programs; aim for ~4 programs per SM.
    Rounded to a power of two because the value is a compile-time constant of the kernel.
    """
    if interpreting() or device.type != "cuda":
        return min(block_size(rows_per_group), 16)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = block_size(max(1, total_rows // (4 * sms)))
    return max(1, min(rows, block_size(rows_per_group), 256))
