"""Train a diffusion transformer; --model picks the model and with it its family (data, objective, sampler).

    RECIPE=digits bash train_img.sh            # the demo: DiT-Ti/4 on the built-in digits, CPU, about 10 min
    python train.py --model DiT-Ti/4 --dataset digits --image_size 16 --batch_size 64 --lr 1e-3 \\
        --ema_decay 0.995 --max_steps 2000 --ckpt_every 1000 --log_every 100 --num_workers 0   # the same
    torchrun --nproc_per_node 8 train.py --model DiT-XL/2 --dataset folder --data_path /imagenet/train \\
        --image_size 256 --vae stabilityai/sd-vae-ft-ema --plugin zero2 --mixed_precision bf16
"""
from opendit import config as cfglib
from opendit.distributed import cleanup, exit_process


def main(cfg: cfglib.TrainConfig) -> None:
    from opendit.training.loop import Trainer

    Trainer(cfg).train()
    cleanup()


if __name__ == "__main__":
    parser = cfglib.build_parser(cfglib.TrainConfig, __doc__)
    main(cfglib.from_args(cfglib.TrainConfig, parser.parse_args()))
    exit_process()
