"""Per-run folder, JSONL log, TensorBoard events and the periodic progress line."""
import json
import logging
import re
import time
from pathlib import Path

logger = logging.getLogger("opendit")

QUIET_WHEN_ZERO = ("bad_steps", "skipped_images", "skipped_steps")  # counters left off the console line while 0


def setup_logging(rank: int) -> None:
    """INFO on rank 0, warnings only elsewhere, one format for all."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s rank{rank}] %(message)s", datefmt="%H:%M:%S", force=True)


def new_run_dir(outputs: str, model_name: str) -> Path:
    """outputs/NNN-<model>: the next free number, created now (call on rank 0 only)."""
    root = Path(outputs)
    root.mkdir(parents=True, exist_ok=True)
    numbers = [int(m.group(1)) for p in root.iterdir() if (m := re.match(r"(\d+)-", p.name))]
    run = root / f"{max(numbers, default=-1) + 1:03d}-{model_name.replace('/', '-')}"
    run.mkdir()
    return run


class RunLogger:
    """Writes metrics on rank 0 only: a JSONL line per log event, TensorBoard scalars, a console line."""

    def __init__(self, run_dir: Path, rank: int, total_steps: int, start_step: int, mfu_meter=None):
        """mfu_meter: an opendit.perf.MFUMeter that turns img/s into TFLOP/s per device and MFU."""
        self.rank, self.total_steps, self.mfu_meter = rank, total_steps, mfu_meter
        self.jsonl = self.tb = None
        if rank == 0:
            self.jsonl = open(Path(run_dir) / "log.jsonl", "a")
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError as e:  # tensorboard is a dependency, but logging must never stop training
                logger.warning("TensorBoard disabled: %s", e)
        self._t0, self._step0 = time.perf_counter(), start_step

    def log(self, step: int, metrics: dict, images: int) -> None:
        """metrics: averaged over ranks and the interval since the last call; images: seen in that interval."""
        now = time.perf_counter()
        dt = max(now - self._t0, 1e-9)
        steps_per_s = (step - self._step0) / dt
        rate = dict(steps_per_s=steps_per_s, img_per_s=images / dt)
        if self.mfu_meter is not None:
            rate.update(self.mfu_meter.metrics(rate["img_per_s"]))
        self._t0, self._step0 = now, step
        if self.rank != 0:
            return
        record = {"step": step, **metrics, **rate, "time": time.time()}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in {**metrics, **rate}.items():
                self.tb.add_scalar(f"train/{k}", v, step)
        eta = (self.total_steps - step) / steps_per_s if steps_per_s > 0 else float("inf")
        shown = " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if v or k not in QUIET_WHEN_ZERO)
        mfu = f" MFU {rate['mfu']:.1%}" if "mfu" in rate else ""
        logger.info("step %d/%d %s | %.2f steps/s %.1f img/s%s | ETA %s", step, self.total_steps, shown,
                    steps_per_s, rate["img_per_s"], mfu, _fmt_eta(eta))

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


def _fmt_eta(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    h, rem = divmod(int(seconds), 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}"
