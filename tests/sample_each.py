"""sample.py's run for several command lines: `sample_here(*args)` in the test's own process (one process, world size
1), `sample_each([args, ...], nproc)` in ONE torchrun launch of nproc workers that runs each command line in turn
(sequence parallel, then CFG parallel, ...: the launch and the imports are paid once). Each command line goes
through sample.py's own parser, checks and main; only the process group is kept between them."""
import json
import sys

if __package__ in (None, ""):  # run as a script by torchrun: the repository root on the path for `tests`
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _run(argv) -> None:
    import sample
    from opendit import config as cfglib
    from opendit.cli import parse_config, run_entry

    run_entry(sample.main, parse_config(cfglib.SampleConfig, sample.__doc__, [str(a) for a in argv]),
              check=cfglib.check_config)


def sample_here(*args) -> None:
    """`python sample.py ARGS` in this process, with one intra-op thread (as the launched workers run)."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _run(args)
    finally:
        torch.set_num_threads(n)


def sample_each(runs, nproc: int = 2):
    """`torchrun --nproc_per_node NPROC sample.py ARGS` for each ARGS of runs, all in one launch."""
    from tests.test_video_family import cli
    return cli("tests/sample_each.py", json.dumps([[str(a) for a in args] for args in runs]), nproc=nproc)


def main() -> None:
    import torch.distributed as dist

    from opendit import inference
    from opendit.distributed import cleanup, exit_process

    runs = json.loads(sys.argv[1])
    inference.cleanup = dist.barrier  # the group lives on for the next command line
    for argv in runs:
        _run(argv)
    cleanup()
    exit_process()


if __name__ == "__main__":
    main()
