#!/usr/bin/env bash
# Launch video DiT training. RECIPE=moving_digits (the built-in demo, CPU-sized: Latte-Ti/4 on 3-frame 16 px
# clips of moving digits) or RECIPE=ucf101 (Latte's paper setting: Latte-XL/2, 16 frames every 3rd, 256 px,
# lr 1e-4, UCF-101's 101 classes from a CSV of path,label). NGPU, MODEL and extra flags come from the
# environment / command line:
#   RECIPE=moving_digits bash train_video.sh                                  # CPU demo
#   RECIPE=ucf101 NGPU=8 DATA=/data/ucf101/train.csv bash train_video.sh --plugin zero2 --mixed_precision bf16
set -euo pipefail
NGPU=${NGPU:-1}
RECIPE=${RECIPE:-moving_digits}
case "$RECIPE" in
  moving_digits)
    MODEL=${MODEL:-Latte-Ti/4}
    set -- --model "$MODEL" --dataset moving_digits --image_size 16 --num_frames 3 --vae none --batch_size 48 \
      --lr 2e-3 --ema_decay 0.995 --max_steps 1500 --ckpt_every 500 --log_every 50 --num_workers 0 "$@" ;;
  ucf101)
    MODEL=${MODEL:-Latte-XL/2}
    set -- --model "$MODEL" --dataset video_csv --data_path "${DATA:?set DATA to a CSV of path,label (UCF-101)}" \
      --image_size 256 --num_frames 16 --frame_interval 3 --vae "${VAE:-stabilityai/sd-vae-ft-ema}" \
      --batch_size 40 --lr 1e-4 --weight_decay 0 --ema_decay 0.9999 --max_steps 150000 --ckpt_every 10000 \
      --log_every 100 "$@" ;;
  *) echo "unknown RECIPE=$RECIPE (moving_digits, ucf101)" >&2; exit 2 ;;
esac
if [ "$NGPU" -gt 1 ]; then
  exec torchrun --standalone --nproc_per_node "$NGPU" train.py "$@"
fi
exec python train.py "$@"
