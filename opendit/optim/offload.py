"""Where optimizer states live, and how they travel to the compute device and back.

state_device="gpu": states stay beside the parameter; `fetch` hands back the stored tensors themselves.
state_device="cpu": states live in host memory (pinned when CUDA exists). `prefetch` starts the
host->device copy of a parameter's parts on a side stream, so the next parameter's states arrive while
the current one updates (double buffering: the optimizer keeps at most one prefetch ahead); `write_back`
queues the device->host copy on the same side stream after the update, so the stream's order also
orders the next step's prefetch after it. Without CUDA the copies are plain synchronous copies (the
code path is the same, which is what the CPU tests exercise).
"""
import warnings

import torch

_PIN_FAILED = False


def pinned_empty_like(t: torch.Tensor) -> torch.Tensor:
    """An empty host tensor like `t`, pinned when CUDA exists (pinning can fail on a full host: then pageable)."""
    global _PIN_FAILED
    if torch.cuda.is_available() and not _PIN_FAILED:
        try:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        except RuntimeError as err:  # e.g. the pinned-memory limit (ulimit -l) is reached
            _PIN_FAILED = True
            warnings.warn(f"pinning host memory failed ({err}); optimizer states use pageable memory, "
                          "so host<->device copies are synchronous", stacklevel=2)
    return torch.empty(t.shape, dtype=t.dtype)


class StatePlacement:
    def __init__(self, state_device: str = "gpu"):
        if state_device not in ("gpu", "cpu"):
            raise ValueError(f"state_device must be 'gpu' or 'cpu', got {state_device!r}")
        self.offload = state_device == "cpu"
        self._streams = {}  # cuda device -> side stream
        self._pending = {}  # key -> (ready event or None, {part: device tensor})

    def host_device(self, compute_device: torch.device) -> torch.device:
        return torch.device("cpu") if self.offload else compute_device

    def pin(self, compute_device: torch.device) -> bool:
        return self.offload and compute_device.type == "cuda"

    def _side(self, device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def prefetch(self, key, host: dict, device: torch.device) -> None:
        if not self.offload or key in self._pending:
            return
        if device.type != "cuda":
            self._pending[key] = (None, {k: t.to(device, copy=True) for k, t in host.items()})
            return
        side = self._side(device)
        with torch.cuda.stream(side):
            dev = {k: t.to(device, non_blocking=True) for k, t in host.items()}
            ready = torch.cuda.Event()
            ready.record(side)
        self._pending[key] = (ready, dev)

    def fetch(self, key, host: dict, device: torch.device) -> dict:
        """The parts on `device`, ready for use on the current stream (the host tensors when not offloaded)."""
        if not self.offload:
            return host
        self.prefetch(key, host, device)
        ready, dev = self._pending.pop(key)
        if ready is not None:
            current = torch.cuda.current_stream(device)
            current.wait_event(ready)
            for t in dev.values():  # allocated on the side stream, used on this one
                t.record_stream(current)
        return dev

    def write_back(self, host: dict, dev: dict) -> None:
        if not self.offload:
            return
        devices = {t.device for t in dev.values()}
        if not devices or next(iter(devices)).type != "cuda":
            for k, t in dev.items():
                host[k].copy_(t)
            return
        device = next(iter(devices))
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        side = self._side(device)
        with torch.cuda.stream(side):
            side.wait_event(done)
            for k, t in dev.items():
                host[k].copy_(t, non_blocking=True)
                t.record_stream(side)  # keep the device copy alive until the copy has run

    def synchronize(self) -> None:
        """Wait for every queued copy (before host code reads or replaces the host tensors)."""
        for stream in self._streams.values():
            stream.synchronize()
        self._pending.clear()
