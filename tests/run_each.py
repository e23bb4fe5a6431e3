"""An entry script's run (train.py, sample.py, preprocess.py) for several command lines: `run_here(script, *args)` in
the test's own process (one process, world size 1: no interpreter start and imports to pay, seconds each on a small
CPU), `run_each(script, [args, ...], nproc)` in ONE torchrun launch of nproc workers that runs each command line in
turn (sequence parallel, then CFG parallel, ...: the launch and the imports are paid once). Each command line goes
through the script's own parser, checks and main (as its `__main__` block does); only the process group is kept
between them. sample_here / sample_each: the same for sample.py. Real processes of the scripts: test_train.py
(torchrun), test_user_errors.py (what a bad flag prints), test_latents.py (two-process preprocess.py)."""
import functools
import json
import sys

if __package__ in (None, ""):  # run as a script by torchrun: the repository root on the path for `tests`
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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


def run_each(script: str, runs, nproc: int = 2):
    """`torchrun --nproc_per_node NPROC SCRIPT ARGS` for each ARGS of runs, all in one launch."""
    from tests.test_video_family import cli
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
