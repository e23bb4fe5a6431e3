"""A run's checkpoints: what the Trainer saves into a step folder besides DCP's state (the data position, the
resolved config, the loss scaler, the EMA or LoRA exports for sample.py), written at once or, with --async_ckpt,
in the background (opendit.checkpoint.async_save). Each save logs how long it held the step up."""
import logging
import time
from pathlib import Path

import yaml

from opendit import config as cfglib
from opendit.checkpoint import export_ema, export_weights, read_dcp_weights, record_files, save_checkpoint
from opendit.checkpoint.async_save import AsyncCheckpointer
from opendit.distributed import barrier, current_rank
from opendit.lora.run import export_lora

logger = logging.getLogger("opendit")


class RunSaver:
    """trainer.save() and the run's end go through here; `last` is the newest committed checkpoint."""

    def __init__(self, asynchronous: bool, last: str | None):
        self.background = AsyncCheckpointer() if asynchronous else None
        self.last = last

    def save(self, trainer) -> None:
        settings = cfglib.run_record(trainer.chosen, trainer.cfg)
        extra = {"data": trainer.loader.state_dict(), "config": settings}
        if trainer.booster.scaler is not None:
            extra["loss_scaler"] = trainer.booster.scaler.state_dict()
        if trainer.lora_base is not None:
            extra["lora_base"] = trainer.lora_base
        args = dict(root=str(trainer.run_dir / "checkpoints"), step=trainer.step, model=trainer.model,
                    optimizer=trainer.optimizer, ema=trainer.ema, lr_scheduler=trainer.scheduler, extra=extra,
                    keep_last=trainer.cfg.keep_last, trainable_only=trainer.lora_base is not None)
        start = time.perf_counter()
        # a LoRA run's adapters are small, and exporting them takes the live model: saved at once
        if self.background is not None and trainer.lora_base is None:
            blocked = self.background.save(**args, rank0_files={"config.yaml": _yaml_bytes(settings)},
                                           after_commit=_ema_exporter(trainer.ema, settings))
            logger.info("checkpoint step %d: the step waited %.2f s (copy to host memory); writing it in the "
                        "background", trainer.step, blocked)
            return
        path = save_checkpoint(**args)
        if trainer.lora_base is not None:  # the adapters for sample.py, diffusers and ComfyUI, naming their base
            names = export_lora(path, trainer.model, trainer.ema, trainer.lora_map, {
                "opendit_model": trainer.cfg.model, "opendit_base": trainer.lora_base["path"],
                "opendit_base_sha256": trainer.lora_base["sha256"]}, trainer.lora_kohya_map)
            if names:  # rank 0 wrote them
                record_files(path, names)
        elif trainer.ema is not None:  # without one, sample.py reads the checkpoint's weights
            export_ema(trainer.ema, Path(path) / "ema.safetensors", metadata={"config": settings})
        if current_rank() == 0:
            cfglib.save_yaml(settings, Path(path) / "config.yaml")
            record_files(path, ["config.yaml"])  # into the checkpoint's manifest, so a load verifies it too
        barrier()
        self.last = path
        logger.info("saved checkpoint %s in %.2f s", path, time.perf_counter() - start)

    def wait(self) -> None:
        """The run's end: wait for the save in flight (a collective with --async_ckpt)."""
        if self.background is None or not self.background.in_flight:
            return
        start = time.perf_counter()
        self.last = self.background.wait()
        logger.info("saved checkpoint %s (waited %.2f s for the background write)", self.last,
                    time.perf_counter() - start)

    def note_committed(self) -> None:
        """Between steps: note a background save that has finished, without waiting."""
        path = self.background.committed() if self.background is not None else None
        if path is not None:
            self.last = path
            logger.info("saved checkpoint %s (written in the background)", path)


def _yaml_bytes(settings: dict) -> bytes:
    return yaml.safe_dump(settings, sort_keys=False).encode()


def _ema_exporter(ema, settings: dict):
    """after_commit of a background save: rank 0 reads the EMA back from the committed folder and writes
    ema.safetensors beside it (what export_ema writes in a synchronous save), without a collective."""
    if ema is None:
        return None

    def export(path: str) -> None:
        if current_rank() == 0:
            export_weights(str(Path(path) / "ema.safetensors"), read_dcp_weights(path, "ema"),
                           metadata={"config": settings})
            record_files(path, ["ema.safetensors"])
    return export
