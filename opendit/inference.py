"""Sampling from a trained model: find the checkpoint, the settings it was trained with and its model family,
load the model, and generate by fixed global indices so that N processes produce exactly the samples one
process would. Everything model-specific (noise shape, conditioning, sampler, outputs) is the family's; so are
checkpoints that are not opendit's own (an official release, a diffusers folder), which a family recognises.
"""
import dataclasses
import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError

from opendit import config as cfglib
from opendit.booster.parallelize import apply_compile
from opendit.booster.precision import cast_forward_io, compute_dtype
from opendit.checkpoint import CheckpointCorruptError, checkpoint_kind, latest_run_checkpoint, load_into_meta_model
from opendit.checkpoint.layout import is_step_dir
from opendit.checkpoint.safe_read import safe_load
from opendit.checkpoint.weights import ACCEPTED
from opendit.families import FAMILIES, LoadedModel, check_model_contract, family_of
from opendit.kernels import configure_kernels
from opendit.lora.run import apply_lora_files, parse_lora_spec

logger = logging.getLogger("opendit")

_NO_SETTINGS = "or delete it and pass --model, --image_size and --num_classes"


def checkpoint_overrides(cfg) -> dict:
    """sample.py's flags that replace what the checkpoint was trained with (fields marked from_checkpoint)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.metadata.get("from_checkpoint") and getattr(cfg, f.name) is not None}


def accepted_checkpoints() -> str:
    """What --ckpt takes, in words: opendit's own checkpoints and every family's foreign formats."""
    return ", ".join([ACCEPTED, *(f for family in FAMILIES.values() for f in family.checkpoint_formats)])


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


def _recognize(path: Path, model: str | None) -> tuple[dict, dict | None] | None:
    """A checkpoint without an opendit config: (settings, state or None) from the first family (the named
    model's first) that knows it, or None."""
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
    return None


def read_checkpoint(path: Path, model: str | None) -> tuple[str, dict, dict | None]:
    """(where the weights are, the training settings, the state dict when reading the settings loaded it)."""
    if path.is_dir() and not is_step_dir(str(path)):  # a folder a family may know (e.g. a diffusers folder)
        found = _recognize(path, model)
        if found is not None:
            return str(path), *found
    checkpoint_kind(str(path), accepted_checkpoints())  # a missing path, an empty or foreign file, a stray folder
    weights, trained = _opendit_weights(path)
    if trained:
        return str(weights), trained, None
    found = _recognize(path, model)
    return (str(weights), *found) if found is not None else (str(weights), {}, None)


def load_model(cfg, device) -> LoadedModel:
    """The checkpoint of `cfg.ckpt` ("latest": newest under cfg.outputs) with its family, encoders and the
    run's settings (flags win over the checkpoint's training config, which wins over a family's defaults)."""
    path = Path(latest_run_checkpoint(cfg.outputs) if cfg.ckpt == "latest" else cfg.ckpt)
    flags = checkpoint_overrides(cfg)
    weights, trained, state = read_checkpoint(path, flags.get("model"))
    adapters = [parse_lora_spec(s) for s in cfg.lora]
    if trained.get("lora_rank"):  # a LoRA run's checkpoint: its base weights, then its own adapters
        weights, own = lora_run_weights(path, trained)
        adapters.insert(0, (own, 1.0))
    settings = {**trained, **flags}
    name = settings.get("model")
    if name is None:
        raise ValueError(f"cannot tell the model of {path}: no training config beside it and no model family "
                         f"recognises its weights; pass --model (and --image_size, --num_classes)")
    family = family_of(name)
    known = {f.name for f in dataclasses.fields(cfglib.TrainConfig)}
    run = family.sampling_config(cfglib.TrainConfig(**{k: v for k, v in settings.items() if k in known}),
                                 given=set(settings))
    encoders = family.load_encoders(run, device, training=False)
    shape = family.latent_shape(run, encoders, data_channels=cfg.in_channels)
    with torch.device("meta"):  # the weights come from the file: no random init (minutes for 12B parameters)
        model = family.build_model(run, shape)
    check_model_contract(model, name)
    load_into_meta_model(model, state if state is not None else family.load_weights(weights), f"--ckpt {path}",
                         keep_dtype=cfg.mixed_precision == "bf16")
    apply_lora_files(model, family, adapters)
    configure_kernels(model, cfg.enable_modulate_kernel, cfg.enable_layernorm_kernel, cfg.enable_flashattn, device)
    model = speed_up(model.to(device).eval(), cfg.mixed_precision, cfg.compile)
    # from here on latent_shape is what sampling draws: the size of --height / --width (/ --num_frames)
    loaded = LoadedModel(family, model, encoders, run, shape, weights)
    loaded = dataclasses.replace(loaded, latent_shape=tuple(family.sample_shape(loaded, cfg)))
    logger.info("loaded %s (%s, family %s, input %s, sampling %s, vae %s)", weights, name, family.name,
                "x".join(map(str, shape)), "x".join(map(str, loaded.latent_shape)), run.vae)
    return loaded


def lora_run_weights(path: Path, trained: dict) -> tuple[str, str]:
    """(base weights, adapter file) of a LoRA run's checkpoint folder."""
    own = path / "lora.safetensors" if path.is_dir() else None
    if own is None or not own.is_file():
        raise ValueError(f"{path} is a LoRA run's checkpoint without its lora.safetensors; pass the base weights as "
                         f"--ckpt and the adapters with --lora FILE")
    base = trained.get("init_weights")
    if not base or not Path(base).exists():
        raise ValueError(f"the base weights of LoRA checkpoint {path} ({base}) are not there; pass them as --ckpt "
                         f"and the adapters with --lora {own}")
    return base, str(own)


def complete_sample_config(family, sample_cfg, cfg):
    """The one place the family's sampling defaults (sampler, steps, guidance scale) fill what sample_cfg left
    out (None); a sampler the family does not have is a ValueError naming the ones it has."""
    defaults = family.sample_defaults(sample_cfg, cfg)
    sample_cfg = dataclasses.replace(sample_cfg, **{k: v for k, v in defaults.items()
                                                    if getattr(sample_cfg, k) is None})
    if sample_cfg.sampler not in family.samplers:
        raise ValueError(f"--sampler {sample_cfg.sampler} does not apply to {cfg.model}; use one of "
                         f"{', '.join(family.samplers)}")
    return sample_cfg


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
