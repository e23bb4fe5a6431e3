"""Unreadable files: skip them, warn about a few, and count them across DataLoader workers and ranks.

A dataset that reads files (images, videos) fills the slot of an unreadable one with the next readable index
(`first_readable`), so every batch stays full. Each DataLoader worker holds its own copy of the dataset, so the
copies share a `SkipLog`: a temporary folder made when the dataset is built, in which the first process to find
file i unreadable creates the empty file "i". The folder's listing is the set of distinct unreadable files,
whichever worker, epoch or persistent / non-persistent worker met them; the creation (O_EXCL) also tells that
process it is the first, so each file is warned about once. A process logs its first WARN_FIRST files one by
one, then a summary line at 100, 1000, 10000... files, so 100k broken files do not flood the log. The folder
goes when the dataset is garbage-collected or the process exits; folders left by processes that ended with
os._exit (the entry scripts) or were killed are swept by the next dataset built, an hour later.

The trainer reads the total with `count_skipped(dataset)` (a collective under torch.distributed: the ranks
share their new indices, so a file met by two ranks in two epochs counts once).
"""
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections import Counter

import torch.distributed as dist

WARN_FIRST = 10  # files a process warns about one by one; after them, summaries at 100, 1000, ...
LIKELY_CAUSES = ("likely causes: files that are not really images / videos (a wrong extension, an HTML error "
                 "page saved by a downloader), files truncated by an interrupted download or copy, or files this "
                 "user may not read (permissions)")


FOLDER_PREFIX = "opendit-skipped-"  # + the builder's pid + "-" + a random suffix, in the temp folder
STALE_AFTER_S = 3600


def _remove(folder: str, owner: int) -> None:
    if os.getpid() == owner:  # a forked DataLoader worker inherits this finalizer: only the builder cleans up
        shutil.rmtree(folder, ignore_errors=True)


def _sweep_stale(parent: str) -> None:
    """Remove the folders of builders that ended without running finalizers (the entry scripts end with
    os._exit; a killed run): those whose pid is gone and that did not change for an hour."""
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(FOLDER_PREFIX) and e.is_dir()]
    except OSError:
        return
    for entry in entries:
        pid = entry.name[len(FOLDER_PREFIX):].split("-")[0]
        try:
            if not pid.isdigit() or time.time() - entry.stat().st_mtime < STALE_AFTER_S:
                continue
            os.kill(int(pid), 0)  # raises when no such process
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:  # alive under another user (PermissionError), or vanished meanwhile
            continue


