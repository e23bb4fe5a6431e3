"""The launch recipes of scripts/: the SLURM batch script run under a fake `srun` (which starts its command once
per node, here as two local torchrun agents) and a fake `scontrol`; the Kubernetes example parses and resumes."""
import os
import signal
import stat
import subprocess
import time

import pytest
import yaml

from tests.agents import DEBUG_ARGS, ROOT, checkpoints, clean_env, free_port, kill_tree, losses, wait_for_step

SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"

FAKE_SRUN = """#!/usr/bin/env bash
# srun's options are dropped; the command runs once per node, as SLURM's tasks would, and gets srun's signals.
while [[ "$1" == --* ]]; do shift; done
pids=()
for node in $(seq 0 $((SLURM_NNODES - 1))); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" &
    pids+=($!)
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
status=0
for pid in "${pids[@]}"; do
    while true; do
        wait "$pid"; code=$?
        kill -0 "$pid" 2>/dev/null || break
    done
    [ "$code" -ne 0 ] && status=$code
done
exit $status
"""

FAKE_SCONTROL = """#!/usr/bin/env bash
case "$1 $2" in
    "show hostnames") for _ in $(seq "$SLURM_NNODES"); do echo 127.0.0.1; done ;;
    "requeue "*) echo "$2" >> "$FAKE_SLURM_REQUEUED" ;;
esac
"""


def _fake_slurm(tmp_path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return clean_env({"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
                      "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_SUBMIT_DIR": str(ROOT),
                      "GPUS_PER_NODE": "1", "RDZV_PORT": str(free_port()), "PYTHON": "python",
                      "FAKE_SLURM_REQUEUED": str(tmp_path / "requeued")})


@pytest.mark.slow
def test_the_sbatch_script_trains_on_two_nodes_and_a_time_limit_saves_and_requeues(tmp_path):
    env = _fake_slurm(tmp_path)
    args = [*DEBUG_ARGS, "--max_steps", "3", "--outputs", str(tmp_path / "out")]
    out = subprocess.run(["bash", str(SBATCH), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "2 nodes x 1 workers" in text and "over 2 data-parallel ranks" in text, text[-4000:]
    assert checkpoints(tmp_path / "out") == ["step-000003"]

    # the time limit near (--signal=B:USR1@300): the run saves and stops, the script requeues the job
    proc = subprocess.Popen(["bash", str(SBATCH), *DEBUG_ARGS, "--max_steps", "100000", "--outputs",
                             str(tmp_path / "limit")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(tmp_path / "limit", 2, [proc])
        time.sleep(0.5)
        proc.send_signal(signal.SIGUSR1)
        text, _ = proc.communicate(timeout=180)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, text[-4000:]
    assert (tmp_path / "requeued").read_text().split() == ["4242"], text[-4000:]
    step = max(losses(tmp_path / "limit"))
    assert checkpoints(tmp_path / "limit") == [f"step-{step:06d}"], text[-4000:]


def test_the_kubernetes_example_runs_train_py_elastic_with_load_auto():
    job = yaml.safe_load((ROOT / "scripts" / "kubernetes" / "pytorchjob.yaml").read_text())
    assert job["kind"] == "PyTorchJob" and job["spec"]["elasticPolicy"]["rdzvBackend"] == "c10d"
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert command[0] == "torchrun" and "train.py" in command and "--load=auto" in command
    from opendit import config as cfglib  # the example's flags are train.py's
    flags = command[command.index("train.py") + 1:]
    cfglib.from_args(cfglib.TrainConfig, cfglib.build_parser(cfglib.TrainConfig, None).parse_args(flags))
