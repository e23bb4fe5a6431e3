#!/usr/bin/env bash
# Sample from a trained DiT. CKPT: an EMA export, a checkpoint folder, or an official DiT .pt.
#   CKPT=DiT-XL-2-256x256.pt NGPU=8 bash sample_img.sh --image_size 256 --num_samples 50000 --npz   # FID set
#   CKPT=outputs/000-DiT-Ti-4/checkpoints/step-001000 bash sample_img.sh --num_samples 20
set -euo pipefail
NGPU=${NGPU:-1}
set -- --ckpt "${CKPT:?set CKPT}" --cfg_scale "${CFG:-4.0}" --num_sampling_steps "${STEPS:-250}" \
  --sampler "${SAMPLER:-ddpm}" --out "${OUT:-samples}" "$@"
if [ "$NGPU" -gt 1 ]; then
  exec torchrun --standalone --nproc_per_node "$NGPU" sample.py "$@"
fi
exec python sample.py "$@"
