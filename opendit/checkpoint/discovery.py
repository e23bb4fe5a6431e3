"""Finding checkpoints: run folders (outputs/NNN-model), their complete step directories, the newest one that
verifies (`latest`, `--load auto`), and leftovers of interrupted saves.

`.tmp-*` directories (an interrupted save or deletion) are never taken for checkpoints; find_resume_checkpoint
(a training start with --load auto) and the next save remove them. `latest` and find_resume_checkpoint skip a
checkpoint that fails verification, with a warning naming it and why, and take the previous one.
"""
import logging
import os
import re
import shutil
from pathlib import Path

from opendit.checkpoint.layout import REQUIRED, STEP_DIR, missing, read_meta
from opendit.checkpoint.manifest import CheckpointCorruptError, problems

log = logging.getLogger(__name__)
RUN_DIR = re.compile(r"^(\d+)-")  # outputs/NNN-<model>


def new_run_dir(outputs: str, model_name: str) -> Path:
    """outputs/NNN-<model>: the next free number, created now (call on rank 0 only)."""
    root = Path(outputs)
    root.mkdir(parents=True, exist_ok=True)
    numbers = [int(m.group(1)) for p in root.iterdir() if (m := RUN_DIR.match(p.name))]
    run = root / f"{max(numbers, default=-1) + 1:03d}-{model_name.replace('/', '-')}"
    run.mkdir()
    return run


def run_folders(outputs: str) -> list[Path]:
    """train.py's run folders outputs/NNN-model, newest (highest number) first."""
    runs = [(int(m.group(1)), p) for p in Path(outputs).glob("*") if p.is_dir() and (m := RUN_DIR.match(p.name))]
    return [p for _, p in sorted(runs, key=lambda r: r[0], reverse=True)]


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete step directories under root as [(step, path)], oldest first; `.tmp-*` dirs are skipped."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match and os.path.isdir(path) and not missing(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def checkpoint_problem(path: str, checksums: bool = True) -> str | None:
    """Why a step directory would not load (missing files, a file that fails its manifest, an unreadable
    meta.json), or None when it verifies."""
    absent = missing(path)
    if absent:
        return f"missing {absent}"
    try:
        found = problems(path, checksums=checksums)
        read_meta(path)
    except (CheckpointCorruptError, OSError) as e:
        return str(e)
    return "; ".join(found) or None


def newest_verifying(root: str, checksums: bool) -> tuple[str | None, list[str]]:
    """(newest step directory under root that verifies, ["path: why" for each newer one skipped])."""
    skipped = []
    for _, path in reversed(list_checkpoints(root)):
        why = checkpoint_problem(path, checksums)
        if why is None:
            return path, skipped
        log.warning("skipping checkpoint %s: %s; falling back to the previous one", path, why)
        skipped.append(f"{path}: {why}")
    return None, skipped


def search_runs(outputs: str, checksums: bool) -> tuple[str | None, list[str]]:
    skipped = []
    for run in run_folders(outputs):
        path, why = newest_verifying(str(run / "checkpoints"), checksums)
        skipped += why
        if path is not None:
            return path, skipped
    return None, skipped


def latest_run_checkpoint(outputs: str, checksums: bool = True) -> str:
    """The newest complete, verifying checkpoint of the newest run folder (outputs/NNN-model/checkpoints) that
    has one. A newer checkpoint that fails verification is skipped with a warning naming it and why; none
    left: FileNotFoundError (no checkpoint at all) or CheckpointCorruptError (listing the failures).
    Leftovers of interrupted saves (.tmp-*) are ignored, not removed (a training run may be saving now)."""
    path, skipped = search_runs(outputs, checksums)
    if path is not None:
        return path
    if skipped:
        raise CheckpointCorruptError(f"latest: no checkpoint under {outputs} verifies: {'; '.join(skipped)}")
    runs = [p.name for p in run_folders(outputs)]
    raise FileNotFoundError(f"latest: no complete checkpoint under {outputs}/NNN-*/checkpoints (run folders: "
                            f"{runs}); train first, or pass a checkpoint folder")


def find_resume_checkpoint(outputs: str, checksums: bool = True, clean: bool = True) -> str | None:
    """For train.py --load auto (call on rank 0): the checkpoint `latest` would resume from (newest verifying
    one of the newest run folder that has one, skipping failing ones with a warning), or None when `outputs`
    holds no complete checkpoint at all (a first start: train from scratch, no error). If checkpoints exist
    but none verifies it raises CheckpointCorruptError rather than silently starting over. clean: remove the
    chosen run's `.tmp-*` leftovers of an interrupted save (the next save would)."""
    path, skipped = search_runs(outputs, checksums)
    if path is None:
        if skipped:
            raise CheckpointCorruptError(f"--load auto: checkpoints exist under {outputs} but none verifies "
                                         f"({'; '.join(skipped)}); pass one explicitly or move them away")
        return None
    if clean:
        clean_tmp(os.path.dirname(path))
    return path


def resolve_checkpoint(path_or_latest: str | None, root: str | None = None, checksums: bool = True) -> str:
    """'latest' (or None) -> the newest complete step directory under root that verifies (a newer one that
    fails is skipped with a warning naming it and why); a path -> that directory, checked to be complete (a
    load verifies it). Raises FileNotFoundError naming the path and what is missing."""
    if path_or_latest in (None, "latest"):
        if root is None:
            raise ValueError("resolve_checkpoint('latest') needs root= (the run's checkpoint folder)")
        path, skipped = newest_verifying(root, checksums)
        if path is not None:
            return path
        if skipped:
            raise CheckpointCorruptError(f"no checkpoint under {root!r} verifies: {'; '.join(skipped)}")
        listing = sorted(os.listdir(root)) if os.path.isdir(root) else "folder does not exist"
        raise FileNotFoundError(f"no complete checkpoint (step-* with {', '.join(REQUIRED)}) under "
                                f"{root!r}; it holds: {listing}. Start without resume or pass a checkpoint path")
    path = str(path_or_latest)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path!r} is not a directory; pass a step-* directory or 'latest'")
    absent = missing(path)
    if absent:
        raise FileNotFoundError(f"checkpoint {path!r} is incomplete: missing {absent} (a save interrupted "
                                "before its rename?); pass another step directory or 'latest'")
    return path


def clean_tmp(root: str) -> None:
    """Remove `.tmp-*` leftovers of interrupted saves or deletions (rank 0 only)."""
    for name in os.listdir(root):
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
