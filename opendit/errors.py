"""Which side of a run an error is on. Until the entry script calls `setup_finished()` (before its first training
or sampling step) an error is the user's to fix: a bad flag, file or combination, which the entry scripts print as
one line (opendit/cli.py). After it, an exception is a fault of the run and keeps its traceback, except a
RunStopped, whose message already says what happened. The library raises and marks; only the CLI prints."""

_setup_over = False


class RunStopped(RuntimeError):
    """A run that stopped on a fault it diagnosed itself (too many non-finite steps, a peer that stopped
    answering): its message says what happened and where to resume, so it is printed as the one error line,
    exit status 1, without a traceback (OPENDIT_TRACEBACK=1 shows it)."""


def setup_finished() -> None:
    """From now on errors are faults of the run and keep their traceback."""
    global _setup_over
    _setup_over = True


def setup_is_over() -> bool:
    return _setup_over
