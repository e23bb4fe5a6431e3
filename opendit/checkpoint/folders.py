"""Weights as they are published, whatever the model: a .safetensors file, a sharded checkpoint (its
*.safetensors.index.json and the shards it lists), a folder holding either (or diffusers' legacy
diffusion_pytorch_model.bin), and the component folders of a diffusers pipeline. The one reader every family's
weight adapter (opendit.families.base.WeightAdapter) goes through, and the one .safetensors writer; nothing here
knows a model.

Host memory: reading copies each tensor into its own buffer (safetensors' pread backend) rather than mapping the
file, so a caller that converts or replaces tensors frees each source as it goes (a mapped file's pages count
towards the process's memory until every tensor of it is gone); writing streams tensor by tensor, so an export
never holds a second copy of the weights."""
import json
import math
import os
from collections.abc import Iterable

import torch

# torch dtype -> the safetensors header's name for it
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2"}


def read_config(folder) -> dict:
    with open(os.path.join(os.fspath(folder), "config.json")) as f:
        return json.load(f)


def model_folder(path, component: str = "transformer") -> str | None:
    """The folder holding a model's config.json: `path` itself, or a pipeline folder's `component` subfolder;
    None when neither has one."""
    path = os.fspath(path)
    return next((f for f in (path, os.path.join(path, component)) if os.path.isfile(os.path.join(f, "config.json"))),
                None)


def _weights_file(folder: str) -> str:
    names = sorted(os.listdir(folder))
    found = [n for n in names if n.endswith(".safetensors.index.json")] or \
        [n for n in names if n.endswith(".safetensors")] or [n for n in names if n == "diffusion_pytorch_model.bin"]
    if len(found) != 1:
        what = "no weights" if not found else f"{len(found)} candidate weight files {found[:4]}"
        raise FileNotFoundError(f"{folder!r} holds {what}: expected one diffusion_pytorch_model.safetensors, one "
                                f"*.safetensors.index.json with its shards, or a legacy diffusion_pytorch_model.bin; "
                                f"it holds {names[:10]}; pass the file itself")
    return os.path.join(folder, found[0])


def read_safetensors_file(path: str) -> dict[str, torch.Tensor]:
    """{key: tensor} of one .safetensors file, each tensor in its own host buffer (not a view of the mapped file)."""
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu", backend="pread")
    except TypeError:  # safetensors before 0.8 has no backend= (it maps the file: converting then holds it too)
        return load_file(path, device="cpu")


def read_safetensors(path) -> dict[str, torch.Tensor]:
    """{key: tensor} on the CPU from a .safetensors file, a sharded checkpoint's .index.json (every shard it lists,
    checked against its weight_map), or a folder holding one of either (or a legacy diffusers .bin)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = _weights_file(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path!r} does not exist; pass a .safetensors file, an index .json or their folder")
    if path.endswith(".bin"):
        return torch.load(path, map_location="cpu", weights_only=True)
    if not path.endswith(".json"):
        return read_safetensors_file(path)
    with open(path) as f:
        weight_map = json.load(f)["weight_map"]
    state = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = os.path.join(os.path.dirname(path), shard)
        if not os.path.isfile(shard_path):
            raise FileNotFoundError(f"{path} lists the shard {shard}, which is missing; download it too")
        state.update(read_safetensors_file(shard_path))
    missing, unlisted = sorted(set(weight_map) - set(state)), sorted(set(state) - set(weight_map))
    if missing or unlisted:
        raise ValueError(f"the shards of {path} hold other keys than its weight_map: missing {missing[:5]}, "
                         f"unlisted {unlisted[:5]}; download the release again")
    return state


def write_safetensors(path, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]], tensors: Iterable[torch.Tensor],
                      metadata: dict[str, str] | None = None) -> None:
    """A .safetensors file of the tensors `layout` names ({key: (dtype, shape)}, stored in its order), streamed: the
    header from `layout`, then each tensor of `tensors` (the same order, on any device) as it comes. No more than
    the tensor being written is held here (safetensors' save_file takes every tensor at once), so `tensors` may
    make each one when asked (a gather, zeros). The file is read back by any safetensors reader."""
    header, offset = {"__metadata__": dict(metadata)} if metadata else {}, 0
    for key, (dtype, shape) in layout.items():
        if dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"{key} is {dtype}, which safetensors does not store; convert it to one of "
                            f"{sorted(str(d) for d in SAFETENSORS_DTYPES)}")
        size = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    written = 0
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for (key, (dtype, shape)), t in zip(layout.items(), tensors):
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{key}: the layout says {dtype} {list(shape)}, the tensor is {t.dtype} "
                                 f"{list(t.shape)}; build the layout from the tensors written")
            f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
            written += 1
            del t  # a tensor made for the write is freed before the next is made
    if written != len(layout):
        raise ValueError(f"{path}: the layout names {len(layout)} tensors, {written} came; pass one tensor per key")
