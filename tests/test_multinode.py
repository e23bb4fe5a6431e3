"""Two torchrun agents on this machine as two nodes (c10d rendezvous on 127.0.0.1, the user's plain environment):
training equals one agent of the same world size; a worker killed on one node restarts every node and resumes;
a lost node is one clear error; SIGTERM to the agents saves and exits 0. See docs/multinode.md."""
import json
import signal
import time
from pathlib import Path

import pytest

from tests.agents import (DEBUG_ARGS, FAULT_TRAIN, Agents, checkpoints, losses, one_agent, process_tree,
                          wait_for_step)

pytestmark = pytest.mark.slow

LAYOUTS = {  # name: (workers per agent, flags)
    "zero2": (1, ["--plugin", "zero2", "--async_ckpt", "--ckpt_every", "2"]),
    "hsdp_replicas_across_nodes": (2, ["--plugin", "hsdp", "--dp_replicate", "2"]),
    "sequence_parallel_within_node": (2, ["--sequence_parallel_size", "2"]),
}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """Each LAYOUTS layout trained 4 steps under two agents (<root>/<layout>/two) and under one agent of the same
    world size (<root>/<layout>/one); the layouts of one worker count share their launches (tests/run_each.py runs
    train.py for each command line in turn) -> (root, {nproc: (the two agents' exit codes, their text, the one
    agent's exit code, its text)})."""
    root = tmp_path_factory.mktemp("layouts")
    done = {}
    for nproc in dict.fromkeys(n for n, _ in LAYOUTS.values()):
        names = [name for name, (n, _) in LAYOUTS.items() if n == nproc]

        def launch(where, names=names):
            runs = [[*DEBUG_ARGS, "--max_steps", "4", *LAYOUTS[name][1], "--outputs", str(root / name / where)]
                    for name in names]
            return ["tests/run_each.py", "train.py", json.dumps(runs)]

        with Agents(launch("two"), root / f"logs-{nproc}", nproc=nproc) as agents:
            codes = agents.wait()
        done[nproc] = (codes, agents.text(), *one_agent(launch("one"), root / f"logs-{nproc}", nproc=2 * nproc))
    return root, done


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_agents_train_like_one_agent(layout_runs, layout):
    root, done = layout_runs
    codes, text, code, one_text = done[LAYOUTS[layout][0]]
    assert codes == [0, 0], text[-4000:]
    assert code == 0, one_text[-4000:]
    two, one = root / layout / "two", root / layout / "one"
    assert losses(two) == losses(one)  # bitwise: the floats as logged
    assert len(losses(one)) == 4
    assert checkpoints(two) == checkpoints(one)


def test_a_worker_killed_on_one_node_restarts_every_node_and_resumes(tmp_path):
    """torchrun's agents count restarts per node (the killed one's node 1, the other's 0): the restarted
    workers still find each other, without TORCH_DISABLE_SHARE_RDZV_TCP_STORE."""
    args = [*DEBUG_ARGS, "--max_steps", "8", "--ckpt_every", "3", "--load", "auto"]
    for attempt in range(2):  # the failure this guards against came in about half of the tries
        out = tmp_path / f"killed-{attempt}"
        with Agents([FAULT_TRAIN, *args, "--outputs", str(out)], tmp_path / f"logs-{attempt}", max_restarts=1,
                    env={"OPENDIT_FAULT": "kill:6:1"}) as agents:
            assert agents.wait() == [0, 0], agents.text()[-4000:]
            assert "resuming from" in agents.text() and "step-000003" in agents.text()
    code, text = one_agent(["train.py", *args, "--outputs", str(tmp_path / "whole")], tmp_path, nproc=2)
    assert code == 0, text[-4000:]
    assert losses(tmp_path / "killed-0") == losses(tmp_path / "killed-1") == losses(tmp_path / "whole")


