"""Train a diffusion transformer; --model picks the model and with it its family (data, objective, sampler).

    RECIPE=digits bash train_img.sh            # the demo: DiT-Ti/4 on the built-in 8x8 digits, CPU, about 4 min
    python train.py --model DiT-Ti/4 --dataset digits --image_size 8 --batch_size 64 --lr 1e-3 --ema_decay 0.995 \\
        --max_steps 1000 --ckpt_every 500 --log_every 100 --num_workers 0 --sample_every 250      # the same
    torchrun --nproc_per_node 8 train.py --model DiT-XL/2 --dataset folder --data_path /imagenet/train \\
        --image_size 256 --vae stabilityai/sd-vae-ft-ema --plugin zero2 --mixed_precision bf16

A bad flag or file ends the run before it starts with one line, `error: ...`, and exit status 2 (opendit/cli.py).
"""
from opendit import config as cfglib
from opendit.cli import parse_config, run_entry
from opendit.errors import setup_finished


def main(cfg: cfglib.TrainConfig) -> None:
    from opendit.distributed import cleanup
    from opendit.training.loop import Trainer

    if cfg.memory_budget:  # the planner fills the memory options left at their defaults
        from opendit.plan import apply_memory_budget
        cfg = apply_memory_budget(cfg)
    trainer = Trainer(cfg)
    setup_finished()  # from here on an error is a fault of the run, not of its flags: it keeps its traceback
    trainer.train()
    cleanup()


if __name__ == "__main__":
    run_entry(main, parse_config(cfglib.TrainConfig, __doc__), check=cfglib.check_config)
    from opendit.distributed import exit_process
    exit_process()
