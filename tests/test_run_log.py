"""Signs of life and health in a run's log: a first line after the first step, a status between log lines,
step time, data wait and memory per interval."""
import json
import logging

from opendit import console
from opendit.training import run_log
from tests.test_train import run_trainer, tiny_cfg


def test_first_step_line_heartbeat_and_health_metrics(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(run_log, "HEARTBEAT_S", 0.0)  # no terminal here: the heartbeat is a log line
    trainer, _ = run_trainer(tiny_cfg(tmp_path, max_steps=4, log_every=4))
    err = capfd.readouterr().err
    assert "step 1 done" in err and "a log line every 4 steps" in err
    assert "step 2/4 |" in err and "steps/s | ETA" in err and "(next log line at step 4)" in err
    (record,) = [json.loads(line) for line in (trainer.run_dir / "log.jsonl").read_text().splitlines()]
    assert record["step"] == 4 and record["step_time_s"] > 0 and 0 <= record["data_wait_frac"] <= 1
    assert record["host_peak_gb"] > 0.1


def test_status_line_on_a_terminal_is_cleared_before_log_records(capsys):
    class Tty:
        def __init__(self):
            self.text = ""

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    stream = Tty()
    console.Status.show("step 3/10 | 2 steps/s", stream)
    handler = console._StatusAwareHandler(stream)
    handler.emit(logging.LogRecord("opendit", 30, __file__, 1, "a warning", None, None))
    assert stream.text == "\r\x1b[Kstep 3/10 | 2 steps/s\r\x1b[Ka warning\n"
