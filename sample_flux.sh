#!/usr/bin/env bash
# Sample images from a FLUX model with prompts: the Euler sampler on FLUX's schedule (flux-schnell 4 steps, no
# shift; flux-dev 50 steps, guidance embedding 3.5); CFG > 1 adds true classifier-free guidance.
#   CKPT=latest bash sample_flux.sh --prompts "a handwritten seven" "the digit two"       # the demo's newest run
#   CKPT=/models/FLUX.1-dev/flux1-dev.safetensors FLUX=/models/FLUX.1-dev bash sample_flux.sh \
#       --prompts_file prompts.txt --image_size 1024 --mixed_precision bf16
set -euo pipefail
NGPU=${NGPU:-1}
set -- --ckpt "${CKPT:?set CKPT (a checkpoint folder, an EMA export, an official .safetensors, or latest)}" \
  ${FLUX:+--vae "$FLUX/vae" --t5 "$FLUX" --clip "$FLUX"} ${CFG:+--cfg_scale "$CFG"} \
  ${STEPS:+--num_sampling_steps "$STEPS"} --out "${OUT:-samples}" "$@"
if [ "$NGPU" -gt 1 ]; then
  exec torchrun --standalone --nproc_per_node "$NGPU" sample.py "$@"
fi
exec python sample.py "$@"
