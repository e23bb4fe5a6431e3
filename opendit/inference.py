"""Sampling from a trained model: find the checkpoint, the settings it was trained with and its model family,
load the model, and generate by fixed global indices so that N processes produce exactly the samples one
process would (`sampling_groups`: the processes' data-parallel, CFG and sequence-parallel groups). Everything
model-specific (noise shape, conditioning, sampler, outputs) is the family's; so are checkpoints that are not
opendit's own (an official release, a diffusers folder), which a family recognises.
"""
import dataclasses
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from opendit import config as cfglib
from opendit.booster.parallelize import apply_compile
from opendit.booster.precision import cast_forward_io, compute_dtype, set_tf32
from opendit.checkpoint import latest_run_checkpoint, load_into_meta_model
from opendit.console import setup_logging
from opendit.distributed import cleanup, init_distributed
from opendit.encoders.vae_decode import DecodeOptions, check_tile_size
from opendit.errors import setup_finished
from opendit.families import LoadedModel, check_model_contract, family_of
from opendit.kernels import configure_kernels
from opendit.lora.run import apply_lora_files, parse_lora_spec
from opendit.models.step_cache import THRESHOLD_CACHES, StepCache, check_supported, make_step_cache
from opendit.run_files import weights_and_adapters
from opendit.parallel import (enable_cfg_parallel, enable_sequence_parallel, sampling_mesh, validate_cfg_parallel,
                              validate_sp)

logger = logging.getLogger("opendit")

def checkpoint_overrides(cfg) -> dict:
    """sample.py's flags that replace what the checkpoint was trained with (fields marked from_checkpoint)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.metadata.get("from_checkpoint") and getattr(cfg, f.name) is not None}


def load_model(cfg, device) -> LoadedModel:
    """The checkpoint of `cfg.ckpt` ("latest": newest under cfg.outputs) with its family, encoders and the
    run's settings (flags win over the checkpoint's training config, which wins over a family's defaults)."""
    path = Path(latest_run_checkpoint(cfg.outputs) if cfg.ckpt == "latest" else cfg.ckpt)
    flags = checkpoint_overrides(cfg)
    weights, trained, state, adapters = weights_and_adapters(path, flags.get("model"))
    adapters += [parse_lora_spec(s) for s in cfg.lora]
    settings = {**trained, **flags}
    name = settings.get("model")
    if name is None:
        raise ValueError(f"cannot tell the model of {path}: no training config beside it and no model family "
                         f"recognises its weights; pass --model (and --image_size, --num_classes)")
    family = family_of(name)
    trained_as = cfglib.family_class(family, "TrainConfig")
    known = {f.name for f in dataclasses.fields(trained_as)}
    run = family.sampling_config(trained_as(**{k: v for k, v in settings.items() if k in known}), given=set(settings))
    encoders = family.load_encoders(run, device, training=False)
    shape = family.latent_shape(run, encoders, data_channels=cfg.in_channels)
    model, companions = family.sampling_parts(_network(family, run, shape, path, weights, state, adapters, cfg,
                                                       device))
    model = model.to(device)  # companions stay on the CPU until used
    if companions:
        logger.info("%s holds the %s model too (kept on the CPU while idle)", weights, " and ".join(companions))
    for role, companion in family.companion_checkpoints(run, cfg, weights).items():  # kept on the CPU until used
        c_weights, _, c_state, c_adapters = weights_and_adapters(Path(companion), name)
        companions[role] = _network(family, run, shape, companion, c_weights, c_state, c_adapters, cfg, device)
        logger.info("loaded %s as the %s model (kept on the CPU while idle)", c_weights, role)
    loaded = LoadedModel(family, model, encoders, run, shape, weights, companions=companions)
    # from here on latent_shape is what sampling draws: the size of --height / --width (/ --num_frames)
    loaded = dataclasses.replace(loaded, latent_shape=tuple(family.sample_shape(loaded, cfg)))
    logger.info("loaded %s (%s, family %s, input %s, sampling %s, vae %s)", weights, name, family.name,
                "x".join(map(str, shape)), "x".join(map(str, loaded.latent_shape)), run.vae)
    return loaded


