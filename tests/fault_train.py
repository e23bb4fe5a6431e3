"""train.py with a fault injected before a given step, for the reliability tests (run as a script, also under
torchrun). The fault is set by the environment, so the command line stays train.py's own:

    OPENDIT_FAULT=kill:5:1    rank 1 SIGKILLs itself before step 5, on the first attempt only (torchrun restarts)
    OPENDIT_FAULT=hang:3:1    rank 1 stops responding before step 3 (sleeps; SIGTERM cannot wake it)
    OPENDIT_FAULT=signal:4:1:SIGUSR1   rank 1 sends itself SIGUSR1 before step 4
    OPENDIT_FAULT=nan:3,4     every rank's loss is NaN at steps 3 and 4 (a range 3-99 works too)
    OPENDIT_FAULT=killsaving:4:0   rank 0's background write of step 4's checkpoint (--async_ckpt) stalls, and rank
                                   0 SIGKILLs itself before step 5, while that write is in flight (first attempt)
    OPENDIT_FAULT=slow:0.5    every step takes 0.5 s longer (time to send a second signal during one)
"""
import os
import runpy
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _steps(spec: str) -> set[int]:
    steps = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        steps.update(range(int(lo), int(hi or lo) + 1))
    return steps


def faulty_train_step(fault: str):
    """Trainer.train_step with the fault described by `fault` (see the module docstring)."""
    from opendit.training.loop import Trainer

    kind, _, rest = fault.partition(":")
    rank = int(os.environ.get("RANK", 0))
    original_step = Trainer.train_step

    if kind == "slow":
        def train_step(self, batch):
            time.sleep(float(rest))
            return original_step(self, batch)
        return train_step
    if kind == "killsaving":
        at, victim = (int(n) for n in rest.split(":"))
        _stall_checkpoint_writes(f"step-{at:06d}")
        kind, rest = "kill", f"{at + 1}:{victim}"
    if kind == "nan":
        bad = _steps(rest)

        def train_step(self, batch):
            objective_losses = type(self.objective).losses

            def losses(objective, model, x, cond, **kw):
                per_sample, t = objective_losses(objective, model, x, cond, **kw)
                return (per_sample * float("nan") if self.step + 1 in bad else per_sample), t
            self.objective.losses = losses.__get__(self.objective)
            return original_step(self, batch)
    else:  # kill, hang, signal
        parts = rest.split(":")
        at, victim = int(parts[0]), int(parts[1])
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

        def train_step(self, batch):
            if rank == victim and self.step + 1 == at:
                if kind == "kill" and first_attempt:
                    os.kill(os.getpid(), signal.SIGKILL)
                elif kind == "hang":
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    time.sleep(3600)
                elif kind == "signal":
                    os.kill(os.getpid(), getattr(signal, parts[2]))
            return original_step(self, batch)
    return train_step


def _stall_checkpoint_writes(folder_name: str) -> None:
    """DCP's writes into the checkpoint folder named folder_name (its .tmp- name) take a minute."""
    from opendit.checkpoint.save import RecordingWriter

    write_data = RecordingWriter.write_data

    def stalled(self, plan, planner):
        if str(self.path).endswith(folder_name):
            time.sleep(60)
        return write_data(self, plan, planner)
    RecordingWriter.write_data = stalled


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # opendit from this checkout, as train.py would import it
    from opendit.training.loop import Trainer

    Trainer.train_step = faulty_train_step(os.environ["OPENDIT_FAULT"])
    sys.argv[0] = str(ROOT / "train.py")
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
