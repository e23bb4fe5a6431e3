"""Sample from a trained model: an EMA export, a training checkpoint folder, or a checkpoint a model family
knows (an official DiT or Latte .pt, a diffusers DiT folder, an official flux1-dev / flux1-schnell .safetensors).
The checkpoint's model family decides the noise, the conditioning, the sampler and the outputs (images:
images/NNNNNN.png, grid.png; video: videos/NNNNNN.mp4, strips/, grid.gif; with --npz samples.npz).

    python sample.py --ckpt latest --num_samples 20                       # newest checkpoint under ./outputs
    python sample.py --ckpt outputs/000-DiT-Ti-4/checkpoints/step-001000 --cfg_scale 2 --sampler ddim \\
        --num_sampling_steps 50
    torchrun --nproc_per_node 4 sample.py --ckpt DiT-XL-2-256x256.pt --image_size 256 --cfg_scale 4 --npz
    python sample.py --ckpt latest --prompt "a handwritten seven"         # a model trained on captions
    python sample.py --ckpt latest --height 16 --width 32                 # another size (whole patches; video
                                                                          # also --num_frames)
"""
import logging
from pathlib import Path

import torch.distributed as dist

from opendit import config as cfglib
from opendit.booster.precision import set_tf32
from opendit.cli import setup_finished
from opendit.distributed import cleanup, exit_process, init_distributed
from opendit.inference import (attach_step_cache, complete_sample_config, global_batches, load_model,
                               sampling_groups, with_vae_decode)
from opendit.training.run_log import setup_logging

logger = logging.getLogger("opendit")


def main(cfg: cfglib.SampleConfig) -> None:
    if not cfg.ckpt:
        raise SystemExit("sample.py: --ckpt is required (an EMA .safetensors, a checkpoint folder, or a DiT .pt)")
    info = init_distributed()
    setup_logging(info.rank)
    set_tf32(info.device)
    loaded = load_model(cfg, info.device)
    family, run = loaded.family, loaded.cfg
    try:
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
        logger.info("wrote %s (%s)", cfg.out, ", ".join(written))
    cleanup()


if __name__ == "__main__":
    from opendit.cli import parse_config, run_entry  # a bad flag or file: one line `error: ...`, exit status 2

    run_entry(main, parse_config(cfglib.SampleConfig, __doc__), check=cfglib.check_config)
    exit_process()