def test_a_lost_node_stops_the_other_with_one_error_then_the_same_command_resumes(tmp_path):
    args = ["train.py", *DEBUG_ARGS, "--max_steps", "100000", "--ckpt_every", "2", "--dist_timeout", "0.2",
            "--load", "auto", "--outputs", str(tmp_path / "out")]
    with Agents(args, tmp_path / "logs") as agents:
        wait_for_step(tmp_path / "out", 3, agents.procs)
        start = time.time()
        agents.lose(1)
        code = agents.procs[0].wait(timeout=120)
        seconds = time.time() - start
    text = agents.text()
    assert code != 0 and seconds < 0.2 * 60 + 60, (seconds, text[-4000:])
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    lost = ("another rank did not answer", "the connection to another rank broke")  # a dead process: the second
    assert errors and any(w in errors[0] for w in lost) and "resume with --load auto" in errors[0], \
        text[-4000:]
    assert "Traceback" not in text.split("--- agent 1")[0].split("error: ")[0], text[-4000:]  # no worker traceback
    saved = checkpoints(tmp_path / "out")[-1]
    step = int(saved.split("-")[1])
    with Agents([a if a != "100000" else str(step + 2) for a in args], tmp_path / "logs-again") as again:
        assert again.wait() == [0, 0], again.text()[-4000:]
        assert "resuming from" in again.text() and saved in again.text()
    assert max(losses(tmp_path / "out")) == step + 2


@pytest.mark.parametrize("nnodes", [1, 2])
def test_sigterm_to_the_agents_saves_and_every_worker_exits_0(tmp_path, nnodes):
    """What SLURM (scancel, preemption) and Kubernetes do: SIGTERM to each node's torchrun."""
    out = tmp_path / "out"
    with Agents(["train.py", *DEBUG_ARGS, "--max_steps", "100000", "--outputs", str(out)], tmp_path / "logs",
                nnodes=nnodes, nproc=3 - nnodes) as agents:
        wait_for_step(out, 2, agents.procs)
        for k in range(nnodes):
            agents.signal(k, signal.SIGTERM)
        codes = agents.wait(timeout=120)
    text = agents.text()
    assert text.count("stopped by SIGTERM after step") == 1, text[-4000:]  # rank 0 logs it
    step = max(losses(out))
    assert checkpoints(out) == [f"step-{step:06d}"], text[-4000:]
    # no worker was killed or failed (torchrun itself ends with its SignalException traceback and exit status 1)
    assert "forcefully exiting" not in text and "exitcode: -" not in text, (codes, text[-4000:])
    assert not [line for line in text.splitlines() if line.startswith("[rank") and "Traceback" in line], text[-4000:]


def test_a_launcher_ended_by_sigusr1_makes_its_workers_save_and_exit(tmp_path):
    """SIGUSR1 (or SIGKILL) ends torchrun without passing anything on; its workers would train on unsupervised.
    They get a signal from the kernel instead (PR_SET_PDEATHSIG), save and exit."""
    out = tmp_path / "out"
    with Agents(["train.py", *DEBUG_ARGS, "--max_steps", "100000", "--outputs", str(out)], tmp_path / "logs",
                nnodes=1, nproc=2) as agents:
        wait_for_step(out, 2, agents.procs)
        workers = process_tree(agents.procs[0].pid)[1:]
        assert len(workers) == 2, workers
        agents.signal(0, signal.SIGUSR1)
        agents.procs[0].wait(timeout=60)
        deadline = time.time() + 60
        while time.time() < deadline and any(Path(f"/proc/{w}").exists() for w in workers):
            time.sleep(0.2)
    assert not any(Path(f"/proc/{w}").exists() for w in workers)  # ended on their own, before the kill above
    text = agents.text()
    assert text.count("torchrun's agent (this worker's parent) ended") == 2, text[-4000:]
    assert "stopped by the end of torchrun's agent after step" in text, text[-4000:]
    step = max(losses(out))
    assert checkpoints(out) == [f"step-{step:06d}"], text[-4000:]
