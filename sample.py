"""Sample class-conditional images from a DiT checkpoint (EMA export, training checkpoint or official .pt).

    python sample.py --ckpt outputs/000-DiT-Ti-4/checkpoints/step-002000 --num_samples 20
    torchrun --nproc_per_node 4 sample.py --ckpt DiT-XL-2-256x256.pt --image_size 256 --cfg_scale 4 --npz
"""
import argparse
import logging
import math
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from opendit import config as cfglib
from opendit.distributed import cleanup, exit_process, init_distributed
from opendit.parallel import validate_sp
from opendit.inference import global_batches, load_model, make_diffusion, sample_batch, save_png, write_grid
from opendit.training.run_log import setup_logging

logger = logging.getLogger("opendit")


def main(cfg: cfglib.SampleConfig) -> None:
    if not cfg.ckpt:
        raise SystemExit("sample.py: --ckpt is required (an EMA .safetensors, a checkpoint folder, or a DiT .pt)")
    info = init_distributed()
    setup_logging(info.rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    model, vae, settings = load_model(cfg, info.device)
    dp_rank, dp_size, writer = info.rank, info.world_size, True
    if cfg.sequence_parallel_size > 1:  # ranks of one SP group share each batch and split its tokens
        kind = validate_sp(info.world_size, cfg.sequence_parallel_size, cfg.sequence_parallel_type,
                           model.blocks[0].attn.num_heads)
        mesh = init_device_mesh(info.device.type, (info.world_size // cfg.sequence_parallel_size,
                                                   cfg.sequence_parallel_size), mesh_dim_names=("dp", "sp"))
        model.enable_sequence_parallel(mesh["sp"].get_group(), kind)
        dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
        writer = mesh["sp"].get_local_rank() == 0
    diffusion = make_diffusion(cfg, settings["learn_sigma"])
    labels = cfg.class_labels or list(range(settings["num_classes"]))
    bad = [c for c in labels if not 0 <= c < settings["num_classes"]]
    if bad:
        raise SystemExit(f"sample.py: --class_labels {bad} out of range 0..{settings['num_classes'] - 1}")
    num = cfg.num_samples or len(labels)
    out = Path(cfg.out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    for batch in global_batches(num, cfg.batch_size, dp_rank, dp_size):
        images = sample_batch(model, vae, diffusion, batch, labels, cfg, settings, info.device)
        for i, image in zip(batch, images if writer else []):
            save_png(image, out / "images" / f"{i:06d}.png")
        logger.info("samples %d-%d of %d written", batch.start, batch.stop - 1, num)
    dist.barrier()
    if info.rank == 0:
        paths = [out / "images" / f"{i:06d}.png" for i in range(num)]
        write_grid(paths[:256], out / "grid.png", ncol=min(len(labels), 16) if len(labels) > 1 else math.isqrt(num))
        if cfg.npz:  # uint8 [N, H, W, 3], the layout of ADM's evaluation suite
            from PIL import Image
            arr = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in paths])
            np.savez(out / "samples.npz", arr_0=arr)
        logger.info("wrote %s (grid.png, images/%s)", out, ", samples.npz" if cfg.npz else "")
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cfglib.add_arguments(parser, cfglib.SampleConfig)
    main(cfglib.from_args(cfglib.SampleConfig, parser.parse_args()))
    exit_process()
