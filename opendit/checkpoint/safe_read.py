"""Reading a checkpoint without running code from it: torch.load(weights_only=True) for our own files, and for
torch's distributed checkpoint (DCP) a reader whose `.metadata` goes through an allow-list unpickler (torch's
own uses plain pickle.load) and a load planner whose non-tensor values must pass weights_only=True first. A
planted pickle is refused with a ValueError naming the file; its payload never runs. `dcp_load` is the one way
opendit reads DCP data (resume, load_weights, sample.py on a step folder); DCP's CheckpointException (a
BaseException carrying each rank's error) comes out as the plain error inside it."""
import argparse
import os
import pickle
import warnings
from contextlib import contextmanager

import torch
import torch.distributed.checkpoint as dcp

from opendit.checkpoint.manifest import CheckpointCorruptError


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` file admitting only the classes such a file holds (torch's own reader uses
    plain pickle.load, which runs whatever a planted file asks for)."""
    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
                ("builtins", "set"), ("builtins", "frozenset"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}

    def find_class(self, module, name):
        found = super().find_class(module, name) if module.startswith(("torch", "pathlib", "collections",
                                                                        "builtins")) else None
        if (module, name) in self._ALLOWED or isinstance(found, torch.dtype) or (
                module == "torch.distributed.checkpoint.metadata" and isinstance(found, type)):
            return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata read by _MetadataUnpickler."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = os.path.join(str(self.path), ".metadata")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as e:
            raise ValueError(f"{path}: refusing to unpickle it ({e}); a tampered or foreign file") from None
        except (EOFError, AttributeError, ImportError, IndexError, TypeError, ValueError) as e:
            raise _corrupt(f"{path} is truncated or corrupt ({type(e).__name__}: {e})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's load planner, but a non-tensor value must unpickle with weights_only=True before it is used."""

    def load_bytes(self, read_item, value):
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(f"checkpoint value {read_item.dest_index.fqn!r}: refusing to unpickle it "
                             f"({str(e).splitlines()[0]})") from None
        value.seek(0)
        super().load_bytes(read_item, value)


def _corrupt(what: str) -> ValueError:
    return CheckpointCorruptError(f"{what}; pass an earlier step folder (--load latest and --load auto skip "
                                  f"checkpoints that fail verification), or copy the file again")


@contextmanager
def quiet_single_process():
    """DCP warns on every save/load without a process group; single-process runs are intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield



def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def safe_load(path: str):
    """torch.load restricted to tensors and plain containers: a planted pickle is refused, never run."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path} holds objects other than tensors and plain values (a checkpoint from an older "
                         f"opendit, or a tampered file); refusing to unpickle it: {_first_line(e)}") from None
    except (RuntimeError, EOFError) as e:  # a truncated zip: "PytorchStreamReader failed reading zip archive"
        raise _corrupt(f"{path} is truncated or corrupt ({_first_line(e)})") from None


def dcp_load(state: dict, path: str, no_dist: bool) -> None:
    """dcp.load into `state` through SafeReader and SafeLoadPlanner (a collective unless no_dist). A refused
    value is the ValueError naming it; a tensor entry that is not a plain tensor (torch.load's weights_only
    check) is refused the same way; other failures name the checkpoint and say it may be corrupt."""
    from torch.distributed.checkpoint.api import CheckpointException

    reader = SafeReader(path)
    reader.read_metadata()  # a refused .metadata raises here, plainly, not wrapped by DCP's collective
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as e:
        rank, (inner, _) = next(iter(e.failures.items()))
        if isinstance(inner, ValueError):  # SafeLoadPlanner's refusal, or another clear error of ours
            raise inner from None
        if isinstance(inner, pickle.UnpicklingError):
            raise ValueError(f"checkpoint {path}: a .distcp tensor entry holds objects other than tensors "
                             f"(a tampered file); refusing to unpickle it: {_first_line(inner)}") from None
        raise _corrupt(f"checkpoint {path}: reading its data failed on rank {rank} ({type(inner).__name__}: "
                       f"{_first_line(inner)}); a .distcp file may be truncated or corrupt") from None


def load_torch_file(path: str, mmap: bool = False):
    """A .pt (an official DiT/Latte release) with torch.load(weights_only=True); argparse.Namespace allowed."""
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):  # DiT's train.py stores its args
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path} holds objects other than tensors and plain values; refusing to unpickle it "
                         f"({_first_line(e)})") from None
    except (RuntimeError, EOFError) as e:
        raise CheckpointCorruptError(f"{path} is not a readable torch file ({_first_line(e)}): truncated or "
                                     f"corrupt; copy or download it again") from None
