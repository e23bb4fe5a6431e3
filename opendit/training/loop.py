"""The training loop in three levels: `train` (build, resume, cadence), `train_step` (accumulation, clipping,
step, EMA) and the objective's `loss` (what one micro-batch costs)."""
import dataclasses
import logging
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from opendit import config as cfglib
from opendit.booster import Booster, build_plugin
from opendit.checkpoint import (export_ema, latest_run_checkpoint, load_checkpoint, resolve_checkpoint,
                                rng_state, save_checkpoint, set_rng_state)
from opendit.data import build_dataset, read_manifest
from opendit.distributed import all_reduce_mean, broadcast_object, init_distributed
from opendit.ema import ShardedEMA
from opendit.encoders.vae import load_vae
from opendit.kernels import configure_kernels
from opendit.models import build_model, model_spec
from opendit.optim import LeanOptimizer
from opendit.parallel import validate_sp
from opendit.perf import MFUMeter, dit_train_flops_per_image
from opendit.training.objective import DiffusionObjective, latent_geometry
from opendit.training.optimizer import (OptimizerOptions, build_train_optimizer, cast_for_master_weights,
                                        prepare_boosted_optimizer, validate_optimizer)
from opendit.training.run_log import RunLogger, new_run_dir, setup_logging

logger = logging.getLogger("opendit")


def sync_rng(group) -> None:
    """Give every rank of `group` the RNG states (CUDA's too) of the group's first rank."""
    state = [rng_state()]
    dist.broadcast_object_list(state, group_src=0, group=group)
    set_rng_state(state[0])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def settings_from_cache(cfg: cfglib.TrainConfig) -> cfglib.TrainConfig:
    """--dataset latents: image size, VAE, scale and classes come from the cache's manifest. A value left at
    its default is taken from it; one given that disagrees is an error (the cache would not match it)."""
    manifest, defaults = read_manifest(cfg.data_path), cfglib.TrainConfig()
    updates = {}
    for key, flag in (("image_size", "image_size"), ("vae", "vae"), ("vae_scale", "vae_scale")):
        given, cached = getattr(cfg, flag), manifest[key]
        if given == getattr(defaults, flag) or given == cached or (key == "vae" and given.lower() == "none"):
            updates[flag] = cached
        elif not (key == "vae" and os.path.realpath(given) == os.path.realpath(cached)):
            raise ValueError(f"--{flag} {given} disagrees with the latent cache {cfg.data_path!r}, built with "
                             f"{key}={cached}; pass --{flag} {cached} or leave it out, or rebuild the cache")
    if cfg.num_classes == defaults.num_classes:
        updates["num_classes"] = manifest["num_classes"]
    elif cfg.num_classes < manifest["num_classes"]:
        raise ValueError(f"--num_classes {cfg.num_classes} is fewer than the cache's {manifest['num_classes']} classes")
    # keeps cfg.vae = the cache's VAE, so config.yaml tells sample.py which VAE decodes the samples
    return dataclasses.replace(cfg, **updates)


def build_dit(cfg, vae, data_channels: int, device, latent_shape=None):
    """latent_shape (C, h, w): the model input of cached latents (no VAE loaded); else from image_size and vae."""
    patch = model_spec(cfg.model).keywords["patch_size"]
    if latent_shape is not None:
        in_channels, input_size = latent_shape[0], latent_shape[1]
        if input_size % patch:
            raise ValueError(f"cached latents of size {input_size} are not a multiple of {cfg.model}'s patch size "
                             f"{patch}; pick a model with a smaller patch or cache larger images")
    else:
        input_size, in_channels = latent_geometry(cfg.image_size, vae, data_channels, patch)
    model = build_model(cfg.model, input_size=input_size, in_channels=in_channels, num_classes=cfg.num_classes,
                        learn_sigma=cfg.learn_sigma, class_dropout_prob=cfg.class_dropout_prob)
    configure_kernels(model, cfg.enable_modulate_kernel, cfg.enable_layernorm_kernel, cfg.enable_flashattn, device)
    return model


