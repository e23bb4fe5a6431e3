"""How the entry scripts (train.py, sample.py, preprocess.py) end on a user error: one line, exit status 2.

A bad flag value, a missing or unreadable file, an impossible combination: found while a run is SET UP, it is
the user's to fix. Rank 0 prints `error: <message>` (the message names the flag or file and the fix), every
rank leaves the process group and exits with status 2, and no traceback is shown; OPENDIT_TRACEBACK=1 shows it
instead. argparse's errors (an unknown flag, a value of the wrong type or not among the choices) become one
such line too. Once set-up is over (`opendit.errors.setup_finished()`, called before the first training or sampling
step) an exception is a fault of the run, not of its flags: it keeps its traceback, except a RunStopped (too many
non-finite steps, a dead peer), whose message already says what happened: one line, exit status 1.

Under torchrun, which ends every rank once one exits, rank 0 marks in the job's store that it printed, and the
other ranks wait for that mark (at most 30 s, else they print their own line with their rank) before they exit
quietly; a rank whose collective broke because rank 0 stopped on a user error exits quietly too.

Imports nothing heavy: torch.distributed is only touched when something else already imported it.
"""
import argparse
import dataclasses
import os
import sys

from opendit import config as cfglib
from opendit.config_files import config_values
from opendit.errors import RunStopped, setup_is_over

USER_ERRORS = (ValueError, KeyError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
               PermissionError)
TRACEBACK_ENV = "OPENDIT_TRACEBACK"


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"  # torchrun sets RANK before any process group exists


def message(exc: BaseException) -> str:
    """The exception's message on one line (KeyError without its quotes; an OSError as 'reason: file')."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        text = f"{exc.strerror}: {exc.filename}"
    elif isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        text = exc.args[0]
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def say(kind: str, text: str) -> None:
    """`<kind>: <text>` on stderr, once per job (rank 0)."""
    if _is_rank0():
        print(f"{kind}: {text}", file=sys.stderr, flush=True)


def fail(text: str, code: int = 2, hint: bool = True):
    """Print the one error line (rank 0), leave the process group, exit with `code`."""
    line = text + (f"  [{TRACEBACK_ENV}=1 shows the traceback]" if hint else "")
    dist = sys.modules.get("torch.distributed")
    joined = dist is not None and dist.is_available() and dist.is_initialized()
    if _is_rank0():
        say("error", line)
        if joined and dist.get_world_size() > 1:
            _tell_peers()
    else:
        _wait_for_rank0(dist if joined else None, line)
    if joined:
        dist.destroy_process_group()  # local; no collective, so a peer that is still setting up cannot block it
        import logging
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # see opendit.distributed.exit_process: finalization after gloo may abort
    sys.exit(code)


_PRINTED = "opendit/cli/error_printed"


def _tell_peers() -> None:
    try:
        _lasting_store().set(_PRINTED, "1")
    except Exception:  # noqa: BLE001 - a peer then prints its own line after its wait
        pass


def _wait_for_rank0(dist, line: str) -> None:
    """torchrun ends every rank as soon as one exits: a rank other than 0 waits until rank 0 has printed its
    line. If rank 0 does not fail (an error only this rank sees), this rank prints its own, with its number."""
    import time

    if dist is None:  # no process group yet: flag errors, the same on every rank and found at once
        time.sleep(2)
        return
    try:
        from datetime import timedelta
        _lasting_store().wait([_PRINTED], timedelta(seconds=30))
    except Exception:  # noqa: BLE001 - timed out, or the store is gone with rank 0
        print(f"error: [rank {os.environ.get('RANK')}] {line}", file=sys.stderr, flush=True)


def parse_config(cls, description: str | None, argv=None):
    """The config of an entry script from its command line and the `--config` file it names, if any (its values
    become the defaults, so flags override them); argparse's and the file's errors as one line, exit status 2."""
    parser = cfglib.build_parser(cls, description)
    parser.add_argument("--config", metavar="FILE", help="a .toml or .yaml file of options (a run's config.yaml "
                        "too); flags given beside it override it (docs/training.md)")
    parser.error = lambda text: fail(f"{text} (see {parser.prog} --help)", hint=False)
    first = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name in ("--config", "--model", "--family"):
        first.add_argument(name)
    first.error = parser.error
    known = first.parse_known_args(argv)[0]
    run = cfglib.run_family(cls, vars(known))
    if run is not None:  # --help with --model (--family) shows that family's options only
        hidden = cfglib.foreign_names(run[0], run[2])
        for action in parser._actions:
            if action.dest in hidden:
                action.help = argparse.SUPPRESS
    path, from_file = known.config, {}
    if path is not None:
        try:
            from_file = config_values(cls, path)
            parser.set_defaults(**from_file)
        except (ValueError, OSError) as e:  # a bad file, or none (a folder, no permission)
            fail(message(e), hint=False)
    cfg = cfglib.from_args(cls, parser.parse_args(argv))
    defaults = {f.name: cfglib.default_of(f) for f in dataclasses.fields(cls)}
    given = _given_flags(cls, argv) | {k for k, v in from_file.items() if v != defaults.get(k)}
    foreign = cfglib.foreign_options(cfg, given)
    if foreign:
        fail(foreign, hint=False)
    return cfg


def _given_flags(cls, argv) -> set[str]:
    """The options named on the command line (whatever their value)."""
    parser = cfglib.build_parser(cls, None)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_known_args(argv)[0]))


def run_entry(main_fn, cfg, check=None):
    """check(cfg) (-> warnings, printed once), then main_fn(cfg); user errors of set-up end the process as the
    module docstring says. Returns main_fn's result."""
    try:
        for warning in (check(cfg) if check else None) or ():
            say("warning", warning)
        return main_fn(cfg)
    except SystemExit as e:  # raise SystemExit("script: message") is a deliberate user error too
        if not isinstance(e.code, str):
            raise
        script, sep, text = e.code.partition(": ")
        fail(text if sep and script.endswith(".py") else e.code, hint=False)
    except RunStopped as e:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        fail(message(e), code=1)
    except USER_ERRORS as e:
        if setup_is_over() or os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        if isinstance(e, KeyError) and " " not in message(e):  # KeyError('name'): a lookup bug, not a message
            raise
        fail(message(e))
    except Exception:
        if setup_is_over() or _is_rank0() or not _rank0_failed():
            raise
        # rank 0 stopped on a user error it alone saw (and printed) while this rank waited for it in a collective
        fail("rank 0 failed", hint=False)


def _lasting_store():
    from opendit.distributed import lasting_store  # torch is loaded by then: a process group exists
    return lasting_store()


def _rank0_failed() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return dist.is_initialized() and _lasting_store().check([_PRINTED])
    except Exception:  # noqa: BLE001
        return False
