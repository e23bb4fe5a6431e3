"""What a trained run left, as sample.py, `python -m opendit.lora` and --init_weights read it: a checkpoint's
weights and the settings it was trained with (its config.yaml, the EMA export's .json sidecar, or the copy in
trainer.pt; a checkpoint that is not opendit's, such as an official release or a diffusers folder, through the
family that recognises it), and a LoRA run's base weights and adapters."""
import json
from pathlib import Path

from safetensors import SafetensorError

from opendit import config as cfglib
from opendit.checkpoint import CheckpointCorruptError, checkpoint_kind
from opendit.checkpoint.layout import is_step_dir
from opendit.checkpoint.safe_read import safe_load
from opendit.checkpoint.weights import ACCEPTED
from opendit.families import FAMILIES, family_of

_NO_SETTINGS = "or delete it and pass --model, --image_size and --num_classes"


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
        return cfglib.settings_of(meta.get("config", {}))
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
        return weights, cfglib.settings_of(extra.get("config", {}))  # train.py keeps it in the checkpoint too
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


def weights_and_adapters(path: Path, model: str | None) -> tuple[str, dict, dict | None, list]:
    """read_checkpoint's (weights, training settings, state) and the adapters that go with them: a LoRA run's
    checkpoint is its base weights plus its own lora.safetensors."""
    weights, trained, state = read_checkpoint(path, model)
    if not trained.get("lora_rank"):
        return weights, trained, state, []
    weights, own = lora_run_weights(path, trained)
    return weights, trained, state, [(own, 1.0)]


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
