"""Reading a checkpoint without running code from it: torch.load(weights_only=True) for our own files, and for
torch's distributed checkpoint (DCP) a reader whose `.metadata` goes through an allow-list unpickler (torch's
own uses plain pickle.load) and a load planner whose non-tensor values must pass weights_only=True first. A
planted pickle is refused with a ValueError naming the file; its payload never runs."""
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` file admitting only the classes such a file holds (torch's own reader uses
    plain pickle.load, which runs whatever a planted file asks for)."""
    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
                ("builtins", "set"), ("builtins", "frozenset"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}

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


def safe_load(path: str):
    """torch.load restricted to tensors and plain containers: a planted pickle is refused, never run."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path} holds objects other than tensors and plain values (a checkpoint from an older "
                         f"opendit, or a tampered file); refusing to unpickle it: {str(e).splitlines()[0]}") from None
