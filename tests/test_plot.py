"""python -m opendit.plot: reading log.jsonl (last record of a step wins, broken lines skipped) and the PNG."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from opendit.plot import PANEL_PX, find_log, main, read_log, smooth


def make_run(root, name, records, tail=""):
    """A run folder as train.py leaves it: config.yaml and log.jsonl (records, then raw text, e.g. a torn line)."""
    run = root / name
    run.mkdir()
    (run / "config.yaml").write_text("model: DiT-Ti-4\n")
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return run


def train_records(steps, loss=lambda s: 1.0 / s, t0=1000.0):
    return [{"step": s, "loss": loss(s), "lr": 1e-4, "img_per_s": 50.0 + s, "time": t0 + s} for s in steps]


def test_read_log_series_per_key(tmp_path):
    run = make_run(tmp_path, "000-a", train_records([10, 20, 30]) + [
        {"step": 20, "kind": "val", "loss": 0.7, "loss_t0-499": 0.9, "time": 1020.5},
        {"step": 30, "val_loss": 0.6, "note": "text is ignored", "ok": True}])
    log = read_log(run / "log.jsonl")
    assert set(log.series) == {"loss", "lr", "img_per_s", "val_loss", "val_loss_t0-499"}
    np.testing.assert_array_equal(log.series["loss"].step, [10, 20, 30])
    np.testing.assert_allclose(log.series["loss"].value, [0.1, 0.05, 1 / 30])
    np.testing.assert_allclose(log.series["img_per_s"].time, [1010, 1020, 1030])
    # val records of kind "val" and a val_loss key in a train record both land in val_loss
    np.testing.assert_array_equal(log.series["val_loss"].step, [20, 30])
    np.testing.assert_allclose(log.series["val_loss"].value, [0.7, 0.6])
    np.testing.assert_allclose(log.series["val_loss"].time, [1020.5, 1030])  # no "time": from the others
    assert log.series["val_loss_t0-499"].kind == "val"
    assert log.skipped_lines == []


def test_read_log_last_record_of_a_step_wins(tmp_path):
    """A run resumed from step 20's checkpoint logs 30 again; the earlier run's step 40 was redone too."""
    records = train_records([10, 20, 30, 40]) + train_records([30], loss=lambda s: 5.0, t0=9000.0)
    log = read_log(make_run(tmp_path, "000-a", records) / "log.jsonl")
    np.testing.assert_array_equal(log.series["loss"].step, [10, 20, 30])
    np.testing.assert_allclose(log.series["loss"].value, [0.1, 0.05, 5.0])
    np.testing.assert_allclose(log.series["loss"].time, [1010, 1020, 9030])


def test_read_log_skips_broken_lines_and_keeps_nan(tmp_path):
    records = train_records([1, 2])
    text = json.dumps(records[0]) + "\n\nnot json\n[1, 2]\n" + '{"loss": 3}\n' + json.dumps(records[1]) + "\n"
    text += '{"step": 3, "loss": NaN}\n{"step": 4, "loss": 0.'  # torn last line: a crash mid-write
    (tmp_path / "log.jsonl").write_text(text)
    log = read_log(tmp_path / "log.jsonl")
    assert log.skipped_lines == [3, 4, 5, 8]
    np.testing.assert_array_equal(log.series["loss"].step, [1, 2, 3])
    assert math.isnan(log.series["loss"].value[-1])


def test_smooth_ignores_nan():
    np.testing.assert_allclose(smooth(np.array([1.0, 3.0, math.nan, 5.0]), 2), [1.0, 2.0, 3.0, 5.0])
    np.testing.assert_array_equal(smooth(np.array([1.0, 2.0]), 1), [1.0, 2.0])


def test_find_log_names_what_a_run_folder_holds(tmp_path):
    run = make_run(tmp_path, "000-a", [])
    assert find_log(run) == run / "log.jsonl" and find_log(run / "log.jsonl") == run / "log.jsonl"
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(ValueError, match=f"{bad}.*holds log.jsonl and config.yaml"):
            find_log(bad)


def test_plot_two_runs_and_an_empty_one(tmp_path, capsys):
    a = make_run(tmp_path, "000-a", train_records(range(10, 200, 10)) +
                 [{"step": s, "kind": "val", "loss": 0.5, "loss_t0-499": 0.4, "loss_t500-999": 0.6}
                  for s in (100, 190)], tail='{"step": 200, "lo')
    b = make_run(tmp_path, "001-b", train_records(range(10, 100, 10), t0=5000.0))
    empty = make_run(tmp_path, "002-c", [])
    out = tmp_path / "plots" / "cmp.png"
    assert main([str(a), str(b), str(empty), "--out", str(out), "--smooth", "3", "--log_y"]) == 0
    err = capsys.readouterr().err
    assert "log.jsonl: skipped 1 line(s)" in err and "002-c: no logged steps yet" in err
    # panels: loss, loss per timestep bucket, throughput: 2 a row
    assert Image.open(out).size == (2 * PANEL_PX[0], 2 * PANEL_PX[1])
    out2 = tmp_path / "time.png"
    assert main([str(b), "--out", str(out2), "--x", "time", "--keys", "lr", "grad_norm"]) == 0
    assert Image.open(out2).size == (2 * PANEL_PX[0], 2 * PANEL_PX[1])  # loss, throughput, lr, grad_norm


def test_cli_errors_in_one_line(tmp_path):
    make_run(tmp_path, "000-a", [])
    cmd = [sys.executable, "-m", "opendit.plot", str(tmp_path), "--out", str(tmp_path / "p.png")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert f"{tmp_path} is not a run folder" in res.stderr and "log.jsonl" in res.stderr
    res = subprocess.run(cmd[:3] + [str(tmp_path / "000-a")], capture_output=True, text=True)
    assert res.returncode == 1 and "nothing to plot" in res.stderr.splitlines()[-1]
