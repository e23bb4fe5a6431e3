#!/usr/bin/env bash
# Sample clips from a trained video model: one MP4 and PNG strip per clip, grid.png and grid.gif. Guidance scale,
# steps, sampler and fps default to the model family's (Wan: UniPC, 50 steps, CFG 5; Latte: DDPM, 250, CFG 4).
#   CKPT=latest bash sample_video.sh --prompts "the digit 3 moving up and left"    # the Wan demo's newest run
#   CKPT=latest bash sample_video.sh --prompts "the digit 3 moving up" --image three.png   # image-to-video (Wan2.2)
#   CKPT=latest bash sample_video.sh --class_labels 3 7                            # the Latte demo's
#   CKPT=/models/Wan2.1-T2V-1.3B-Diffusers bash sample_video.sh --prompts "a cat surfing a wave at sunset" \
#       --num_frames 81 --height 480 --width 832 --mixed_precision bf16               # the official weights
#   CKPT=outputs/001-Latte-XL-2/checkpoints/step-150000 NGPU=8 bash sample_video.sh --num_samples 2048 --npz
set -euo pipefail
NGPU=${NGPU:-1}
set -- --ckpt "${CKPT:?set CKPT (a checkpoint folder, a Wan folder, or latest)}" ${CFG:+--cfg_scale "$CFG"} \
  ${STEPS:+--num_sampling_steps "$STEPS"} ${SAMPLER:+--sampler "$SAMPLER"} ${FPS:+--fps "$FPS"} \
  --out "${OUT:-samples}" "$@"
if [ "$NGPU" -gt 1 ]; then
  exec torchrun --standalone --nproc_per_node "$NGPU" sample.py "$@"
fi
exec python sample.py "$@"
