"""Entry-script command lines run as forks of one process that has imported what the scripts import, instead of a
new interpreter each (which spends seconds importing torch before it reads a flag).

    python tests/entry_forks.py ROWS.json   # ROWS.json: [[script, [args...], cwd, output_file], ...]

Each fork runs `python SCRIPT ARGS` as the interpreter would: the script as __main__ (runpy) with that argv, its
folder first on sys.path, in the row's working folder, stdout and stderr into output_file, exit status as Python
sets it (SystemExit's code; 1 and the traceback for an uncaught exception). Prints the exit statuses as JSON.
What only a new interpreter shows (output while importing) is compared against real processes in
test_user_errors.py."""
import json
import os
import runpy
import sys
import traceback


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # SystemExit("text"): the text on stderr, status 1
    return 1


def run_forked(script: str, args: list[str], cwd: str, output: str) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    status = 1
    try:
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(cwd)
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            status = 0
        except SystemExit as e:
            status = _exit_status(e.code)
        except BaseException:
            traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def main() -> None:
    import torch  # noqa: F401  (what every entry script imports first)

    import opendit.cli  # noqa: F401
    import opendit.config  # noqa: F401
    import opendit.inference  # noqa: F401
    import opendit.training.loop  # noqa: F401

    with open(sys.argv[1]) as f:
        rows = json.load(f)
    print(json.dumps([run_forked(*row) for row in rows]))


if __name__ == "__main__":
    main()
