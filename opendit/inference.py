"""Sampling from a trained model: find the checkpoint, the settings it was trained with and its model family,
load the model, and generate by fixed global indices so that N processes produce exactly the samples one
process would. Everything model-specific (noise shape, conditioning, sampler, outputs) is the family's."""
import json
import logging
from pathlib import Path

import torch

from opendit import config as cfglib
from opendit.booster.parallelize import apply_compile
from opendit.booster.precision import cast_forward_io, compute_dtype
from opendit.checkpoint import (CheckpointCorruptError, checkpoint_kind, latest_run_checkpoint, load_into_meta_model,
                                load_weights)
from opendit.safe_load import safe_load
from opendit.families import FAMILIES, LoadedModel, check_model_contract, family_of
from opendit.kernels import configure_kernels

logger = logging.getLogger("opendit")

# sample.py flags that override what the checkpoint was trained with
OVERRIDES = ("model", "image_size", "num_classes", "vae", "clip", "t5", "learn_sigma")


_NO_SETTINGS = "or delete it and pass --model, --image_size and --num_classes"


def _train_config(path: Path) -> dict:
    """A step folder's config.yaml (train.py writes it) as a dict; a clear error when it does not parse."""
    import yaml

    try:
        return cfglib.to_dict(cfglib.load_yaml(cfglib.TrainConfig, path))
    except (yaml.YAMLError, UnicodeDecodeError, ValueError, TypeError) as e:
        raise CheckpointCorruptError(
            f"{path} is not a readable training config ({type(e).__name__}: {' '.join(str(e).split())[:300]}); "
            f"copy it from the run folder (its config.yaml), {_NO_SETTINGS}") from None


def _sidecar_config(path: Path) -> dict:
    """The "config" of an export's .json sidecar (written by export_weights); a clear error when unreadable."""
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(meta, dict) or not isinstance(meta.get("config", {}), dict):
            raise ValueError("not an object with a 'config' object")
        return meta.get("config", {})
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{path} (the settings written beside an EMA export) is corrupt "
                                     f"({type(e).__name__}: {e}); export again, {_NO_SETTINGS}") from None


def _opendit_weights(path: Path) -> tuple[Path, dict]:
    """(weights to load, the training config found beside or inside `path`, {} if none)."""
    if path.is_dir():
        # the EMA export written beside the DCP shards; without it (a crash between the two) read the shards
        export = path / "ema.safetensors"
        weights = export if export.is_file() else path
        for name, read in (("config.yaml", _train_config), ("ema.json", _sidecar_config)):
            if (path / name).is_file():
                return weights, read(path / name)
        extra = safe_load(path / "trainer.pt")["extra"] if (path / "trainer.pt").is_file() else {}
        return weights, extra.get("config", {})  # the config train.py also keeps in the checkpoint
    sidecar = path.with_suffix(".json")  # written by export_weights beside an export
    return path, (_sidecar_config(sidecar) if sidecar.is_file() else {})


def _recognize(path: Path, model: str | None) -> tuple[dict, dict | None]:
    """A checkpoint without an opendit config: the first family (the named model's first) that knows it."""
    from safetensors import SafetensorError

    families = list(FAMILIES.values())
    if model is not None:
        families.insert(0, family_of(model))
    for family in families:
        try:
            found = family.recognize_checkpoint(str(path))
        except SafetensorError as e:
            raise CheckpointCorruptError(f"{path} is not a readable safetensors file ({e}): truncated or "
                                         f"corrupt; export or download it again") from None
        if found is not None:
            return found
    return {}, None


def load_model(cfg: cfglib.SampleConfig, device) -> LoadedModel:
    """The checkpoint of `cfg.ckpt` ("latest": newest under cfg.outputs) with its family, encoders and the
    run's settings (flags win over the checkpoint's training config, which wins over a family's defaults)."""
    path = Path(latest_run_checkpoint(cfg.outputs) if cfg.ckpt == "latest" else cfg.ckpt)
    checkpoint_kind(str(path))  # a missing path, an empty or foreign file, a folder that holds no checkpoint
    flags = {k: getattr(cfg, k) for k in OVERRIDES if getattr(cfg, k) is not None}
    weights, trained = _opendit_weights(path)
    state = None
    if not trained:
        trained, state = _recognize(path, flags.get("model"))
    name = flags.get("model") or trained.get("model")
    if name is None:
        raise ValueError(f"cannot tell the model of {path}: no training config beside it and no model family "
                         f"recognises its weights; pass --model (and --image_size, --num_classes)")
    family = family_of(name)
    run = family.sampling_config(trained, flags)
    encoders = family.load_encoders(run, device, training=False)
    shape = family.latent_shape(run, encoders, data_channels=cfg.in_channels)
    with torch.device("meta"):  # the weights come from the file: no random init (minutes for 12B parameters)
        model = family.build_model(run, shape)
    check_model_contract(model, name)
    load_into_meta_model(model, state if state is not None else load_weights(str(weights)), f"--ckpt {path}",
                         keep_dtype=cfg.mixed_precision == "bf16")
    configure_kernels(model, cfg.enable_modulate_kernel, cfg.enable_layernorm_kernel, cfg.enable_flashattn, device)
    model = speed_up(model.to(device).eval(), cfg.mixed_precision, cfg.compile)
    logger.info("loaded %s (%s, family %s, input %s, vae %s)", weights, name, family.name,
                "x".join(map(str, shape)), run.vae)
    return LoadedModel(family, model, encoders, run, shape, str(weights))


def speed_up(model, mixed_precision: str = "fp32", compile: bool = False):
    """bf16 / fp16: the model's weights and compute in that dtype (inputs cast to it, outputs back to fp32, so
    the sampler's math stays fp32); compile: torch.compile each block, as training's --compile does."""
    dtype = compute_dtype(mixed_precision)
    if dtype != torch.float32:
        model.to(dtype)
        cast_forward_io(model, dtype)
    if compile:
        apply_compile(model)
    return model


def global_batches(num_samples: int, batch_size: int, rank: int, world_size: int) -> list[range]:
    """Batches of global sample indices; batch k belongs to rank k % world_size (fixed, whatever the world)."""
    batches = [range(s, min(s + batch_size, num_samples)) for s in range(0, num_samples, batch_size)]
    return batches[rank::world_size]
