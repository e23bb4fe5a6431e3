"""Several torchrun agents on this machine, as several nodes would run them: `--nnodes N`, c10d rendezvous on
127.0.0.1, each agent in its own session (so a test can signal or kill one "node" with its workers). The
environment is the user's own: no TORCH_DISABLE_SHARE_RDZV_TCP_STORE."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAULT_TRAIN = str(ROOT / "tests" / "fault_train.py")
DEBUG_ARGS = ["--model", "DiT-debug", "--image_size", "8", "--batch_size", "8", "--log_every", "1",
              "--num_workers", "0", "--lr", "1e-3", "--ema_decay", "0.9"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    """pid and every process below it (torchrun starts each worker in a session of its own, so killing the
    agent's process group would leave its workers running)."""
    pids, k = [pid], 0
    while k < len(pids):
        for task in Path(f"/proc/{pids[k]}/task").glob("*"):
            try:
                pids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        k += 1
    return pids


def kill_tree(pid: int) -> None:
    """SIGKILL pid and its descendants at once, as a lost machine ends them."""
    for p in process_tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def clean_env(env: dict | None = None) -> dict:
    base = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    return {**base, "OMP_NUM_THREADS": "1", **(env or {})}


class Agents:
    """`nnodes` torchrun agents of one job running `args` (a script and its flags); their output goes to
    <logs>/agent-K.txt. A context manager: leaving it kills whatever still runs."""

    def __init__(self, args, logs: Path, nnodes: int = 2, nproc: int = 1, max_restarts: int = 0, env=None):
        self.logs = Path(logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id=test-{os.getpid()}",
               "--local-addr=127.0.0.1", f"--max-restarts={max_restarts}", "--monitor-interval=0.5", *args]
        self.files = [open(self.logs / f"agent-{k}.txt", "w") for k in range(nnodes)]
        self.procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True,
                                       env=clean_env(env), start_new_session=True) for f in self.files]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()

    def wait(self, timeout: float = 300) -> list[int]:
        deadline = time.time() + timeout
        try:
            codes = [p.wait(timeout=max(1.0, deadline - time.time())) for p in self.procs]
        finally:
            self.kill()
        return codes

    def signal(self, k: int, sig=signal.SIGTERM) -> None:
        """Signal agent k (as SLURM or Kubernetes signal the launcher of a node)."""
        self.procs[k].send_signal(sig)

    def lose(self, k: int) -> None:
        """Node k is gone: its agent and its workers SIGKILLed at once."""
        kill_tree(self.procs[k].pid)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait()
        for f in self.files:
            f.close()

    def text(self) -> str:
        return "\n".join(f"--- agent {k}\n" + (self.logs / f"agent-{k}.txt").read_text()
                         for k in range(len(self.procs)))


def one_agent(args, logs: Path, nproc: int, env=None, timeout: float = 300) -> tuple[int, str]:
    """The same job under one agent (`--standalone`, all workers on one node)."""
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc-per-node={nproc}", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=clean_env(env))
    try:
        text, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
    Path(logs).mkdir(parents=True, exist_ok=True)
    (Path(logs) / "one-agent.txt").write_text(text)
    return proc.returncode, text


def losses(outputs) -> dict[int, float]:
    """{step: loss} of the run under outputs; a step logged twice (before a kill and after the restart) keeps
    the later record."""
    logs = list(Path(outputs).glob("*/log.jsonl"))
    assert len(logs) == 1, logs
    return {r["step"]: r["loss"] for r in map(json.loads, logs[0].read_text().splitlines())}


def wait_for_step(outputs, step: int, procs, timeout: float = 180) -> None:
    """Until the run under outputs has logged `step` (fails early if a process has ended)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        logs = list(Path(outputs).glob("*/log.jsonl"))
        if logs and any(json.loads(line)["step"] >= step for line in logs[0].read_text().splitlines() if line):
            return
        assert all(p.poll() is None for p in procs), f"a process ended before the run logged step {step}"
        time.sleep(0.2)
    raise TimeoutError(f"no step {step} within {timeout} s")


def checkpoints(outputs) -> list[str]:
    return sorted(p.name for p in Path(outputs).glob("*/checkpoints/step-*"))
