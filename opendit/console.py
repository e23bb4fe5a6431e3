"""The console of a run: one log format for every rank (INFO on rank 0, warnings elsewhere) and the one live
status line that log records clear before they print (opendit/training/run_log.py draws it)."""
import logging
import sys


class Status:
    """The one live status line on stderr (rank 0, a terminal only): log records clear it before printing."""
    shown = False

    @classmethod
    def clear(cls, stream) -> None:
        if cls.shown:
            stream.write("\r\x1b[K")
            cls.shown = False

    @classmethod
    def show(cls, text: str, stream) -> None:
        stream.write("\r\x1b[K" + text)
        stream.flush()
        cls.shown = True


class _StatusAwareHandler(logging.StreamHandler):
    def emit(self, record):
        Status.clear(self.stream)
        super().emit(record)


def setup_logging(rank: int) -> None:
    """INFO on rank 0, warnings only elsewhere, one format for all."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s rank{rank}] %(message)s", datefmt="%H:%M:%S", force=True,
                        handlers=[_StatusAwareHandler(sys.stderr)])
