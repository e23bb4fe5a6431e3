"""What every rank must decide together at each step: skip a step whose loss or gradient norm is not finite, and
stop after a preemption signal.

SIGTERM (what SLURM and Kubernetes send before they kill a job) and SIGUSR1 (SLURM's `--signal`) only set a
flag here; the trainer finishes the step it is in, saves a checkpoint and exits 0. A signal may reach one rank
only, or the ranks at different steps, so the flag travels in the same small all-reduce as the non-finite
verdict: every rank takes the same decision at the same step. A second signal of the same kind ends the
process at once (the default action), for a user who really means it. Under torchrun a worker also asks the
kernel for a signal (LAUNCHER_GONE) when its agent dies: SIGUSR1 or SIGKILL to torchrun end it without passing
anything on, and its workers, each in a session of their own, would train on unsupervised. They save and exit the
same way instead (the kernel may send it once per thread of the agent: never an escalation).

A non-finite step changes nothing (weights, optimizer states, EMA, lr schedule stay as they were); after
`max_bad_steps` of them in a row the run stops with NonFiniteTrainingError.
"""
import ctypes
import logging
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from opendit.errors import RunStopped

logger = logging.getLogger("opendit")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
LAUNCHER_GONE = signal.SIGUSR2


class NonFiniteTrainingError(RunStopped):
    """Too many non-finite steps in a row: the run stops (its message says where to resume from)."""


class PeerLostError(RunStopped):
    """A collective failed for want of a peer: it waited longer than --dist_timeout (the peer died, hangs or is
    far slower), or the peer's connection broke (its process or its machine died)."""

    @classmethod
    def of(cls, error: BaseException, step: int, dist_timeout: float, last_checkpoint: str | None):
        """The one-line error for a collective's `error` (lost_peer not None) at `step`."""
        resume = (f"the last checkpoint is {last_checkpoint}: resume with --load auto" if last_checkpoint else
                  "no checkpoint was saved in this run")
        what = (f"another rank did not answer within --dist_timeout {dist_timeout} min (it died, hangs, or is far "
                f"slower)" if lost_peer(error) == "timeout" else
                "the connection to another rank broke (its process or its node died)")
        return cls(f"step {step}: {what}; {resume}")


BROKEN_CONNECTION = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused")


def lost_peer(error: BaseException) -> str | None:
    """What a collective's error says about the peers: "timeout" (gloo: "Timed out waiting ..."), "broken"
    (gloo: "Connection reset by peer" when a peer's process is gone), else None. NCCL's watchdog aborts the
    process itself, with its own message."""
    text = str(error).lower() if isinstance(error, RuntimeError) else ""
    if "timed out" in text:
        return "timeout"
    return "broken" if any(words in text for words in BROKEN_CONNECTION) else None


def signal_when_the_parent_dies(sig: signal.Signals) -> None:
    """Linux: have the kernel send this process `sig` when its parent (torchrun's agent) dies; at once if it
    already has."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent or parent == 1:
        os.kill(os.getpid(), sig)


class StepGuard:
    """checking: test each step for a non-finite loss / gradient norm (reading the verdict waits for the step's
    backward pass: one host sync per step); handle_signals: save and stop on SIGTERM / SIGUSR1."""

    def __init__(self, max_bad_steps: int, handle_signals: bool):
        if max_bad_steps < 0:
            raise ValueError(f"--max_bad_steps {max_bad_steps}: must be >= 0 (0 turns the non-finite check off)")
        self.max_bad_steps, self.handle_signals = max_bad_steps, handle_signals
        self.checking = max_bad_steps > 0
        self.bad_in_a_row = self.bad_total = 0
        self.stop_signal: str | None = None  # the name of the signal that asked to stop, agreed by all ranks
        self._received: str | None = None  # the name of what this rank received
        self._previous: dict = {}

    # ---- signals -----------------------------------------------------------------------------------------------
    def __enter__(self):
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            if "TORCHELASTIC_RUN_ID" in os.environ:
                self._previous[LAUNCHER_GONE] = signal.signal(LAUNCHER_GONE, self._on_launcher_gone)
                signal_when_the_parent_dies(LAUNCHER_GONE)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self._received == name:  # asked twice: stop now
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        self._received = name
        logger.warning("received %s: saving a checkpoint after the current step, then exiting", name)

    def _on_launcher_gone(self, signum, frame) -> None:
        if self._received is None:
            self._received = "the end of torchrun's agent"
            logger.warning("torchrun's agent (this worker's parent) ended: saving a checkpoint after the current "
                           "step, then exiting")

    # ---- the per-step verdict ----------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether agree() has anything to do (else the step runs without a host sync or collective)."""
        return self.checking or self.handle_signals

    def agree(self, non_finite: torch.Tensor | None, step: int) -> bool:
        """Combine this rank's verdict (a bool device tensor, or None when not checked) and signal with every
        other rank's; returns whether the step must be skipped. Call at the same point on every rank."""
        local = torch.tensor([float(non_finite.item()) if non_finite is not None else 0.0,
                              float(self._received is not None)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            # a CPU tensor: over gloo (also in a NCCL job, whose group has a gloo backend for CPU tensors)
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        if local[1] > 0 and self.stop_signal is None:
            self.stop_signal = self._received if self._received is not None else "a signal on another rank"
        if local[0] == 0:
            self.bad_in_a_row = 0
            return False
        self.bad_in_a_row += 1
        self.bad_total += 1
        logger.warning("step %d: non-finite loss or gradient norm; step skipped, nothing updated (%d in a row, "
                       "%d in all; the run stops at %d in a row)", step, self.bad_in_a_row, self.bad_total,
                       self.max_bad_steps)
        return True

    def check_limit(self, step: int, last_checkpoint: str | None) -> None:
        if self.checking and self.bad_in_a_row >= self.max_bad_steps:
            where = (f"the last checkpoint is {last_checkpoint}" if last_checkpoint else
                     "no checkpoint was saved in this run")
            raise NonFiniteTrainingError(
                f"stopped at step {step}: {self.bad_in_a_row} steps in a row had a non-finite loss or gradient norm "
                f"(--max_bad_steps {self.max_bad_steps}); the weights are those of the last good step and {where}. "
                f"Resume from it with a lower --lr, a --grad_clip, or --mixed_precision bf16 instead of fp16, and "
                f"check the data")
