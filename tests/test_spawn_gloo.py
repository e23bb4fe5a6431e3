"""opendit.distributed.spawn_gloo (tests.distributed.run_distributed): ranks forked from the forkserver behave as
spawned ones: they see the caller's environment and working folder at the time of the call, join one gloo group,
and a failing rank's traceback reaches the caller."""
import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed


def _where(rank, world_size):
    ranks = torch.tensor([rank])
    dist.all_reduce(ranks)
    return os.environ.get("OPENDIT_SPAWN_MARK"), os.getcwd(), dist.get_world_size(), int(ranks)


def _fails(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 broke")
    return rank


def test_ranks_see_the_callers_environment_and_folder_of_now(tmp_path, monkeypatch):
    run_distributed(_where, 2)  # the forkserver may start here, with this environment and folder
    monkeypatch.setenv("OPENDIT_SPAWN_MARK", "set after the forkserver started")
    monkeypatch.chdir(tmp_path)
    assert run_distributed(_where, 3) == [("set after the forkserver started", str(tmp_path), 3, 0 + 1 + 2)] * 3


def test_a_failing_rank_raises_its_traceback_in_the_caller():
    with pytest.raises(Exception, match="(?s)ValueError: rank 1 broke"):
        run_distributed(_fails, 2)
