#!/usr/bin/env bash
# Launch FLUX training. RECIPE=digits (the built-in demo, CPU-sized: flux-debug on 16 px captioned digits through
# tiny random local T5 / CLIP encoders, made on first use) or RECIPE=finetune (a full fine-tune of flux-dev from
# the official weights with the memory-lean options). NGPU, MODEL and extra flags come from the environment /
# command line:
#   RECIPE=digits bash train_flux.sh                                             # CPU demo
#   RECIPE=finetune FLUX=/models/FLUX.1-dev DATA=/data/my_images bash train_flux.sh
# FLUX is a local copy of the FLUX.1-dev repository (flux1-dev.safetensors, vae/, text_encoder/, tokenizer/,
# text_encoder_2/, tokenizer_2/); DATA a folder of images with a .txt caption beside each (or a CSV / JSONL of
# path,caption).
set -euo pipefail
NGPU=${NGPU:-1}
RECIPE=${RECIPE:-digits}
case "$RECIPE" in
  digits)
    MODEL=${MODEL:-flux-debug}
    ENC=${ENC:-outputs/flux_demo_encoders}
    [ -f "$ENC/t5/config.json" ] || python -m opendit.encoders.tiny_t5 "$ENC/t5"
    [ -f "$ENC/clip/config.json" ] || python -m opendit.encoders.tiny_clip "$ENC/clip" --words digits
    set -- --model "$MODEL" --dataset captioned_digits --image_size 16 --vae none --t5 "$ENC/t5" --clip "$ENC/clip" \
      --batch_size 64 --lr 1e-3 --ema_decay 0.995 --max_steps 2000 --ckpt_every 1000 --log_every 100 \
      --num_workers 0 "$@" ;;
  finetune)
    MODEL=${MODEL:-flux-dev}
    FLUX=${FLUX:?set FLUX to a local FLUX.1-dev folder}
    set -- --model "$MODEL" --init_weights "$FLUX/flux1-dev.safetensors" --vae "$FLUX/vae" --t5 "$FLUX" \
      --clip "$FLUX" --dataset captions --data_path "${DATA:?set DATA to a folder of images with .txt captions}" \
      --image_size 1024 --batch_size "${BATCH:-1}" --lr 1e-5 --guidance 1.0 --mixed_precision bf16 \
      --master_weights bf16_exact --optimizer_offload --optimizer_state_dtype u16 --fused_backward \
      --grad_checkpoint 1 --blocks_to_swap "${SWAP:-45}" --ema_decay 0 --max_steps 2000 --ckpt_every 500 \
      --log_every 10 "$@" ;;
  *) echo "unknown RECIPE=$RECIPE (digits, finetune)" >&2; exit 2 ;;
esac
if [ "$NGPU" -gt 1 ]; then
  exec torchrun --standalone --nproc_per_node "$NGPU" train.py "$@"
fi
exec python train.py "$@"
