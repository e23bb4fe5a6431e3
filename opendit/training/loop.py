"""The training loop in three levels: `train` (resume, cadence), `train_step` (accumulation, clipping, step,
EMA) and the objective's `losses` (what one micro-batch costs). Everything model-specific comes from the model
family of --model (opendit.families): data, encoders, model, objective, FLOP count and previews."""
import dataclasses
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Subset

from opendit import config as cfglib
from opendit.booster import Booster
from opendit.booster.precision import compute_dtype, set_tf32
from opendit.checkpoint import (find_resume_checkpoint, latest_run_checkpoint, load_checkpoint, load_into_meta_model,
                                new_run_dir, resolve_checkpoint)
from opendit.console import setup_logging
from opendit.data import count_skipped
from opendit.data.buckets import bucket_ids, bucket_summary
from opendit.data.mixture import MixedDataset, first_dataset, load_mixture, read_dataset_config
from opendit.distributed import all_reduce_mean, broadcast_object, default_num_workers, init_distributed
from opendit.ema import ShardedEMA
from opendit.families import check_model_contract, family_of
from opendit.kernels import configure_kernels
from opendit.parallel import enable_sequence_parallel, plan_of
from opendit.lora.run import (adapt_model, check_lora_flags, check_same_base, family_kohya_map, family_module_map,
                              kept_as_stored, weights_fingerprint)
from opendit.optim import LeanOptimizer, build_optimizer
from opendit.perf import MFUMeter
from opendit.seeding import rng_state, seed_everything, set_rng_state
from opendit.training.guard import PeerLostError, StepGuard, lost_peer
from opendit.training.run_checks import validate_run
from opendit.training.optimizer import cast_for_master_weights, prepare_boosted_optimizer
from opendit.training.preview import Previewer, gather_preview_weights
from opendit.training.validation import BucketSums, TrainingPart, Validator, holdout, spread
from opendit.training.run_log import RunLogger
from opendit.training.saving import RunSaver

logger = logging.getLogger("opendit")


def sync_rng(group) -> None:
    """Give every rank of `group` the RNG states (CUDA's too) of the group's first rank."""
    state = [rng_state()]
    dist.broadcast_object_list(state, group_src=0, group=group)
    set_rng_state(state[0])


def micro_batches(x: torch.Tensor, cond: dict, n: int) -> list[tuple[torch.Tensor, dict]]:
    """Split a batch (x [B, ...], cond {name: [B, ...]}) into n micro-batches along the batch dim."""
    parts = {k: v.chunk(n) for k, v in cond.items()}
    return [(xm, {k: v[i] for k, v in parts.items()}) for i, xm in enumerate(x.chunk(n))]


@dataclasses.dataclass
class Interval:
    """What the steps since the last log line add up to. The loss stays a device tensor (no host sync per
    step); steps skipped as non-finite are left out of it."""
    loss: torch.Tensor
    buckets: BucketSums  # the per-sample losses by noise level
    steps: int = 0
    good: int = 0
    data_wait: float = 0.0

    def add(self, loss: torch.Tensor, skipped: bool) -> None:
        self.steps += 1
        if not skipped:
            self.loss += loss
            self.good += 1

    def reset(self) -> None:
        self.loss.zero_()
        self.steps = self.good = 0
        self.data_wait = 0.0


