#!/usr/bin/env bash
# Launch image DiT training. RECIPE=imagenet (DiT paper: DiT-XL/2, 256px, global batch 256, AdamW lr 1e-4, wd 0,
# EMA 0.9999) or RECIPE=digits (the built-in demo, CPU-sized). NGPU, MODEL and extra flags come from the
# environment / command line:
#   NGPU=8 DATA=/data/imagenet/train bash train_img.sh --plugin zero2 --mixed_precision bf16
#   RECIPE=digits bash train_img.sh                      # the CPU demo (DiT-Ti/4, 8 px, 1,000 steps, ~5 min)
set -euo pipefail
NGPU=${NGPU:-1}
RECIPE=${RECIPE:-imagenet}
case "$RECIPE" in
  imagenet)
    MODEL=${MODEL:-DiT-XL/2}
    set -- --model "$MODEL" --dataset folder --data_path "${DATA:?set DATA to an ImageNet-style train folder}" \
      --image_size 256 --num_classes 1000 --vae "${VAE:-stabilityai/sd-vae-ft-ema}" --batch_size 256 --lr 1e-4 \
      --weight_decay 0 --ema_decay 0.9999 --epochs 1400 --ckpt_every 50000 --log_every 100 "$@" ;;
  digits)  # the README demo: the digits at their own 8x8 resolution, 1,000 steps (docs/training.md: quality)
    MODEL=${MODEL:-DiT-Ti/4}
    set -- --model "$MODEL" --dataset digits --image_size 8 --num_classes 10 --vae none --batch_size 64 \
      --lr 1e-3 --ema_decay 0.995 --max_steps 1000 --ckpt_every 500 --log_every 100 --num_workers 0 \
      --sample_every 250 "$@" ;;
  digits16)  # the earlier demo: upscaled to 16 px (16 tokens a digit), 2,000 steps, 10-20 min on 2 CPU cores
    MODEL=${MODEL:-DiT-Ti/4}
    set -- --model "$MODEL" --dataset digits --image_size 16 --num_classes 10 --vae none --batch_size 64 \
      --lr 1e-3 --ema_decay 0.995 --max_steps 2000 --ckpt_every 1000 --log_every 100 --num_workers 0 \
      --sample_every 500 "$@" ;;
  *) echo "unknown RECIPE=$RECIPE (imagenet, digits, digits16)" >&2; exit 2 ;;
esac
if [ "$NGPU" -gt 1 ]; then
  exec torchrun --standalone --nproc_per_node "$NGPU" train.py "$@"
fi
exec python train.py "$@"