def _network(family, run, shape, path, weights: str, state, adapters: list, cfg, device) -> torch.nn.Module:
    """The family's model of the run built on the meta device and filled from `weights` (or `state`), with its
    LoRA adapters, precision, compile and the kernels that will run on `device`; on the CPU until moved there."""
    with torch.device("meta"):  # the weights come from the file: no random init (minutes for 12B parameters)
        model = family.build_model(run, shape)
    check_model_contract(model, run.model)
    load_into_meta_model(model, state if state is not None else family.load_weights(weights), f"--ckpt {path}",
                         keep_dtype=cfg.mixed_precision == "bf16")
    apply_lora_files(model, family, adapters)
    configure_kernels(model, cfg.enable_modulate_kernel, cfg.enable_layernorm_kernel, cfg.enable_flashattn, device)
    return speed_up(model.eval(), cfg.mixed_precision, cfg.compile)


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


def check_step_cache(sample_cfg, model=None) -> None:
    """A ValueError naming the flag when the step-cache settings of a completed sample config (the family's
    threshold filled in) cannot run, or `model` (a model or its class) has no hook for the cache."""
    kind, threshold = sample_cfg.cache, sample_cfg.cache_threshold
    if kind in THRESHOLD_CACHES and threshold is None:
        raise ValueError(f"--cache {kind} needs --cache_threshold (this model's family has no default), e.g. 0.1")
    if kind not in THRESHOLD_CACHES and threshold is not None:
        raise ValueError(f"--cache_threshold {threshold} applies to --cache teacache or fbcache, not --cache {kind}; "
                         f"leave it out or pick one of those")
    pab_range = sample_cfg.pab_range
    if len(pab_range) != 2 or not 0 <= pab_range[0] <= pab_range[1] <= 1:
        raise ValueError(f"--pab_range {' '.join(map(str, pab_range))}: must be two fractions START STOP "
                         f"with 0 <= START <= STOP <= 1, e.g. 0.1 0.9")
    if kind == "pab" and sample_cfg.compile:
        raise ValueError("--cache pab with --compile: PAB decides per step inside the compiled blocks, which would "
                         "recompile them every step; drop one of the two")
    if model is not None:
        check_supported(model, kind)


def attach_step_cache(model, sample_cfg, companions: dict | None = None) -> StepCache | None:
    """The step cache of a completed sample config attached to `model` (None for --cache none); reset it before
    every sampling batch. A ValueError naming the flag when it cannot run (check_step_cache), or when the model
    samples with companions (a step cache follows one model's steps)."""
    check_step_cache(sample_cfg, model)
    if companions and sample_cfg.cache != "none":
        raise ValueError(f"--cache {sample_cfg.cache} follows one model's steps; this checkpoint samples with "
                         f"{len(companions) + 1} models (--ckpt's and {', '.join(companions)}): leave --cache out")
    every = {"spatial": sample_cfg.pab_spatial_every, "temporal": sample_cfg.pab_temporal_every,
             "cross": sample_cfg.pab_cross_every}
    cache = make_step_cache(sample_cfg.cache, sample_cfg.num_sampling_steps, sample_cfg.cache_threshold, every,
                            tuple(sample_cfg.pab_range))
    return None if cache is None else cache.attach(model)


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


def sampling_groups(loaded, sample_cfg, conditions: list, info) -> tuple[int, int, bool]:
    """(data-parallel rank, data-parallel size, whether this rank writes) of sample.py's process. With
    --sequence_parallel_size or --cfg_parallel the world is a ("dp", "cfg", "sp") mesh: the ranks of one cfg x sp
    group share each batch (one of them writes it), the SP ranks split its tokens and the CFG pair its [cond;
    uncond] halves. Flags the world cannot run are a ValueError before any group is built."""
    sp_size, cfg_size = sample_cfg.sequence_parallel_size, 2 if sample_cfg.cfg_parallel else 1
    if sp_size * cfg_size == 1:
        return info.rank, info.world_size, True
    if cfg_size > 1:  # guidance runs with a scale above 1 on a conditional model (conditions [None]: none)
        validate_cfg_parallel(info.world_size, sp_size, sample_cfg.cfg_scale > 1.0 and conditions != [None])
    if sp_size > 1:
        spec = loaded.family.models[loaded.cfg.model]
        kind = validate_sp(info.world_size, sp_size, sample_cfg.sequence_parallel_type, spec.num_heads,
                           kinds=spec.sp_kinds)
    mesh = sampling_mesh(info.device, info.world_size, sp_size, cfg_size)
    for model in (loaded.model, *loaded.companions.values()):
        if sp_size > 1:
            enable_sequence_parallel(model, mesh["sp"].get_group(), kind)
        if cfg_size > 1:
            enable_cfg_parallel(model, mesh["cfg"].get_group())
    writes = mesh["sp"].get_local_rank() == 0 and mesh["cfg"].get_local_rank() == 0
    return mesh["dp"].get_local_rank(), mesh["dp"].size(), writes


