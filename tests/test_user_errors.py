"""A bad flag or file, tried as a new user would: the real entry scripts (train.py, sample.py, preprocess.py) end
with exit status 2 and ONE line `error: ...` naming the flag or file, no traceback, and no run folder left
behind (opendit/cli.py, opendit.config.check_config). The rows run as forks of one process (tests/entry_forks.py);
one row of each script also in a new interpreter of its own, which must print the same."""
import json
import os
import re
import subprocess
import sys

import pytest

from opendit import cli, errors
from tests.test_train import ROOT

TRAIN = ["train.py", "--model", "DiT-debug", "--image_size", "8", "--batch_size", "8", "--max_steps", "1",
         "--num_workers", "0"]  # a valid tiny run; each row appends what breaks it (a later flag wins)

# (row id, command line, what the error line must name)
ROWS = [
    ("max_steps negative", [*TRAIN, "--max_steps", "-5"], "--max_steps -5"),
    ("lr negative", [*TRAIN, "--lr", "-1"], "--lr -1"),
    ("lr nan", [*TRAIN, "--lr", "nan"], "--lr nan"),
    ("batch_size zero", [*TRAIN, "--batch_size", "0"], "--batch_size 0"),
    ("log_every zero", [*TRAIN, "--log_every", "0"], "--log_every 0"),
    ("keep_last zero", [*TRAIN, "--keep_last", "0"], "--keep_last 0"),
    ("ema_decay one or more", [*TRAIN, "--ema_decay", "1.5"], "--ema_decay 1.5"),
    ("class_dropout_prob above one", [*TRAIN, "--class_dropout_prob", "2"], "--class_dropout_prob 2"),
    ("epochs zero without max_steps", [*TRAIN, "--max_steps", "0", "--epochs", "0"], "--epochs 0"),
    ("argparse: wrong type", [*TRAIN, "--max_steps", "x"], "--max_steps"),
    ("argparse: not a choice", [*TRAIN, "--plugin", "zero9"], "--plugin"),
    ("image_size not a multiple of the patch", [*TRAIN, "--image_size", "9"], "--image_size 9"),
    ("batch not divisible by grad_accum", [*TRAIN, "--batch_size", "10", "--grad_accum", "4"], "--batch_size 10"),
    ("data_path missing", [*TRAIN, "--dataset", "folder", "--data_path", "no/such/images"], "no/such/images"),
    ("load missing", [*TRAIN, "--load", "no/such/step-000100"], "no/such/step-000100"),
    ("sample: no ckpt", ["sample.py"], "--ckpt"),
    ("sample: ckpt missing", ["sample.py", "--ckpt", "no/such/ema.safetensors"], "no/such/ema.safetensors"),
    ("sample: zero steps", ["sample.py", "--ckpt", "latest", "--num_sampling_steps", "0"], "--num_sampling_steps 0"),
    ("preprocess: no out", ["preprocess.py", "--dataset", "digits"], "--out"),
    ("preprocess: out exists", ["preprocess.py", "--dataset", "digits", "--out", "."], "--overwrite"),
]
RUN_FOLDER = re.compile(r"^\d{3}-")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != cli.TRACEBACK_ENV}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def _by_path(cmd):
    """The script by its path (cwd is the row's own folder)."""
    return [str(ROOT / cmd[0]), *cmd[1:]] if cmd[0].endswith(".py") else cmd


def _run(cmd, cwd, env=None, timeout=300):
    out = subprocess.run([sys.executable, *_by_path(cmd)], cwd=cwd, env=env or _env(), capture_output=True, text=True,
                         timeout=timeout)
    return out.returncode, out.stdout + out.stderr


