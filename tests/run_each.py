"""An entry script's run (train.py, sample.py, preprocess.py) for several command lines: `run_here(script, *args)` in
the test's own process (one process, world size 1: no interpreter start and imports to pay, seconds each on a small
CPU), `run_each(script, [args, ...], nproc)` in ONE torchrun launch of nproc workers that runs each command line in
turn (sequence parallel, then CFG parallel, ...: the launch and the imports are paid once). Each command line goes
through the script's own parser, checks and main (as its `__main__` block does); only the process group is kept
between them. sample_here / sample_each: the same for sample.py. `cli(script, *args, nproc=1)`: any script in a
real process, as a user starts it (under torchrun when nproc > 1); test_train.py, test_user_errors.py (what a bad flag
prints) and test_latents.py (two-process preprocess.py) start theirs too. `losses_of(run_dir)`: a run's logged
losses."""
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script by torchrun: the repository root on the path for `tests`
    sys.path.insert(0, str(ROOT))


# script -> (its config class in opendit.config, the function its __main__ block runs)
ENTRIES = {"train": ("TrainConfig", "main"), "sample": ("SampleConfig", "main"),
           "preprocess": ("PreprocessConfig", "run")}


def _run(script: str, argv) -> None:
    import importlib

    from opendit import config as cfglib
    from opendit.cli import parse_config, run_entry

    module = importlib.import_module(script.removesuffix(".py"))
    config, entry = ENTRIES[module.__name__]
    run_entry(getattr(module, entry), parse_config(getattr(cfglib, config), module.__doc__, [str(a) for a in argv]),
              check=cfglib.check_config)


def run_here(script: str, *args) -> None:
    """`python SCRIPT ARGS` in this process, with one intra-op thread (as the launched workers run)."""
    import torch

    from opendit.distributed import cleanup
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _run(script, args)
    finally:
        torch.set_num_threads(n)
        cleanup()  # the one-process group the script made (preprocess.py leaves it to its __main__ block)


def cli(script, *args, nproc=1):
    """`python SCRIPT ARGS` (`torchrun --nproc_per_node NPROC SCRIPT ARGS` when nproc > 1) in the repository root,
    one intra-op thread per process; it must succeed (its stderr's tail is the failure's message)."""
    cmd = [sys.executable, script, *map(str, args)] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script,
         *map(str, args)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def trains_and_resumes_exactly(run: dict, root, steps: int = 2):
    """train.py on the options `run` for `steps` steps into root/cli (a checkpoint at the last), then resumed there to
    2 x steps: its losses are an uninterrupted run's (root/a), all finite -> (that run's Trainer, its losses)."""
    import numpy as np

    from opendit import config as cfglib
    from tests.test_train import run_trainer
    run_here("train.py", *[a for k, v in run.items() for a in (f"--{k}", str(v))], "--max_steps", str(steps),
             "--ckpt_every", str(steps), "--outputs", Path(root) / "cli")
    trainer, full = run_trainer(cfglib.TrainConfig(**run, max_steps=2 * steps, ckpt_every=steps,
                                                   outputs=str(Path(root) / "a")))
    _, resumed = run_trainer(cfglib.TrainConfig(**run, max_steps=2 * steps, ckpt_every=steps, load="latest",
                                                outputs=str(Path(root) / "cli")))
    assert resumed == full[steps:] and all(np.isfinite(full))
    return trainer, full


def losses_of(run_dir) -> list[float]:
    """The losses a run folder's log.jsonl holds, one per logged step."""
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "log.jsonl").read_text().splitlines()]


def run_each(script: str, runs, nproc: int = 2):
    """`torchrun --nproc_per_node NPROC SCRIPT ARGS` for each ARGS of runs, all in one launch."""
    return cli("tests/run_each.py", script, json.dumps([[str(a) for a in args] for args in runs]), nproc=nproc)


sample_here, sample_each = functools.partial(run_here, "sample.py"), functools.partial(run_each, "sample.py")


def main() -> None:
    import torch.distributed as dist

    from opendit import distributed, inference

    cleanup = distributed.cleanup
    distributed.cleanup = inference.cleanup = dist.barrier  # the group lives on for the next command line
    for argv in json.loads(sys.argv[2]):
        _run(sys.argv[1], argv)
    cleanup()
    distributed.exit_process()


if __name__ == "__main__":
    main()
