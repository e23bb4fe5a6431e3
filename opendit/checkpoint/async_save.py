"""--async_ckpt: a checkpoint written while training goes on. The step waits only while the state is copied to
host memory (DCP's staging); a background thread then writes the DCP shards and commits the step folder exactly
as save.py does (.tmp-step-XXXXXX, the manifest, the rename, pruning), so a crash or a kill during the write
leaves the previous checkpoint as the newest complete one. At most one save is in flight: the next save, and
the end of the run, wait for it first. The background thread agrees with the other ranks over its own gloo
process group, so its collectives never interleave with the training step's.
"""
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from opendit.checkpoint.layout import app_state
from opendit.checkpoint.manifest import describe_files, write_bytes
from opendit.checkpoint.safe_read import quiet_single_process
from opendit.checkpoint.save import (RecordingWriter, begin_save, check_save_args, commit_save, write_small_files,
                                     written_error)
from opendit.distributed import current_rank, in_process_group

logger = logging.getLogger("opendit")


class AsyncCheckpointer:
    """Saves in the background, one at a time. Make it on every rank at once (it makes a process group)."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo") if in_process_group() else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="opendit-checkpoint")
        self._pending: Future | None = None

    def save(self, root: str, step: int, model, optimizer=None, ema=None, lr_scheduler=None,
             extra: dict | None = None, keep_last: int | None = None, trainable_only: bool = False,
             rank0_files: dict[str, bytes] | None = None, after_commit: Callable[[str], None] | None = None) -> float:
        """save_checkpoint's arguments; rank0_files: more files rank 0 writes into the folder before its commit;
        after_commit(path): run in the background once the folder is committed. A collective. Returns the
        seconds this call blocked (waiting for the previous save, then the copy to host memory)."""
        start = time.perf_counter()
        check_save_args(keep_last, optimizer, ema, lr_scheduler)
        self.wait()
        final, tmp, failure, writable = begin_save(root, step)
        entries, writer, upload = {}, RecordingWriter(tmp), None
        if writable:
            try:
                entries = write_small_files(tmp, step, lr_scheduler, extra, ema is not None)
                if current_rank() == 0:
                    entries.update({name: write_bytes(os.path.join(tmp, name), data) for name, data in
                                    (rank0_files or {}).items()})
                with quiet_single_process():  # stages a copy in host memory, then writes in DCP's thread
                    upload = dcp.async_save(app_state(model, optimizer, ema, trainable_only), checkpoint_id=tmp,
                                            storage_writer=writer, process_group=self.group,
                                            no_dist=not in_process_group())
                upload = getattr(upload, "upload_completion", upload)  # an AsyncSaveResponse on some versions
            except (Exception, dcp.api.CheckpointException) as e:
                failure = written_error(writer, e)
        self._pending = self._pool.submit(self._finish, root, step, final, tmp, entries, failure, keep_last,
                                          writer, upload, after_commit)
        return time.perf_counter() - start

    def _finish(self, root, step, final, tmp, entries, failure, keep_last, writer, upload, after_commit) -> str:
        if upload is not None and failure is None:
            try:
                upload.result()
                entries.update(describe_files(tmp, writer.written))
            except (Exception, dcp.api.CheckpointException) as e:
                failure = written_error(writer, e)
        path = commit_save(root, step, final, tmp, entries, failure, keep_last, group=self.group)
        if after_commit is not None:
            after_commit(path)
        return path

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def committed(self) -> str | None:
        """The folder of a save that finished without an error since the last call, without waiting (None: none).
        A failed save is left for wait(), which every rank calls at the same step."""
        pending = self._pending
        if pending is None or not pending.done() or pending.exception() is not None:
            return None
        self._pending = None
        return pending.result()

    def wait(self) -> str | None:
        """Wait for the save in flight -> its folder (None: none was in flight). Raises the save's error."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        return pending.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