def with_vae_decode(loaded, sample_cfg, world_size: int, dp_size: int):
    """`loaded` decoding as --vae_tiling, --vae_tile_size and --vae_batch say and, with --parallel_decode, split over
    the world_size / dp_size ranks that share each batch (one sequence- or CFG-parallel group: consecutive ranks, as
    the dp-major sampling mesh lays them out). A tile size the VAE cannot take, or --parallel_decode where every
    process samples its own batches, is a ValueError."""
    vae, tile = getattr(loaded.encoders, "vae", None), sample_cfg.vae_tile_size
    if tile is not None and vae is not None:
        check_tile_size(vae, tile)
    group = None
    if sample_cfg.parallel_decode:
        if world_size == dp_size:
            raise ValueError("--parallel_decode: every process decodes only its own samples already; it splits the "
                             "decode of the samples a sequence-parallel group shares: add --sequence_parallel_size N "
                             "(N processes per sample)")
        group, _ = dist.new_subgroups(group_size=world_size // dp_size)
    options = DecodeOptions(tiling=sample_cfg.vae_tiling or tile is not None, tile_size=tile,
                            batch=sample_cfg.vae_batch, group=group)
    return dataclasses.replace(loaded, vae_decode=options)


def sample_to_folder(cfg) -> None:
    """sample.py: every process of the job samples its share of the global indices of cfg (a SampleConfig) and
    the writers put them into cfg.out (the family's images / videos, grid, samples.npz)."""
    if not cfg.ckpt:
        raise SystemExit("sample.py: --ckpt is required (an EMA .safetensors, a checkpoint folder, or a DiT .pt)")
    info = init_distributed()
    setup_logging(info.rank)
    set_tf32(info.device)
    loaded = load_model(cfg, info.device)
    family, run, given = loaded.family, loaded.cfg, cfg
    try:
        cfg = cfglib.for_family(cfg, family, f"the checkpoint's model {run.model}")
        cfg = complete_sample_config(family, cfg, run)
        conditions = family.conditions(cfg, run)
        dp_rank, dp_size, writes = sampling_groups(loaded, cfg, conditions, info)  # SP and CFG-parallel groups
        loaded = with_vae_decode(loaded, cfg, info.world_size, dp_size)  # tiling, --parallel_decode
        cache = attach_step_cache(loaded.model, cfg, loaded.companions)  # --cache: None, or reset before every batch
    except ValueError as e:
        raise SystemExit(f"sample.py: {e}") from None
    sampler = family.make_sampler(cfg, run)
    sampler.progress = info.rank == 0  # a progress bar over each batch's denoising steps
    num = cfg.num_samples or len(conditions)
    writer = family.writer(Path(cfg.out), cfg, run)
    setup_finished()  # from here on an error is a fault of the run, not of its flags: it keeps its traceback
    for batch in global_batches(num, cfg.batch_size, dp_rank, dp_size):
        if cache is not None:
            cache.reset()  # what it stored belongs to the last batch's samples
        samples = family.sample_batch(loaded, sampler, batch, conditions, cfg, info.device)
        for i, sample in zip(batch, samples if writes else []):
            writer.write(i, sample)
        logger.info("samples %d-%d of %d written%s", batch.start, batch.stop - 1, num,
                    "" if cache is None else f" ({cache.report()})")
    dist.barrier()
    if info.rank == 0:
        written = writer.finish(num, conditions)
        cfglib.save_yaml(cfglib.run_record(given, cfg, family), Path(cfg.out) / "config.yaml")  # reruns them
        logger.info("wrote %s (%s)", cfg.out, ", ".join(written))
    cleanup()
