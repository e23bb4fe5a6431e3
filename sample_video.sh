#!/usr/bin/env bash
# Sample clips from a trained video DiT: one MP4 and PNG strip per clip, grid.png and grid.gif.
#   CKPT=latest bash sample_video.sh                                  # the newest checkpoint under ./outputs
#   CKPT=outputs/001-Latte-XL-2/checkpoints/step-150000 NGPU=8 bash sample_video.sh --num_samples 2048 --npz
set -euo pipefail
NGPU=${NGPU:-1}
set -- --ckpt "${CKPT:?set CKPT (a checkpoint folder, or latest)}" --cfg_scale "${CFG:-4.0}" \
  --num_sampling_steps "${STEPS:-250}" --sampler "${SAMPLER:-ddpm}" --fps "${FPS:-8}" --out "${OUT:-samples}" "$@"
if [ "$NGPU" -gt 1 ]; then
  exec torchrun --standalone --nproc_per_node "$NGPU" sample.py "$@"
fi
exec python sample.py "$@"
