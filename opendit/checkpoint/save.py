"""Saving a checkpoint: every rank writes its DCP shards and its rank file into root/.tmp-step-000100, rank 0
writes the manifest and renames the folder to root/step-000100 once every rank has finished, so a crash or a
full disk mid-save never leaves a step-* directory that does not load. A failed write is an OSError naming the
checkpoint folder (ENOSPC/EFBIG/EDQUOT: "disk full or file size limit"). After the rename, all but the newest
`keep_last` step directories are deleted.
"""
import errno
import io
import json
import os
import shutil
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from opendit.checkpoint.discovery import clean_tmp, list_checkpoints
from opendit.checkpoint.layout import app_state, check_args, rank_file, step_dir_name
from opendit.checkpoint.manifest import describe_files, write_bytes, write_manifest
from opendit.checkpoint.safe_read import quiet_single_process
from opendit.distributed import all_gather_objects, current_rank, in_process_group
from opendit.seeding import rng_state


class _CheckedStream:
    """A file DCP writes through: its OSError (a full disk: ENOSPC, EFBIG) is remembered, since torch.save's
    zip writer turns it into "RuntimeError: [enforce fail at inline_container.cc] unexpected pos"."""

    def __init__(self, stream, errors: list):
        self._stream, self._errors = stream, errors

    def write(self, data):
        try:
            return self._stream.write(data)
        except OSError as e:
            self._errors.append(e)
            raise

    def __getattr__(self, name):
        return getattr(self._stream, name)


class RecordingWriter(dcp.FileSystemWriter):
    """DCP's file writer, remembering the files this rank wrote (to checksum them) and its write errors."""

    def __init__(self, path: str):
        self.written, self.write_errors = set(), []
        super().__init__(path)
        open_stream = self.fs.create_stream

        @contextmanager
        def create_stream(path, mode):
            with open_stream(path, mode) as stream:
                yield _CheckedStream(stream, self.write_errors) if "w" in mode else stream
        self.fs.create_stream = create_stream

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)  # a torch.futures.Future of [WriteResult]

        def record(done):
            try:
                self.written.update(r.storage_data.relative_path for r in done.value())
            except Exception:  # a failed write: dcp.save raises it; nothing to checksum
                pass
        future.add_done_callback(record)
        return future

    def reset(self, checkpoint_id=None):
        super().reset(checkpoint_id)
        self.written = set()


def _failure(e: BaseException) -> BaseException:
    """The error inside DCP's CheckpointException (a BaseException holding each rank's), else e."""
    for inner, _ in getattr(e, "failures", {}).values():
        return inner
    return e


def save_error(final: str, rank: int, e: BaseException | str) -> Exception:
    """A failed save as an error naming the checkpoint folder; OSErrors say when the disk may be full."""
    e = _failure(e) if isinstance(e, BaseException) else e
    leftover = os.path.join(os.path.dirname(final), ".tmp-" + os.path.basename(final))
    if not isinstance(e, OSError):
        return e if isinstance(e, Exception) else RuntimeError(f"saving checkpoint {final} failed on rank {rank}: "
                                                               f"{e}")
    full = e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
    cause = ("disk full or file size limit: the disk may be full, or a file size limit (ulimit -f) or quota was "
             "reached" if full else "is the disk full, or the folder not writable?")
    where = f" ({e.filename})" if e.filename else ""
    return OSError(e.errno, f"saving checkpoint {final} failed on rank {rank}: {e.strerror or e}{where}: {cause}. "
                            f"Free space (or lower --keep_last) and resume from the previous checkpoint, which is "
                            f"intact; the partial {leftover} is ignored, and removed by the next save or a "
                            f"--load auto start")


def _prune(root: str, keep_last: int) -> None:
    """Keep the newest `keep_last` complete step dirs. Each is renamed to .tmp-del-* before rmtree, so a
    deletion cut short leaves an ignored .tmp-* dir, never a half-deleted step-* dir."""
    for _, path in list_checkpoints(root)[:-keep_last]:
        doomed = os.path.join(root, ".tmp-del-" + os.path.basename(path))
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _write_trainer_files(tmp: str, step: int, lr_scheduler, extra: dict | None, has_ema: bool) -> dict:
    """Rank 0: trainer.pt (scheduler, extra) and meta.json, written before the rename like the rest; their
    manifest entries."""
    trainer = {"step": step, "lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict(),
               "extra": extra or {}}
    world = dist.get_world_size() if in_process_group() else 1
    meta = {"step": step, "world_size": world, "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "has_ema": has_ema, "has_lr_scheduler": lr_scheduler is not None, "extra_keys": sorted(extra or {})}
    return {"trainer.pt": write_bytes(os.path.join(tmp, "trainer.pt"), _torch_bytes(trainer)),
            "meta.json": write_bytes(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1).encode())}


def write_dcp(tmp: str, state: dict, writer: "RecordingWriter") -> dict:
    """This rank's DCP shards of `state` into tmp; their manifest entries."""
    try:
        with quiet_single_process():
            dcp.save(state, checkpoint_id=tmp, storage_writer=writer, no_dist=not in_process_group())
    except (Exception, dcp.api.CheckpointException) as e:
        if writer.write_errors:
            raise writer.write_errors[0] from e
        raise
    return describe_files(tmp, writer.written)