class Trainer:
    def __init__(self, cfg: cfglib.TrainConfig):
        cfglib.check_config(cfg)  # flag values no run can use fail first: no process group, folder or model yet
        cfg = cfglib.for_family(cfg)  # the shared options and the family's own, typed: another family's is refused
        self.chosen = cfg  # the run's options as given; self.cfg adds what the data and machine decide
        check_lora_flags(cfg)
        self.family = family_of(cfg.model)
        # a --dataset_config, read and checked once, before anything is built
        entries = read_dataset_config(cfg.dataset_config, cfg, self.family.datasets) if cfg.dataset_config else None
        if entries:
            cfg = first_dataset(cfg, entries)
        cfg = self.family.resolve_config(cfg)
        if cfg.num_workers is None:
            cfg = dataclasses.replace(cfg, num_workers=default_num_workers())
        self.guard = StepGuard(cfg.max_bad_steps, cfg.save_on_signal)
        self.dist = init_distributed(cfg.dist_timeout)
        setup_logging(self.dist.rank)
        set_tf32(self.dist.device, cfg.tf32)
        self.booster = self._validated_booster(cfg)  # every impossible combination fails before any work
        # ranks of one sequence-parallel group draw the same noise, timesteps and label drops
        seed_everything(cfg.global_seed * self.booster.dp_size + self.booster.dp_rank)
        self.resume_from = self._resolve_resume(cfg)
        self.lora_base = None  # LoRA: the base weights the adapters are trained on, {path, sha256}
        if cfg.lora_rank:
            self.lora_base = broadcast_object({"path": cfg.init_weights, "sha256": weights_fingerprint(
                cfg.init_weights)} if self.dist.rank == 0 else None)
        self.encoders = self.family.load_encoders(cfg, self.dist.device, training=True)
        # settings the data decides
        self.dataset, self.cfg = load_mixture(cfg, entries, self.family, self.encoders) if entries else \
            self.family.load_data(cfg, self.encoders)
        self.objective = self.family.objective(self.cfg, self.encoders)
        train_data = self._split_validation()
        self._boost(self._build_model(), train_data)
        self.step = 0
        self._order = (None, None)
        if self.resume_from is not None:
            self._resume()
        self.saver = RunSaver(cfg.async_ckpt, last=self.resume_from)
        # the loss stays a device tensor between logs (float64: the sum a Python float would give)
        self._interval = Interval(torch.zeros((), dtype=torch.float64, device=self.dist.device),
                                  BucketSums(self.dist.device))
        self.run_dir = self._make_run_dir()  # only now: a run that cannot start leaves no folder behind
        self.previewer = None if not self.cfg.sample_every else Previewer(  # every rank: it may encode prompts
            self.family, self.cfg, self.encoders, self.dist.device, self.run_dir, dataset=self.dataset)
        # from the epoch's start, not from a resumed position (len(loader) counts what is left of this epoch)
        steps_per_epoch = self.loader.sampler.epoch_samples(0) // self.cfg.batch_size
        self.total_steps = self.cfg.max_steps if self.cfg.max_steps > 0 else self.cfg.epochs * steps_per_epoch

    # ---- set-up helpers -----------------------------------------------------------------------------------------
    def _validated_booster(self, cfg) -> Booster:
        plugin, self.optim_settings, self.sp_kind = validate_run(cfg, self.family.models[cfg.model],
                                                                 self.dist.world_size, self.dist.device)
        return Booster(plugin)

    def _build_model(self) -> torch.nn.Module:
        """The family's model, the same weights on every rank (FSDP shards each rank's own copy)."""
        cfg = self.cfg
        shape = self.family.latent_shape(cfg, self.encoders, self.dataset)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.global_seed)
            if cfg.init_weights:  # no random init of what the file replaces (12B parameters take minutes)
                with torch.device("meta"):
                    model = self.family.build_model(cfg, shape)
                # a LoRA run's frozen Linears as stored: a bf16 base is never held in fp32 (kept_as_stored)
                load_into_meta_model(model, self.family.load_weights(cfg.init_weights),
                                     f"--init_weights {cfg.init_weights}",
                                     keep_dtype=cfg.master_weights != "fp32" or kept_as_stored(model, cfg))
            else:
                model = self.family.build_model(cfg, shape)
            if cfg.lora_rank:  # adapters on the frozen base; the same A on every rank (seeded)
                adapt_model(model, self.family, cfg, compute_dtype(cfg.mixed_precision))
        check_model_contract(model, cfg.model)
        configure_kernels(model, cfg.enable_modulate_kernel, cfg.enable_layernorm_kernel, cfg.enable_flashattn,
                          self.dist.device)
        if self.booster.sp_group is not None:
            enable_sequence_parallel(model, self.booster.sp_group, self.sp_kind)
            logger.info("sequence parallel: %s over %d ranks (%s)", self.sp_kind, cfg.sequence_parallel_size,
                        plan_of(model).describe())
        logger.info("%s (family %s): %.1fM parameters, input %s per sample", cfg.model, self.family.name,
                    sum(p.numel() for p in model.parameters()) / 1e6, "x".join(map(str, shape)))
        flops = self.family.train_flops_per_sample(model)
        if cfg.lora_rank:  # frozen weights get no weight gradient: forward and input gradient, 2 of the 3 passes
            flops *= 2 / 3
        self.mfu = MFUMeter(flops, world_size=self.dist.world_size, device=self.dist.device)
        self.lora_map = family_module_map(self.family, model) if cfg.lora_rank else None
        self.lora_kohya_map = family_kohya_map(self.family, model) if cfg.lora_rank else None
        return model

    def _split_validation(self):
        """-> the data to train on; sets self.validator (None without --val_every)."""
        cfg, self.validator = self.cfg, None
        if not cfg.val_every:
            return self.dataset
        if cfg.val_data_path:
            if self.family.datasets[cfg.dataset].built_in:
                raise ValueError(f"--val_data_path with --dataset {cfg.dataset}: the built-in data has no path; leave "
                                 f"it out and --val_samples {cfg.val_samples} items are held out of training")
            val_data, _ = self.family.load_data(dataclasses.replace(cfg, data_path=cfg.val_data_path), self.encoders)
            train_data, indices = self.dataset, spread(len(val_data), cfg.val_samples)
        else:
            train_idx, indices = holdout(len(self.dataset), cfg.val_samples, cfg.global_seed)
            val_data, train_data = self.dataset, TrainingPart(self.dataset, train_idx)
            logger.info("validation: %d of %d items held out of training", len(indices), len(self.dataset))
        micro_batch = max(cfg.batch_size // self.booster.dp_size // cfg.grad_accum, 1)
        self.validator = Validator(val_data, indices, self.objective, self.booster, micro_batch, cfg.global_seed,
                                   self.dist.device, timesteps=cfg.val_timesteps)
        return train_data

    def _boost(self, model: torch.nn.Module, train_data) -> None:
        cfg = self.cfg
        cast_for_master_weights(model, cfg.master_weights)
        optimizer = self._build_optimizer(model)
        warmup = max(cfg.warmup_steps, 0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                      lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        # batch_size is the global batch; the booster shards it by data-parallel rank with a resumable sampler
        loader = torch.utils.data.DataLoader(train_data, batch_size=cfg.batch_size, num_workers=cfg.num_workers,
                                             shuffle=True, drop_last=True)
        self.model, self.optimizer, self.loader, self.scheduler = self.booster.boost(
            model, optimizer, dataloader=loader, lr_scheduler=scheduler, data_seed=cfg.global_seed)
        if isinstance(self.dataset, MixedDataset):
            logger.info("datasets (--dataset_config %s):\n%s", cfg.dataset_config, self.dataset.summary(cfg.batch_size))
        elif bucket_ids(train_data) is not None:  # (a stream's buckets are in its order, not the sampler's groups)
            logger.info("aspect-ratio buckets (--buckets %s):\n%s", cfg.buckets, bucket_summary(
                bucket_ids(train_data), self.dataset.buckets.buckets, cfg.batch_size))
        # hooks go on the boosted (sharded) parameters; FSDP2 runs them after the gradient's reduce-scatter
        self.fused = prepare_boosted_optimizer(self.optimizer, self.optim_settings)
        if isinstance(self.optimizer, LeanOptimizer) and self.optimizer.multi_tensor_ready():
            logger.info("optimizer step: torch's fused AdamW kernel over all parameters at once (multi-tensor)")
        self.ema = None if cfg.ema_decay == 0 else ShardedEMA(  # 0: no EMA, the weights themselves are sampled
            self.model, decay=cfg.ema_decay, dp_group=self.booster.dp_mesh, device="cpu" if cfg.ema_on_host else None,
            trainable_only=bool(cfg.lora_rank))

    def _resume(self) -> None:
        self.step, extra = load_checkpoint(self.resume_from, self.model, self.optimizer, ema=self.ema,
                                           lr_scheduler=self.scheduler, trainable_only=self.lora_base is not None)
        if self.lora_base is not None:
            check_same_base(extra.get("lora_base"), self.cfg.init_weights, self.lora_base["sha256"], self.resume_from)
        self.loader.load_state_dict(extra["data"])
        if self.booster.scaler is not None and "loss_scaler" in extra:
            self.booster.scaler.load_state_dict(extra["loss_scaler"])
        if self.booster.sp_group is not None:  # one SP group draws the same noise, also after a re-layout
            sync_rng(self.booster.sp_group)
        logger.info("resumed from %s at step %d", self.resume_from, self.step)

    def _build_optimizer(self, model) -> torch.optim.Optimizer:
        settings = self.optim_settings  # the fused-backward hooks go on the boosted parameters, later
        optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], settings, hooks=False)
        logger.info("optimizer %s%s", type(optimizer).__name__, f" ({settings})" if settings.lean else "")
        return optimizer

    def _resolve_resume(self, cfg):
        if not cfg.load:
            return None
        path = None
        if self.dist.rank == 0:
            if cfg.load == "auto":
                path = find_resume_checkpoint(cfg.outputs)
                logger.info("--load auto: %s", f"resuming from {path}" if path else
                            f"no complete checkpoint under {cfg.outputs}, starting a new run")
            else:
                path = latest_run_checkpoint(cfg.outputs) if cfg.load == "latest" else resolve_checkpoint(cfg.load)
        return broadcast_object(path)

    def _make_run_dir(self) -> Path:
        """A resumed run continues in the run folder that holds its checkpoint and records this segment's
        configuration beside the first one's (config-from-step-000300.yaml); a new run gets the next number."""
        if self.dist.rank == 0:
            if self.resume_from is not None and Path(self.resume_from).parent.name == "checkpoints":
                run = Path(self.resume_from).parent.parent
                name = f"config-from-{Path(self.resume_from).name}.yaml"
            else:
                run, name = new_run_dir(self.cfg.outputs, self.cfg.model), "config.yaml"
            cfglib.save_yaml(cfglib.run_record(self.chosen, self.cfg), run / name)
        else:
            run = None
        return Path(broadcast_object(str(run) if run else None))

    # ---- the loop -----------------------------------------------------------------------------------------------
    def train(self) -> list[float]:
        with self.guard:  # SIGTERM / SIGUSR1 handlers while the loop runs
            try:
                return self._train()
            except RuntimeError as e:
                if lost_peer(e) is None:
                    raise
                raise PeerLostError.of(e, self.step + 1, self.cfg.dist_timeout, self.last_checkpoint) from e

    def _train(self) -> list[float]:
        cfg, losses = self.cfg, []
        log = RunLogger(self.run_dir, self.dist.rank, self.total_steps, self.step, cfg.log_every,
                        mfu_meter=self.mfu, device=self.dist.device)
        first_step = self.step + 1
        logger.info("run folder %s; %d steps; global batch %d over %d data-parallel ranks", self.run_dir,
                    self.total_steps, cfg.batch_size, self.booster.dp_size)
        self.model.train()
        while self.step < self.total_steps:
            self.loader.set_epoch(self.loader.sampler.epoch)
            for batch in self._timed_batches():
                loss, grad_norm, skipped = self.train_step(batch)
                self.loader.advance()
                self.step += 1
                self._interval.add(loss, skipped)
                self.guard.check_limit(self.step, self.last_checkpoint)
                stop = self.guard.stop_signal is not None
                if self.step % cfg.log_every == 0 or self.step == self.total_steps or stop:
                    losses.append(self._log_interval(log, grad_norm))
                elif self.step == first_step:
                    log.first_step(self.step)
                else:
                    log.tick(self.step)
                aside = time.perf_counter()  # not training: left out of the interval's rates
                if self.validator is not None and self.step % cfg.val_every == 0:
                    log.log_validation(self.step, self.validator(self.model))
                if self.previewer is not None and self.previewer.due(self.step):
                    self._preview(log)
                if self.step % cfg.ckpt_every == 0 or self.step == self.total_steps or stop:
                    self.save()
                self.saver.note_committed()
                log.pause(time.perf_counter() - aside)
                if stop:
                    logger.info("stopped by %s after step %d; resume with --load auto (or --load %s)",
                                self.guard.stop_signal, self.step, self.last_checkpoint)
                    return self._end(log, losses)
                if self.step >= self.total_steps:
                    break
            else:
                self.loader.set_epoch(self.loader.sampler.epoch + 1)
        return self._end(log, losses)

    def _preview(self, log: RunLogger) -> None:
        """The preview grid of this step from the EMA (or the weights): gathered on every rank, sampled on rank 0
        while the others wait; a failed preview is logged and training goes on."""
        weights = gather_preview_weights(self.model, self.ema)
        if self.dist.rank == 0:
            self.previewer(self.step, weights, tb=log.tb)
        del weights
        if dist.is_initialized():
            dist.barrier()

    def _timed_batches(self):
        """The loader's batches; the time spent waiting for each goes into the interval's data_wait."""
        batches = iter(self.loader)
        while True:
            start = time.perf_counter()
            batch = next(batches, None)
            self._interval.data_wait += time.perf_counter() - start
            if batch is None:
                return
            yield batch

    def _log_interval(self, log: RunLogger, grad_norm) -> float:
        """One log line over the steps since the last (a collective: every rank calls it); returns the loss."""
        cfg, interval = self.cfg, self._interval
        mean = interval.loss.item() / interval.good if interval.good else float("nan")
        metrics = {"loss": all_reduce_mean(mean), "lr": self.scheduler.get_last_lr()[0]}
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)  # this step's
        if self.guard.checking:
            metrics["bad_steps"] = self.guard.bad_total
        metrics["skipped_images"] = count_skipped(self.dataset)  # unreadable files, all ranks
        if cfg.mixed_precision == "fp16":
            metrics["skipped_steps"] = self.booster.skipped_steps
        by_noise_level = interval.buckets.read("loss")[1]
        log.log(self.step, metrics, images=interval.steps * cfg.batch_size, data_wait_s=interval.data_wait,
                quiet=by_noise_level)
        interval.reset()
        return metrics["loss"]

    def _end(self, log: RunLogger, losses: list[float]) -> list[float]:
        self.saver.wait()  # the run ends once its last checkpoint is complete
        skipped = count_skipped(self.dataset)
        if skipped and self.dist.rank == 0:
            logger.warning("%d unreadable files were skipped in this run (the first ones are named above)", skipped)
        log.close()
        return losses

    def _batch_loss_weight(self) -> float:
        """The loss weight of the global batch about to be trained: its dataset's (a --dataset_config's prior
        dataset: --prior_loss_weight), else 1. Every global batch comes from one dataset (opendit.data.mixture)."""
        if not isinstance(self.dataset, MixedDataset) or not self.dataset.weighted:
            return 1.0
        sampler = self.loader.sampler
        if self._order[0] != sampler.epoch:  # (epoch, its order of global items), made once per epoch
            self._order = (sampler.epoch, sampler.permutation())
        index = int(self._order[1][sampler.consumed])  # the batch's first item, in the training data's numbering
        data = self.loader.dataset
        return self.dataset.loss_weight(data.indices[index] if isinstance(data, Subset) else index)

    def train_step(self, batch) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """One optimizer step over a per-rank batch split into grad_accum micro-batches -> (loss, grad norm,
        skipped): the loss and norm are device tensors (reading them waits for the step; the norm is None when
        nothing computed it); skipped: the step was not finite on some rank and changed nothing. The loss (and so
        the gradients) is scaled by the batch's dataset's loss weight (--prior_loss_weight)."""
        cfg, booster, guard = self.cfg, self.booster, self.guard
        loss_weight = self._batch_loss_weight()
        x, cond = self.objective.prepare(batch, self.dist.device)
        if hasattr(self.objective, "begin_step"):
            self.objective.begin_step(self.step + 1)
        total = torch.zeros((), dtype=torch.float64, device=self.dist.device)
        terms = []  # (per-sample losses, t) of each micro-batch, for the loss by noise level
        for i, (xm, cm) in enumerate(micro_batches(x, cond, cfg.grad_accum)):
            last = i == cfg.grad_accum - 1
            with booster.no_sync(self.model, enabled=not last), booster.autocast():
                per_sample, t = self.objective.losses(self.model, xm, cm)
                terms.append((per_sample.detach(), t))
                loss = per_sample.mean() / cfg.grad_accum
                if loss_weight != 1.0:
                    loss = loss * loss_weight
                # --fused_backward updates inside backward: only the loss can be checked, before it
                if self.fused is not None and guard.active and guard.agree(
                        ~torch.isfinite(loss) if guard.checking else None, self.step + 1):
                    return total + loss.detach(), None, True
                booster.backward(loss, self.optimizer)
            total += loss.detach()
        grad_norm = None
        if self.fused is None:  # never under --fused_backward: its gradients are gone, each freed after its update
            if cfg.grad_clip > 0:
                grad_norm = booster.clip_grad_norm_(self.model, cfg.grad_clip)
            elif guard.checking and cfg.mixed_precision != "fp16":
                grad_norm = booster.grad_norm(self.model)
            if guard.active and guard.agree(self._non_finite(total, grad_norm), self.step + 1):
                booster.skip_step(self.optimizer)
                return total, grad_norm, True
        for per_sample, t in terms:
            self._interval.buckets.add(per_sample, t)
        if booster.step(self.optimizer):
            self.scheduler.step()
            if self.ema is not None:
                self.ema.update(self.model)
        return total, grad_norm, False

    def _non_finite(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> torch.Tensor | None:
        """The step's verdict as a device bool (None: not checked). Under fp16 the loss scaler handles
        overflowing gradients (they are expected there), so only the loss is checked."""
        if not self.guard.checking:
            return None
        bad = ~torch.isfinite(loss)
        if grad_norm is not None and self.cfg.mixed_precision != "fp16":
            bad |= ~torch.isfinite(grad_norm)
        return bad

    def save(self) -> None:
        self.saver.save(self)

    @property
    def last_checkpoint(self) -> str | None:
        """The newest complete checkpoint of this run (or the one it resumed from)."""
        return self.saver.last
