"""Weights as they are published, whatever the model: a .safetensors file, a sharded checkpoint (its
*.safetensors.index.json and the shards it lists), a folder holding either (or diffusers' legacy
diffusion_pytorch_model.bin), and the component folders of a diffusers pipeline. The one reader every family's
weight adapter (opendit.families.base.WeightAdapter) goes through; nothing here knows a model."""
import json
import os

import torch


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


def read_safetensors(path) -> dict[str, torch.Tensor]:
    """{key: tensor} on the CPU from a .safetensors file, a sharded checkpoint's .index.json (every shard it lists,
    checked against its weight_map), or a folder holding one of either (or a legacy diffusers .bin)."""
    from safetensors.torch import load_file

    path = os.fspath(path)
    if os.path.isdir(path):
        path = _weights_file(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path!r} does not exist; pass a .safetensors file, an index .json or their folder")
    if path.endswith(".bin"):
        return torch.load(path, map_location="cpu", weights_only=True)
    if not path.endswith(".json"):
        return load_file(path, device="cpu")
    with open(path) as f:
        weight_map = json.load(f)["weight_map"]
    state = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = os.path.join(os.path.dirname(path), shard)
        if not os.path.isfile(shard_path):
            raise FileNotFoundError(f"{path} lists the shard {shard}, which is missing; download it too")
        state.update(load_file(shard_path, device="cpu"))
    missing, unlisted = sorted(set(weight_map) - set(state)), sorted(set(state) - set(weight_map))
    if missing or unlisted:
        raise ValueError(f"the shards of {path} hold other keys than its weight_map: missing {missing[:5]}, "
                         f"unlisted {unlisted[:5]}; download the release again")
    return state
