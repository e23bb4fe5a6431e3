"""Training curves of one or more runs as one PNG (matplotlib, no display needed).

    python -m opendit.plot outputs/000-DiT-Ti-4                              # -> plot.png
    python -m opendit.plot outputs/000-DiT-Ti-4 outputs/001-DiT-Ti-4 --out cmp.png --smooth 10 --log_y
    python -m opendit.plot outputs/003-DiT-S-2 --x time --keys grad_norm lr

Reads each run folder's log.jsonl (what train.py writes: one JSON object per log line). Panels: the loss
(every key ending in "loss": loss, val_loss, ...; a record with "kind": "val" has its keys read as val_loss,
...), the loss per timestep bucket when a log has such keys (containing "loss" but not ending in it, e.g.
val_loss_t0-249), the throughput (img_per_s), then one panel per --keys name. Runs are overlaid, named by their
folders. A truncated or broken line (a crash mid-write) is skipped with a warning; when a resumed run logs a
step again, the last record wins and the earlier run's later steps are dropped.
"""
import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

RUN_FOLDER = "a run folder (outputs/NNN-<model>/, made by train.py) holds log.jsonl and config.yaml"
PANEL_PX, DPI = (640, 400), 100


@dataclass
class Series:
    step: np.ndarray  # int, increasing
    value: np.ndarray  # float; NaN where a record held no finite value
    time: np.ndarray  # float seconds since the epoch (a record without "time": interpolated from the others')
    kind: str = "train"  # the records' "kind" ("val", ...)


@dataclass
class RunLog:
    series: dict[str, Series] = field(default_factory=dict)
    skipped_lines: list[int] = field(default_factory=list)  # 1-based line numbers that were not a JSON record


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_log(path: Path) -> RunLog:
    """log.jsonl -> the series per numeric key. A record's "kind" other than "train" (e.g. "val") prefixes its
    keys ("loss" -> "val_loss") unless they already start with it. For a repeated step the last record wins
    key by key; a step lower than one already read of the same kind (a resumed run) also drops the later
    steps of that kind's keys (the resumed run redoes them)."""
    points: dict[str, dict[int, tuple[float, float]]] = {}  # key -> step -> (value, time)
    kind_of: dict[str, str] = {}  # key -> the kind of the records that wrote it
    last_step: dict[str, int] = {}  # kind -> highest step read
    keys_of: dict[str, set[str]] = {}  # kind -> the keys its records wrote
    skipped = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                skipped.append(lineno)
                continue
            if not isinstance(record, dict) or not _is_number(record.get("step")):
                skipped.append(lineno)
                continue
            kind, step = str(record.get("kind", "train")), int(record["step"])
            if step < last_step.get(kind, step):  # resumed from an earlier checkpoint: its later steps are redone
                for key in keys_of[kind]:
                    points[key] = {s: p for s, p in points[key].items() if s < step}
            last_step[kind] = step
            time = float(record["time"]) if _is_number(record.get("time")) else math.nan
            for name, v in record.items():
                if _is_number(v) and name not in ("step", "time"):
                    key = name if kind == "train" or name.startswith(kind) else f"{kind}_{name}"
                    points.setdefault(key, {})[step] = (float(v), time)
                    keys_of.setdefault(kind, set()).add(key)
                    kind_of[key] = kind
    known = sorted({(s, t) for p in points.values() for s, (_, t) in p.items() if math.isfinite(t)})
    log = RunLog(skipped_lines=skipped)
    for key in sorted(k for k in points if points[k]):
        rows = sorted(points[key].items())
        step = np.array([s for s, _ in rows], dtype=np.int64)
        value = np.array([v for _, (v, _) in rows], dtype=float)
        time = np.array([t for _, (_, t) in rows], dtype=float)
        if known and not np.isfinite(time).all():
            guess = np.interp(step, [s for s, _ in known], [t for _, t in known])
            time = np.where(np.isfinite(time), time, guess)
        log.series[key] = Series(step, np.where(np.isfinite(value), value, math.nan), time, kind_of[key])
    return log


def find_log(path: Path) -> Path:
    """A run folder (or its log.jsonl) -> the log file, which may not exist yet; else ValueError naming it."""
    if path.is_file() and path.suffix == ".jsonl":
        return path
    if path.is_dir() and ((path / "log.jsonl").is_file() or (path / "config.yaml").is_file()):
        return path / "log.jsonl"
    what = "does not exist" if not path.exists() else "is not a run folder"
    raise ValueError(f"{path} {what}: {RUN_FOLDER}")


def smooth(value: np.ndarray, n: int) -> np.ndarray:
    """Trailing moving average over n points, ignoring NaNs (a point with no finite value in its window: NaN)."""
    if n <= 1 or len(value) == 0:
        return value
    ok = np.isfinite(value)
    total = np.convolve(np.where(ok, value, 0.0), np.ones(n))[:len(value)]
    count = np.convolve(ok.astype(float), np.ones(n))[:len(value)]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), math.nan)


