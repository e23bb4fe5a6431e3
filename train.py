"""Train a class-conditional DiT.

    python train.py --max_steps 2000 --batch_size 64                    # digits demo, one process, CPU or GPU
    torchrun --nproc_per_node 8 train.py --model DiT-XL/2 --dataset folder --data_path /imagenet/train \
        --image_size 256 --num_classes 1000 --vae stabilityai/sd-vae-ft-ema --plugin zero2 --mixed_precision bf16
"""
import argparse

from opendit import config as cfglib
from opendit.distributed import cleanup, exit_process


def main(cfg: cfglib.TrainConfig) -> None:
    from opendit.training.loop import Trainer  # after arg parsing, so --help is instant

    Trainer(cfg).train()
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cfglib.add_arguments(parser, cfglib.TrainConfig)
    main(cfglib.from_args(cfglib.TrainConfig, parser.parse_args()))
    exit_process()
