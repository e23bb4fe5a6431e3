#!/usr/bin/env bash
# Train a model through diffusers' own transformer (FLUX.2, Z-Image, Qwen-Image, Chroma, HunyuanVideo-1.5, ...: every
# family of `python -m opendit.models_doc` built from diffusers) under opendit's stack. RECIPE=digits (the CPU demo:
# MODEL, default flux2-klein-debug, any image model's -debug size, on 16 px captioned digits in pixel space through
# the tiny random text encoder its constants name, made on first use), RECIPE=video (MODEL, default
# hunyuanvideo1.5-debug, on 5-frame moving digits) or RECIPE=lora (a rank-16 LoRA of a downloaded pipeline folder,
# e.g. FLUX.2-klein-base-4B, Z-Image or Qwen-Image, on one GPU). NGPU, MODEL and extra flags come from the
# environment / command line:
#   RECIPE=digits bash train_diffusers.sh                                         # CPU demo, FLUX.2 [klein]
#   RECIPE=digits MODEL=z-image-debug bash train_diffusers.sh                     # CPU demo, Z-Image
#   RECIPE=video bash train_diffusers.sh                                          # CPU demo, HunyuanVideo-1.5
#   RECIPE=lora MODEL=flux2-klein-4b PIPE=/models/FLUX.2-klein-base-4B DATA=/data/my_images bash train_diffusers.sh
# PIPE is a local diffusers pipeline folder (transformer/, vae/, text_encoder/, tokenizer/, scheduler/); DATA a
# folder of images with a .txt caption beside each (or a CSV / JSONL of path,caption).
set -euo pipefail
NGPU=${NGPU:-1}
RECIPE=${RECIPE:-digits}
case "$RECIPE" in
  digits)
    MODEL=${MODEL:-flux2-klein-debug}
    ENC=${ENC:-outputs/diffusers_demo_text_$MODEL}
    [ -e "$ENC" ] || python -m opendit.families.wrapped.tiny_text "$MODEL" "$ENC"
    set -- --model "$MODEL" --dataset captioned_digits --image_size 16 --vae none --text_encoder "$ENC" \
      --batch_size 64 --lr 1e-3 --ema_decay 0.995 --max_steps 2000 --ckpt_every 1000 --log_every 100 \
      --num_workers 0 "$@" ;;
  video)
    MODEL=${MODEL:-hunyuanvideo1.5-debug}
    ENC=${ENC:-outputs/diffusers_demo_text_$MODEL}
    [ -e "$ENC" ] || python -m opendit.families.wrapped.tiny_text "$MODEL" "$ENC" --words moving_digits
    set -- --model "$MODEL" --dataset moving_digits --image_size 16 --num_frames 5 --vae none \
      --text_encoder "$ENC" --batch_size 16 --lr 1e-3 --ema_decay 0.995 --max_steps 1000 --ckpt_every 500 \
      --log_every 50 --num_workers 0 "$@" ;;
  lora)
    MODEL=${MODEL:?set MODEL: flux2-klein-4b, z-image or qwen-image}
    PIPE=${PIPE:?set PIPE to a local diffusers pipeline folder of the model}
    set -- --model "$MODEL" --init_weights "$PIPE" --vae "$PIPE" --text_encoder "$PIPE" --scheduler "$PIPE" \
      --dataset captions --data_path "${DATA:?set DATA to a folder of images with .txt captions}" --image_size 1024 \
      --buckets auto --lora_rank 16 --batch_size "${BATCH:-1}" --lr 1e-4 --mixed_precision bf16 --grad_checkpoint 1 \
      --ema_decay 0 --max_steps 2000 --ckpt_every 500 --log_every 10 "$@" ;;
  *) echo "unknown RECIPE=$RECIPE (digits, video, lora)" >&2; exit 2 ;;
esac
if [ "$NGPU" -gt 1 ]; then
  exec torchrun --standalone --nproc_per_node "$NGPU" train.py "$@"
fi
exec python train.py "$@"
