"""Print the memory plan of a training run without training:

    python -m opendit.plan --model flux-dev --image_size 1024 --memory_budget 16,64
    python -m opendit.plan --model Wan2.1-T2V-14B --image_size 480 --num_frames 81 --memory_budget 80,256
    python -m opendit.plan --model DiT-XL/2 --image_size 256 --batch_size 256 --memory_budget 24 --latent_cache

Takes train.py's flags (those that change memory: --batch_size, --mixed_precision, --lora_rank, --plugin, the memory
options to keep fixed, ...) plus --nproc (processes of the run, default 1) and --latent_cache (training from a
preprocess.py cache: no encoders loaded). Without --vae the family's usual VAE is assumed (--vae none: pixel space).
"""
import sys

import torch

from opendit import config as cfglib
from opendit.cli import fail
from opendit.plan.report import plan_config, planned_config

PLAN_DEFAULTS = dict(mixed_precision="bf16", batch_size=1, vae="auto")


def main(argv=None) -> str:
    parser = cfglib.build_parser(cfglib.TrainConfig, __doc__)
    parser.set_defaults(**PLAN_DEFAULTS)
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs) of the run")
    parser.add_argument("--latent_cache", action="store_true", help="train from a preprocess.py cache: no encoders")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="the device the run trains on")
    parser.error = lambda text: fail(f"{text} (see python -m opendit.plan --help)", hint=False)
    args = parser.parse_args(argv)
    cfg = cfglib.from_args(cfglib.TrainConfig, args)
    if not cfg.memory_budget:
        raise ValueError("--memory_budget is required: GPU_GiB[,HOST_GiB] (e.g. 24,64) or auto")
    cfg = planned_config(cfg, args.latent_cache)
    _, _, text = plan_config(cfg, cfg.memory_budget, args.nproc, torch.device(args.device))
    print(text)
    return text


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        fail(str(e), hint=False)
    sys.exit(0)
