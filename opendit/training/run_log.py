"""Per-run folder, JSONL log, TensorBoard events, the periodic progress line and, between those lines, a live
status (a self-redrawing line on a terminal, a heartbeat line a minute into a log file)."""
import json
import logging
import resource
import sys
import time
from pathlib import Path

import torch

from opendit.console import Status

logger = logging.getLogger("opendit")

QUIET_WHEN_ZERO = ("bad_steps", "skipped_images", "skipped_steps")  # counters left off the console line while 0
HEARTBEAT_S = 60.0  # without a terminal: a status line when nothing was logged for this long


def memory_metrics(device: torch.device) -> dict:
    """Peak device memory since the last call (CUDA; the peak is reset) and the process's peak host memory."""
    out = {"host_peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}  # Linux: KiB
    if device.type == "cuda":
        out["device_peak_gb"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
        torch.cuda.reset_peak_memory_stats(device)
    return out


class RunLogger:
    """Writes metrics on rank 0 only: a JSONL line per log event, TensorBoard scalars, a console line; between
    log events tick() keeps a status (step, rate, ETA) alive."""

    def __init__(self, run_dir: Path, rank: int, total_steps: int, start_step: int, log_every: int,
                 mfu_meter=None, device: torch.device = torch.device("cpu")):
        """mfu_meter: an opendit.perf.MFUMeter that turns img/s into TFLOP/s per device and MFU."""
        self.rank, self.total_steps, self.log_every = rank, total_steps, log_every
        self.mfu_meter, self.device = mfu_meter, device
        self.jsonl = self.tb = None
        if rank == 0:
            self.jsonl = open(Path(run_dir) / "log.jsonl", "a")
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError as e:  # tensorboard is a dependency, but logging must never stop training
                logger.warning("TensorBoard disabled: %s", e)
        self.terminal = rank == 0 and sys.stderr.isatty()
        self._t0, self._step0 = time.perf_counter(), start_step
        self._start_step, self._start_time = start_step, time.perf_counter()
        self._last_output = self._last_status = time.perf_counter()

    def first_step(self, step: int) -> None:
        """A sign of life within seconds of the start, not only at the first --log_every interval."""
        took = time.perf_counter() - self._start_time
        logger.info("step %d done, %.1f s after the start (the first steps include warm-up: allocation, "
                    "compilation, data workers); a log line every %d steps", step, took, self.log_every)
        self._last_output = time.perf_counter()

    def tick(self, step: int) -> None:
        """After each step: redraw the status line on a terminal (at most twice a second), else print it when
        nothing was logged for a minute."""
        if self.rank != 0:
            return
        now = time.perf_counter()
        due = now - self._last_status >= 0.5 if self.terminal else now - self._last_output >= HEARTBEAT_S
        if not due:
            return
        rate = (step - self._start_step) / max(now - self._start_time, 1e-9)
        eta = (self.total_steps - step) / rate if rate > 0 else float("inf")
        text = f"step {step}/{self.total_steps} | {rate:.3g} steps/s | ETA {_fmt_eta(eta)}"
        if self.terminal:
            Status.show(text, sys.stderr)
        else:
            next_log = min((step // self.log_every + 1) * self.log_every, self.total_steps)
            logger.info("%s (next log line at step %d)", text, next_log)
            self._last_output = now
        self._last_status = now

    def pause(self, seconds: float) -> None:
        """Leave `seconds` spent outside training steps (validation, previews, checkpoints) out of the interval's
        steps/s, img/s and step time."""
        self._t0 += seconds

    def log(self, step: int, metrics: dict, images: int, data_wait_s: float = 0.0, quiet: dict | None = None) -> None:
        """metrics: averaged over ranks and the interval since the last call; images: seen in that interval;
        data_wait_s: of the interval, the seconds spent waiting for the next batch; quiet: more metrics for the
        files only, not the console line."""
        now = time.perf_counter()
        dt = max(now - self._t0, 1e-9)
        steps_per_s = (step - self._step0) / dt
        rate = dict(steps_per_s=steps_per_s, img_per_s=images / dt,
                    step_time_s=dt / max(step - self._step0, 1), data_wait_frac=data_wait_s / dt)
        if self.mfu_meter is not None:
            rate.update(self.mfu_meter.metrics(rate["img_per_s"]))
        rate.update(memory_metrics(self.device))
        self._t0, self._step0 = now, step
        if self.rank != 0:
            return
        self._last_output = now
        self._write(step, {**metrics, **(quiet or {}), **rate}, "train")
        eta = (self.total_steps - step) / steps_per_s if steps_per_s > 0 else float("inf")
        shown = " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if v or k not in QUIET_WHEN_ZERO)
        mfu = f" MFU {rate['mfu']:.1%}" if "mfu" in rate else ""
        mem = f" | {rate['device_peak_gb']:.1f} GiB peak" if "device_peak_gb" in rate else ""
        wait = f" | data wait {rate['data_wait_frac']:.0%}" if rate["data_wait_frac"] >= 0.05 else ""
        logger.info("step %d/%d %s | %.2f steps/s %.1f img/s%s%s%s | ETA %s", step, self.total_steps, shown,
                    steps_per_s, rate["img_per_s"], mfu, mem, wait, _fmt_eta(eta))

    def log_validation(self, step: int, metrics: dict) -> None:
        """The validation loss (and by noise level): its own JSONL record ("kind": "val") and TensorBoard tag."""
        if self.rank != 0:
            return
        self._write(step, metrics, "val")
        by_level = " ".join(f"{v:.4g}" for k, v in metrics.items() if k != "val_loss")
        logger.info("step %d validation loss %.4g (by noise level, low to high: %s)", step, metrics["val_loss"],
                    by_level)

    def _write(self, step: int, values: dict, kind: str) -> None:
        record = {"step": step, **values, "time": time.time()} if kind == "train" else \
            {"step": step, "kind": kind, **values, "time": time.time()}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(f"{kind}/{k.removeprefix(kind + '_')}", v, step)

    def close(self) -> None:
        if self.terminal:
            Status.clear(sys.stderr)
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


def _fmt_eta(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    h, rem = divmod(int(seconds), 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}"