def _run_folders(root):
    return [p for p in root.rglob("*") if p.is_dir() and RUN_FOLDER.match(p.name)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every row's (exit status, output, cwd): each command line a fork of one process that imported torch and
    opendit (tests/entry_forks.py), not a new interpreter importing them again for each row."""
    root = tmp_path_factory.mktemp("rows")
    cwds = [tmp_path_factory.mktemp(f"row{i}") for i in range(len(ROWS))]
    rows = [[_by_path(cmd)[0], cmd[1:], str(cwd), str(root / f"{i}.txt")]
            for i, ((_, cmd, _), cwd) in enumerate(zip(ROWS, cwds))]
    (root / "rows.json").write_text(json.dumps(rows))
    code, output = _run(["tests/entry_forks.py", str(root / "rows.json")], ROOT)
    assert code == 0, output[-3000:]
    codes = json.loads(output.strip().splitlines()[-1])
    return {row[0]: (c, (root / f"{i}.txt").read_text(), cwd) for i, (row, c, cwd) in enumerate(zip(ROWS, codes, cwds))}


@pytest.mark.parametrize("name", ["max_steps negative", "sample: zero steps", "preprocess: no out"])
def test_a_new_interpreter_prints_what_the_fork_does(results, tmp_path, name):
    """What only a new process shows (output while importing, the interpreter's own exit) for one row of each
    script: the same exit status and lines as its fork above."""
    cmd = next(row[1] for row in ROWS if row[0] == name)
    code, output = _run(cmd, tmp_path)
    assert (code, output.splitlines()) == (results[name][0], results[name][1].splitlines())


def _assert_one_error_line(output, names):
    assert "Traceback" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), output[-3000:]
    assert names in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_one_line_and_exit_status_2(results, row):
    code, output, cwd = results[row[0]]
    assert code == 2, output[-3000:]
    _assert_one_error_line(output, row[2])
    assert not _run_folders(cwd), f"a run folder was left behind: {_run_folders(cwd)}"


def test_traceback_on_request(tmp_path):
    code, output = _run([*TRAIN, "--max_steps", "-5"], tmp_path, env=_env(**{cli.TRACEBACK_ENV: "1"}))
    assert code == 1 and "Traceback" in output and "ValueError: --max_steps -5" in output


def test_set_up_errors_are_one_line_later_errors_keep_their_traceback(monkeypatch, capsys):
    monkeypatch.setattr(errors, "_setup_over", False)

    def bad_set_up(cfg):
        raise FileNotFoundError(2, "No such file or directory", "/data/x.png")

    with pytest.raises(SystemExit) as exit_info:
        cli.run_entry(bad_set_up, None)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: No such file or directory: /data/x.png  [OPENDIT_TRACEBACK")

    def sampler_does_not_apply(cfg):
        raise SystemExit("sample.py: --sampler euler does not apply to DiT-S/2; use one of ddpm, ddim")

    with pytest.raises(SystemExit) as exit_info:
        cli.run_entry(sampler_does_not_apply, None)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: --sampler euler does not apply to DiT-S/2; use one of ddpm, ddim\n"

    def fails_in_a_step(cfg):
        errors.setup_finished()
        raise ValueError("a bug in a step")

    with pytest.raises(ValueError, match="a bug in a step"):
        cli.run_entry(fails_in_a_step, None)
    monkeypatch.setattr(errors, "_setup_over", False)
    with pytest.raises(KeyError):  # a bare key is a lookup bug, not a message for the user
        cli.run_entry(lambda cfg: {}["model"], None)


def test_fp16_without_a_gpu_warns_and_runs():
    """fp16 on a CPU works (torch's CPU autocast) but is slower than fp32: a warning, not an error."""
    from opendit import config as cfglib
    from tests.test_train import tiny_cfg

    warnings = cfglib.check_config(tiny_cfg("out", mixed_precision="fp16"))
    import torch
    assert bool(warnings) != torch.cuda.is_available()
    assert all("--mixed_precision fp16" in w for w in warnings)


@pytest.mark.slow
@pytest.mark.parametrize("bad", [["--max_steps", "-5"], ["--image_size", "9"], ["--load", "no/such/step-000100"]],
                         ids=["flag", "in_set_up", "rank0_only"])
def test_torchrun_prints_the_error_once(tmp_path, bad):
    """Two ranks, gloo: rank 0 prints the line, rank 1 exits quietly (torchrun adds its own failure summary).
    rank0_only: only rank 0 resolves --load; rank 1, waiting for it in a broadcast, exits quietly too."""
    code, output = _run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                         str(ROOT / "train.py"), *TRAIN[1:], *bad], tmp_path)
    assert code != 0
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and bad[-1] in errors[0], output[-3000:]
    assert "[rank0]:" not in output and "[rank1]:" not in output, output[-3000:]  # no worker's traceback
    assert "exitcode  : 2" in output, output[-3000:]
    assert not _run_folders(tmp_path)