def written_error(writer: "RecordingWriter", e: BaseException) -> BaseException:
    """The OSError under torch.save's RuntimeError when a write failed, else e."""
    return writer.write_errors[0] if writer.write_errors else e


def write_small_files(tmp, step, lr_scheduler, extra, has_ema: bool) -> dict:
    """This rank's rank file (rank 0: also trainer.pt, meta.json); their manifest entries."""
    own = os.path.relpath(rank_file(tmp, current_rank()), tmp)
    entries = {own: write_bytes(os.path.join(tmp, own), _torch_bytes({"rng": rng_state(), "extra": extra or {}}))}
    if current_rank() == 0:
        entries.update(_write_trainer_files(tmp, step, lr_scheduler, extra, has_ema))
    return entries


def begin_save(root: str, step: int) -> tuple[str, str, BaseException | None, bool]:
    """The first, collective part of a save: rank 0 makes root/.tmp-step-XXXXXX (removing leftovers) -> the final
    and the temporary path, this rank's failure, and whether every rank may write into tmp now."""
    final = os.path.join(root, step_dir_name(step))
    tmp = os.path.join(root, ".tmp-" + step_dir_name(step))
    failure = None
    if current_rank() == 0:
        try:
            os.makedirs(root, exist_ok=True)
            clean_tmp(root)
            os.makedirs(os.path.join(tmp, "ranks"))
        except OSError as e:
            failure = e
    return final, tmp, failure, all(all_gather_objects(failure is None))


def commit_save(root: str, step: int, final: str, tmp: str, entries: dict, failure: BaseException | None,
                keep_last: int | None, group=None) -> str:
    """The last, collective part of a save (group: the process group to agree on): every rank reports the files
    it wrote (entries) or its failure; rank 0 writes the manifest, renames tmp to final and prunes. A failure on
    any rank raises on every rank (an OSError naming the folder for write errors)."""
    reports = all_gather_objects(entries if failure is None else None, group)
    if current_rank() == 0 and None not in reports:  # rank 0: the manifest, the rename, pruning
        try:
            files = {name: entry for report in reports for name, entry in report.items()}
            found = [os.path.relpath(os.path.join(d, f), tmp) for d, _, fs in os.walk(tmp) for f in fs]
            files.update(describe_files(tmp, [f for f in found if f not in files]))  # every file
            write_manifest(tmp, files, step=step)
            if os.path.exists(final):  # re-saving a step: move the old one aside first (rename cannot overwrite)
                os.replace(final, os.path.join(root, ".tmp-old-" + step_dir_name(step)))
            os.replace(tmp, final)
            if keep_last is not None:
                _prune(root, keep_last)
            clean_tmp(root)
        except Exception as e:
            failure = e
    error = None if failure is None else save_error(final, current_rank(), failure)
    report = None if error is None else (isinstance(error, OSError), getattr(error, "errno", None), str(error))
    outcomes = all_gather_objects(report, group)  # also the barrier: on success the step dir exists now
    disk = next((r for r in outcomes if r is not None and r[0]), None)  # a write error: the clearest cause
    if error is not None and (isinstance(error, OSError) or disk is None):
        raise error from (None if error is failure else failure)
    if disk is not None:
        raise OSError(disk[1], disk[2])
    failed = next((r for r in outcomes if r is not None), None)
    if failed is not None:
        raise RuntimeError(f"saving checkpoint {final} failed: {failed[2]}")
    return final


def save_checkpoint(root: str, step: int, model, optimizer=None, ema=None, lr_scheduler=None,
                    extra: dict | None = None, keep_last: int | None = None, trainable_only: bool = False) -> str:
    """Save everything needed to resume at `step` into root/step-XXXXXX and return that path.

    A collective: call on every rank; `root` must be on a filesystem all ranks share. `extra` is a
    picklable dict saved per rank (data positions differ per rank): sampler state, resolved config, ...
    `keep_last`: keep only the newest K step dirs (None: keep all). `trainable_only`: the model's frozen
    parameters are not saved (a LoRA run: the adapters only; resume loads them with the same flag). Writes
    root/.tmp-step-XXXXXX, which rank 0 renames after every rank has written and manifest.json lists every
    file; re-saving an existing step replaces it. A failure on any rank raises on every rank (OSError naming
    the folder for write errors). opendit.checkpoint.async_save writes the same folder in the background.
    """
    check_save_args(keep_last, optimizer, ema, lr_scheduler)
    final, tmp, failure, writable = begin_save(root, step)
    entries = {}
    if writable:  # every rank writes its files into tmp, then reports them
        try:
            writer = RecordingWriter(tmp)
            entries = write_dcp(tmp, app_state(model, optimizer, ema, trainable_only), writer)
            entries.update(write_small_files(tmp, step, lr_scheduler, extra, ema is not None))
        except (Exception, dcp.api.CheckpointException) as e:
            failure = e
    return commit_save(root, step, final, tmp, entries, failure, keep_last)


def check_save_args(keep_last, optimizer, ema, lr_scheduler) -> None:
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    check_args(optimizer, ema, lr_scheduler)