class SkipLog:
    """The unreadable files of one dataset: `bad` (indices this process found unreadable), the shared folder of
    all processes' finds, per-error-type counts and capped warnings. Picklable (workers get copies that write to
    the same folder)."""

    def __init__(self, kind: str, logger: logging.Logger):
        self.kind, self.logger_name = kind, logger.name
        self.bad = set()
        self.reasons = Counter()  # error type name -> files of this process
        self.example = None  # (path, "Type: message") of the first unreadable file this process met
        self.warned = 0  # files this process was the first to find (and so reported)
        self._sent, self._union = set(), set()  # count_skipped's state in the main process (across ranks)
        try:
            _sweep_stale(tempfile.gettempdir())
            self.folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")
            weakref.finalize(self, _remove, self.folder, os.getpid())
        except OSError:  # no writable temp folder: count in this process only
            self.folder = None

    def add(self, index: int, path: str, err: BaseException) -> None:
        """Record that file `index` (at `path`) failed with `err`; warns unless another process already did."""
        self.bad.add(index)
        self.reasons[type(err).__name__] += 1
        if self.example is None:
            self.example = (path, f"{type(err).__name__}: {err}")
        if not self._mark(index):
            return  # another worker (or an earlier epoch's worker) found and reported it
        self.warned += 1
        logger = logging.getLogger(self.logger_name)
        if self.warned <= WARN_FIRST:
            logger.warning("skipping unreadable %s %s: %s: %s", self.kind, path, type(err).__name__, err)
            if self.warned == WARN_FIRST:
                logger.warning("further unreadable %ss are counted but not logged one by one (summaries at "
                               "100, 1000, ...; the trainer logs the total as skipped_images)", self.kind)
        elif _is_power_of_ten(self.warned):
            logger.warning("... %d unreadable %ss skipped so far by this process (latest %s: %s: %s)",
                           self.warned, self.kind, path, type(err).__name__, err)

    def _mark(self, index: int) -> bool:
        """True when this process is the first to record `index` (or when there is no shared folder)."""
        if self.folder is None:
            return True
        try:
            os.close(os.open(os.path.join(self.folder, str(index)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        except OSError:  # the folder vanished (a temp cleaner): keep counting in this process
            self.folder = None
        return True

    def indices(self) -> set:
        """Distinct unreadable files found so far by this process and every process sharing the folder."""
        found = set(self.bad)
        if self.folder is not None:
            try:
                found.update(int(name) for name in os.listdir(self.folder) if name.isdigit())
            except OSError:
                pass
        return found

    def all_unreadable(self, what: str, demo: str) -> str:
        """The error for a dataset whose every file is unreadable, e.g. what = "all 3 images under '/data'":
        names the data, the count, the error types with an example, the likely causes and the fix."""
        types = ", ".join(f"{count} {name}" for name, count in self.reasons.most_common())
        path, error = self.example or ("?", "?")
        return (f"{what} are unreadable ({types}; e.g. {path}: {error}); {LIKELY_CAUSES}. Fix or remove the "
                f"files, or use --dataset {demo} for the built-in demo")


def _is_power_of_ten(n: int) -> bool:
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1


def first_readable(dataset, index: int, read):
    """read(i) for the first i in index, index + 1, ... (cyclic; only items of index's aspect-ratio bucket when the
    dataset has buckets) that `dataset.skips` has not found unreadable
    and that reads without an exception; a failure is recorded (path from dataset.samples[i][0]) and skipped.
    Raises RuntimeError(dataset._all_unreadable(n)) when every one of the n files is unreadable."""
    skips, n = dataset.skips, len(dataset.samples)
    # with aspect-ratio buckets the replacement comes from the same bucket: the batch keeps one size
    buckets = getattr(dataset, "buckets", None)
    ring = buckets.members(index) if buckets is not None else None
    start = 0 if ring is None else int(ring.searchsorted(index))
    for offset in range(n if ring is None else len(ring)):
        i = (index + offset) % n if ring is None else int(ring[(start + offset) % len(ring)])
        if i in skips.bad:
            continue
        try:
            return read(i)
        # PIL, FFmpeg and the file system raise many types for one bad file (OSError, SyntaxError, ValueError,
        # zlib.error, DecompressionBombError, VideoReadError, PermissionError...): none may end the epoch
        except Exception as err:  # noqa: BLE001
            skips.add(i, dataset.samples[i][0], err)
    raise RuntimeError(dataset._all_unreadable(n))


def count_skipped(dataset, group=None) -> int:
    """Distinct unreadable files `dataset` skipped so far, in this process and all its DataLoader workers (of
    every epoch), and, when torch.distributed is initialized with more than one rank in `group`, on all those
    ranks: then it is a collective, to call on every rank at the same point (e.g. at each log line). 0 for
    datasets that read no files (digits, latent caches)."""
    parts = getattr(dataset, "parts", None)  # a mixture of datasets (opendit/data/mixture.py)
    if parts is not None:
        return sum(count_skipped(part, group) for part in parts)
    skips = getattr(dataset, "skips", None)
    if not isinstance(skips, SkipLog):
        return 0
    local = skips.indices()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return len(local)
    # only the indices not shared before travel: a few bytes per log line once the bad files are known
    new = sorted(local - skips._sent)
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, new, group=group)
    skips._sent.update(new)
    for part in gathered:
        skips._union.update(part)
    return len(skips._union | local)