class Trainer:
    def __init__(self, cfg: cfglib.TrainConfig):
        cached = cfg.dataset == "latents"
        if cached:
            cfg = settings_from_cache(cfg)
        self.cfg = cfg
        self.dist = init_distributed()
        setup_logging(self.dist.rank)
        # every impossible combination fails here, before any data or weights are touched
        self.booster = Booster(build_plugin(
            cfg.plugin, mixed_precision=cfg.mixed_precision, dp_replicate=cfg.dp_replicate,
            sp_size=cfg.sequence_parallel_size, grad_checkpoint=cfg.grad_checkpoint, compile=cfg.compile,
            device=self.dist.device, blocks_to_swap=cfg.blocks_to_swap))
        self.optim_opts = OptimizerOptions(cfg.optimizer, cfg.optimizer_offload, cfg.optimizer_state_dtype,
                                           cfg.master_weights, cfg.fused_backward)
        validate_optimizer(self.optim_opts, plugin=cfg.plugin, world_size=self.dist.world_size,
                           mixed_precision=cfg.mixed_precision, grad_accum=cfg.grad_accum, grad_clip=cfg.grad_clip,
                           blocks_to_swap=cfg.blocks_to_swap)
        self.sp_kind = validate_sp(self.dist.world_size, cfg.sequence_parallel_size, cfg.sequence_parallel_type,
                                   model_spec(cfg.model).keywords["num_heads"])
        if cfg.grad_accum < 1 or cfg.batch_size % (self.booster.dp_size * cfg.grad_accum):
            raise ValueError(f"--batch_size {cfg.batch_size} must be divisible by data-parallel size "
                             f"{self.booster.dp_size} x --grad_accum {cfg.grad_accum}")
        # ranks of one sequence-parallel group draw the same noise, timesteps and label drops
        seed_everything(cfg.global_seed * self.booster.dp_size + self.booster.dp_rank)
        self.resume_from = self._resolve_resume()
        self.run_dir = self._make_run_dir()
        # cached latents skip the VAE (cfg.vae still names it, for sampling)
        self.vae = None if cached else load_vae(cfg.vae, self.dist.device)
        # the built-in digits are grey; a VAE wants RGB
        rgb = {"channels": 3} if cfg.dataset == "digits" and self.vae is not None else {}
        kw = {"seed": cfg.global_seed} if cached else rgb
        self.dataset = build_dataset(cfg.dataset, cfg.data_path, cfg.image_size, **kw)
        self.objective = DiffusionObjective(self.vae, cfg.vae_scale, cfg.learn_sigma)
        with torch.random.fork_rng(devices=[]):  # every rank builds the same weights (FSDP shards each rank's own)
            torch.manual_seed(cfg.global_seed)
            model = build_dit(cfg, self.vae, getattr(self.dataset, "channels", 3), self.dist.device,
                              latent_shape=getattr(self.dataset, "latent_shape", None))
        if self.booster.sp_group is not None:
            model.enable_sequence_parallel(self.booster.sp_group, self.sp_kind)
            logger.info("sequence parallel: %s over %d ranks", self.sp_kind, cfg.sequence_parallel_size)
        logger.info("%s: %.1fM parameters; attention backend %s", cfg.model,
                    sum(p.numel() for p in model.parameters()) / 1e6, model.blocks[0].attn.attn_backend)
        self.mfu = MFUMeter(dit_train_flops_per_image(model), world_size=self.dist.world_size,
                            device=self.dist.device)
        cast_for_master_weights(model, cfg.master_weights)
        optimizer = self._build_optimizer(model)
        warmup = max(cfg.warmup_steps, 0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        # batch_size is the global batch; the booster shards it by data-parallel rank with a resumable sampler
        loader = torch.utils.data.DataLoader(self.dataset, batch_size=cfg.batch_size, num_workers=cfg.num_workers,
                                             shuffle=True, drop_last=True)
        self.model, self.optimizer, self.loader, self.scheduler = self.booster.boost(
            model, optimizer, dataloader=loader, lr_scheduler=scheduler, data_seed=cfg.global_seed)
        # hooks go on the boosted (sharded) parameters; FSDP2 runs them after the gradient's reduce-scatter
        self.fused = prepare_boosted_optimizer(self.optimizer, self.optim_opts, cfg.grad_accum)
        if isinstance(self.optimizer, LeanOptimizer) and self.optimizer.multi_tensor_ready():
            logger.info("optimizer step: torch's fused AdamW kernel over all parameters at once (multi-tensor)")
        self.ema = ShardedEMA(self.model, decay=cfg.ema_decay, dp_group=self.booster.dp_mesh)
        self.step = 0
        if self.resume_from is not None:
            self.step, extra = load_checkpoint(self.resume_from, self.model, self.optimizer, ema=self.ema,
                                               lr_scheduler=self.scheduler)
            self.loader.load_state_dict(extra["data"])
            if self.booster.scaler is not None and "loss_scaler" in extra:
                self.booster.scaler.load_state_dict(extra["loss_scaler"])
            if self.booster.sp_group is not None:  # one SP group draws the same noise, also after a re-layout
                sync_rng(self.booster.sp_group)
            logger.info("resumed from %s at step %d", self.resume_from, self.step)
        # from the epoch's start, not from a resumed position (len(loader) counts what is left of this epoch)
        steps_per_epoch = self.loader.sampler.epoch_samples(0) // cfg.batch_size
        self.total_steps = cfg.max_steps if cfg.max_steps > 0 else cfg.epochs * steps_per_epoch

    # ---- set-up helpers -----------------------------------------------------------------------------------------
    def _build_optimizer(self, model) -> torch.optim.Optimizer:
        cfg = self.cfg
        # torch AdamW's fused kernel needs every parameter on the GPU at step time
        fused_kernel = self.dist.device.type == "cuda" and cfg.plugin != "gemini" and not cfg.blocks_to_swap
        optimizer = build_train_optimizer([p for p in model.parameters() if p.requires_grad], self.optim_opts,
                                          lr=cfg.lr, weight_decay=cfg.weight_decay, fused_kernel=fused_kernel,
                                          seed=cfg.global_seed)
        logger.info("optimizer %s%s", type(optimizer).__name__,
                    f" ({self.optim_opts})" if self.optim_opts.lean else "")
        return optimizer

    def _resolve_resume(self):
        if not self.cfg.load:
            return None
        path = None
        if self.dist.rank == 0:
            path = latest_run_checkpoint(self.cfg.outputs) if self.cfg.load == "latest" else resolve_checkpoint(self.cfg.load)
        return broadcast_object(path)

    def _make_run_dir(self) -> Path:
        """A resumed run continues in the run folder that holds its checkpoint; a new run gets the next number."""
        if self.dist.rank == 0:
            if self.resume_from is not None and Path(self.resume_from).parent.name == "checkpoints":
                run = Path(self.resume_from).parent.parent
            else:
                run = new_run_dir(self.cfg.outputs, self.cfg.model)
            cfglib.save_yaml(self.cfg, run / "config.yaml")
        else:
            run = None
        return Path(broadcast_object(str(run) if run else None))

    # ---- the loop -----------------------------------------------------------------------------------------------
    def train(self) -> list[float]:
        cfg, losses = self.cfg, []
        log = RunLogger(self.run_dir, self.dist.rank, self.total_steps, self.step, mfu_meter=self.mfu)
        logger.info("run folder %s; %d steps; global batch %d over %d data-parallel ranks", self.run_dir,
                    self.total_steps, cfg.batch_size, self.booster.dp_size)
        self.model.train()
        # the loss stays a device tensor between logs: no host sync per step, so the host queues the next
        # step's kernels while the device still runs this one (float64: the sum a Python float would give)
        interval_loss, interval_steps = torch.zeros((), dtype=torch.float64, device=self.dist.device), 0
        while self.step < self.total_steps:
            self.loader.set_epoch(self.loader.sampler.epoch)
            for batch in self.loader:
                loss, grad_norm = self.train_step(batch)
                self.loader.advance()
                self.step += 1
                interval_loss, interval_steps = interval_loss + loss, interval_steps + 1
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    mean_loss = all_reduce_mean(interval_loss.item() / interval_steps)
                    losses.append(mean_loss)
                    metrics = {"loss": mean_loss, "lr": self.scheduler.get_last_lr()[0]}
                    if cfg.grad_clip > 0:
                        metrics["grad_norm"] = float(grad_norm)  # this step's
                    if cfg.mixed_precision == "fp16":
                        metrics["skipped_steps"] = self.booster.skipped_steps
                    log.log(self.step, metrics,
                            images=interval_steps * cfg.batch_size)
                    interval_loss, interval_steps = interval_loss.zero_(), 0
                if self.step % cfg.ckpt_every == 0 or self.step == self.total_steps:
                    self.save()
                if self.step >= self.total_steps:
                    break
            else:
                self.loader.set_epoch(self.loader.sampler.epoch + 1)
        log.close()
        return losses

    def train_step(self, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step over a per-rank batch split into grad_accum micro-batches -> (loss, grad norm), both
        device tensors (reading them waits for the step; the norm is None without --grad_clip)."""
        cfg, booster = self.cfg, self.booster
        x, y = self.objective.prepare(batch, self.dist.device)
        total = torch.zeros((), dtype=torch.float64, device=self.dist.device)
        for i, (xm, ym) in enumerate(zip(x.chunk(cfg.grad_accum), y.chunk(cfg.grad_accum))):
            last = i == cfg.grad_accum - 1
            with booster.no_sync(self.model, enabled=not last), booster.autocast():
                loss = self.objective.loss(self.model, xm, ym) / cfg.grad_accum
                booster.backward(loss, self.optimizer)
            total += loss.detach()
        # never under --fused_backward (refused at start): its gradients are gone, each freed after its update
        clip = cfg.grad_clip > 0 and self.fused is None
        grad_norm = booster.clip_grad_norm_(self.model, cfg.grad_clip) if clip else None
        if booster.step(self.optimizer):
            self.scheduler.step()
            self.ema.update(self.model)
        return total, grad_norm

    def save(self) -> None:
        extra = {"data": self.loader.state_dict(), "config": cfglib.to_dict(self.cfg)}
        if self.booster.scaler is not None:
            extra["loss_scaler"] = self.booster.scaler.state_dict()
        path = save_checkpoint(self.run_dir / "checkpoints", self.step, self.model, self.optimizer, ema=self.ema,
                               lr_scheduler=self.scheduler, extra=extra, keep_last=self.cfg.keep_last)
        export_ema(self.ema, Path(path) / "ema.safetensors", metadata={"config": cfglib.to_dict(self.cfg)})
        if self.dist.rank == 0:
            cfglib.save_yaml(self.cfg, Path(path) / "config.yaml")
        dist.barrier()
        logger.info("saved checkpoint %s", path)