def _natural(key: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def panels(runs: dict[str, RunLog], keys: list[str]) -> list[tuple[str, list[str]]]:
    """(title, keys drawn) per panel: the loss, the loss per timestep bucket (only when logged), the throughput,
    then each extra key."""
    names = {k for log in runs.values() for k in log.series}
    loss = sorted((k for k in names if k.endswith("loss")), key=lambda k: (k != "loss", k)) or ["loss"]
    buckets = sorted((k for k in names if "loss" in k and not k.endswith("loss") and "scale" not in k),
                     key=_natural)
    out = [("loss", loss)] + ([("loss per timestep bucket", buckets)] if buckets else [])
    return out + [("throughput (img/s)", ["img_per_s"])] + [(k, [k]) for k in keys]


def plot_runs(runs: dict[str, RunLog], out: Path, smooth_n: int = 1, x: str = "step", log_y: bool = False,
              keys: list[str] = ()) -> Path:
    """Draw the panels of runs ({legend name: log}) into out (PNG, 640x400 px per panel, 2 panels a row)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layout = panels(runs, list(keys))
    ncol = min(len(layout), 2)
    nrow = math.ceil(len(layout) / ncol)
    fig, axes = plt.subplots(nrow, ncol, squeeze=False, layout="constrained", dpi=DPI,
                             figsize=(ncol * PANEL_PX[0] / DPI, nrow * PANEL_PX[1] / DPI))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    hours = x == "time" and _time_span(runs) > 3 * 3600
    for ax, (title, panel_keys) in zip(axes.flat, layout):
        drawn = 0
        for r, (name, log) in enumerate(runs.items()):
            start = _time_range(log)[0]
            for k, key in enumerate(panel_keys):
                s = log.series.get(key)
                if s is None or len(s.step) == 0 or (x == "time" and not np.isfinite(s.time).any()):
                    continue
                xs = s.step if x == "step" else (s.time - start) / (3600 if hours else 60)
                # a color per run and a line style per key; a color per key where a panel has many
                by_key = len(runs) == 1 or len(panel_keys) > 2
                color = colors[(k if by_key else r) % len(colors)]
                style = styles[(r if by_key else k) % len(styles)]
                label = key if len(runs) == 1 else (name if len(panel_keys) == 1 else f"{name} {key}")
                val = s.kind != "train" or key.startswith("val")  # averages over a held-out set already
                smoothed = s.value if val else smooth(s.value, smooth_n)
                if smoothed is not s.value and len(s.value) > 1:
                    ax.plot(xs, s.value, color=color, linestyle=style, alpha=0.25, linewidth=0.8)
                ax.plot(xs, smoothed, color=color, linestyle=style, label=label,
                        marker="o" if len(s.step) < 3 else None)
                drawn += 1
        ax.set_title(title)
        ax.set_xlabel("step" if x == "step" else ("hours" if hours else "minutes"))
        if drawn:
            ax.legend(fontsize="small")
            if log_y and "loss" in title:
                ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "nothing logged", ha="center", va="center",
                    transform=ax.transAxes)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(layout):]:
        ax.set_visible(False)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def _time_range(log: RunLog) -> tuple[float, float]:
    """The first and last logged time of a run (NaN, NaN without any)."""
    times = [t for s in log.series.values() for t in s.time[np.isfinite(s.time)]]
    return (min(times), max(times)) if times else (math.nan, math.nan)


def _time_span(runs: dict[str, RunLog]) -> float:
    spans = [b - a for a, b in map(_time_range, runs.values()) if math.isfinite(a)]
    return max(spans, default=0.0)


def _names(paths: list[Path]) -> list[str]:
    """Legend names: the run folders' names, the paths as given where two share a name."""
    dirs = [p.parent if p.suffix == ".jsonl" else p for p in paths]
    base = [d.resolve().name for d in dirs]
    return [b if base.count(b) == 1 else str(d) for b, d in zip(base, dirs)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opendit.plot", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run folders (or their log.jsonl)")
    parser.add_argument("--out", type=Path, default=Path("plot.png"), help="the PNG to write (default plot.png)")
    parser.add_argument("--smooth", type=int, default=1, metavar="N", help="moving average over N log lines")
    parser.add_argument("--x", choices=["step", "time"], default="step", help="x axis: step or wall time")
    parser.add_argument("--log_y", action="store_true", help="log-scale loss axes")
    parser.add_argument("--keys", nargs="*", default=[], help="more panels, one per logged key (lr grad_norm mfu)")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error(f"--smooth {args.smooth}: give a number of log lines, 1 or more")
    runs = {}
    for path, name in zip(args.runs, _names(args.runs)):
        try:
            log_path = find_log(path)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        log = read_log(log_path) if log_path.is_file() else RunLog()
        if log.skipped_lines:
            lines = ", ".join(map(str, log.skipped_lines[:5])) + (" ..." if len(log.skipped_lines) > 5 else "")
            print(f"warning: {log_path}: skipped {len(log.skipped_lines)} line(s) that are not a complete JSON "
                  f"record (line {lines}; a crash mid-write?)", file=sys.stderr)
        if not log.series:
            print(f"warning: {path}: no logged steps yet, left out", file=sys.stderr)
            continue
        runs[name] = log
    if not runs:
        print("error: nothing to plot: no run has a logged step yet", file=sys.stderr)
        return 1
    print(plot_runs(runs, args.out, args.smooth, args.x, args.log_y, args.keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
