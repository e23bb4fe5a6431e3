#!/usr/bin/env bash
# Every GPU check and benchmark in one go, for a short lease on one GPU (H200): at most 600 s of timeouts in all,
# what one device command may run (training 75 + sampling 30 + kernels 40 + offload 30 + tests 50 + eval 15 +
# train.py 40 + 30 + 30 + video 25 + 15 + FLUX 40 + FLUX cached sampling 30 + Wan 45 + LoRA 55 + planner 50).
# FLUX gave 60 s to the planner check: FLUX_S=100 on a longer lease.
# Results land under $OUT (default ./gpu_results). Run from the repository root; no install (PYTHONPATH=.).
#   OUT=/tmp/r bash benchmarks/gpu_check.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
start=$(date +%s)
stamp() { echo "== $1 (t=$(( $(date +%s) - start )) s)"; }

stamp "device" | tee "$OUT/device.txt"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee -a "$OUT/device.txt"

# --time_budget 50: a, b and all (the headline rows, run first) should start within it; the rows it drops are
# the single-flag ones (BUDGET_S / THROUGHPUT_S raise it on a longer lease). Sampling's time came from here.
stamp "training throughput (DiT-XL/2, 256px, batch 256)"
timeout "${THROUGHPUT_S:-75}" python3 benchmarks/train_throughput.py --model DiT-XL/2 --image_size 256 \
  --batch_size 256 --recipe_batch_size 32 --warmup 3 --steps 8 --time_budget "${BUDGET_S:-50}" \
  --out "$OUT/train_throughput.md" --profile all --profile_out "$OUT/step_profile.md" 2>&1 | grep -v Warning | tail -60

# a, ours, b, ours-nokernels (compiling is most of the last three's time); variants that would start late
# are skipped (after 22 s), and a run the timeout kills still leaves its finished rows in sampling.md
stamp "sampling throughput (DiT-XL/2, 256px, batch 256, cfg 4: 512 per model call)"
timeout "${SAMPLING_S:-30}" python3 benchmarks/sample_throughput.py --model DiT-XL/2 --image_size 256 \
  --batch_size 256 --steps 10 --warmup_steps 2 --time_budget "${SAMPLING_BUDGET_S:-22}" \
  --out "$OUT/sampling.md" 2>&1 | grep -v Warning | tail -14

stamp "kernel benchmark"
timeout "${KERNELS_S:-40}" python3 benchmarks/kernel_speed.py 2>&1 | tee "$OUT/kernels.md" | tail -30

stamp "optimizer offload (DiT-XL/2, batch 32)"
timeout "${OPTIM_S:-30}" python3 benchmarks/optim_offload.py --batch_size 32 --steps 4 \
  --out "$OUT/optim_offload.md" 2>&1 | grep -v Warning | tail -12

stamp "gpu tests (kernels bf16 on CUDA, compile, fused backward, block swap)"
timeout "${TESTS_S:-50}" python3 -m pytest -q -p no:cacheprovider -x tests/test_kernels.py tests/test_attention.py \
  tests/test_kernels_compile.py tests/test_perf.py tests/test_optim_fused.py tests/test_optim_multi_tensor.py \
  tests/test_block_swap.py -m gpu 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"

stamp "opendit.eval on CUDA: the FID Inception (random weights) through the CLI, FID / IS / precision-recall"
timeout "${EVAL_S:-15}" python3 -m pytest -q -p no:cacheprovider tests/test_eval.py \
  -k "real_inception_architecture or identical_sets" 2>&1 | tail -6 | tee "$OUT/eval_tests.txt"

stamp "train.py on CUDA: the one-GPU fast path (ddp, bf16 weights + fp32_copy master, kernels, flash, compile), resume; zero2 with validation and a preview"
rm -rf /tmp/gpu_train /tmp/gpu_train_zero2
FAST="--model DiT-B/4 --image_size 32 --batch_size 64 --log_every 2 --num_workers 0 --mixed_precision bf16 --master_weights fp32_copy"
{ timeout 40 python3 train.py $FAST --max_steps 6 --ckpt_every 3 --enable_modulate_kernel --enable_layernorm_kernel \
    --enable_flashattn --compile --outputs /tmp/gpu_train \
  && timeout 30 python3 train.py $FAST --max_steps 8 --outputs /tmp/gpu_train --load latest \
  && timeout 30 python3 train.py --model DiT-B/4 --image_size 32 --batch_size 64 --max_steps 4 --log_every 2 \
    --num_workers 0 --plugin zero2 --mixed_precision bf16 --enable_modulate_kernel --val_every 2 --val_samples 64 \
    --sample_every 4 --preview_steps 10 --outputs /tmp/gpu_train_zero2 \
  && ls /tmp/gpu_train_zero2/*/previews; } 2>&1 \
  | grep -v Warning | tail -20 | tee "$OUT/train_smoke.txt"
stamp "video on CUDA: Latte-S/2 on moving digits (bf16 weights + fp32_copy, kernels, flash), then sample.py"
rm -rf /tmp/gpu_video
{ timeout 25 python3 train.py --model Latte-S/2 --dataset moving_digits --image_size 32 --num_frames 8 \
    --batch_size 16 --max_steps 4 --log_every 2 --num_workers 0 --mixed_precision bf16 --master_weights fp32_copy \
    --enable_modulate_kernel --enable_layernorm_kernel --enable_flashattn --outputs /tmp/gpu_video \
  && timeout 15 python3 sample.py --ckpt latest --outputs /tmp/gpu_video --num_samples 4 --num_sampling_steps 10 \
    --mixed_precision bf16 --enable_flashattn --out /tmp/gpu_video/samples; } 2>&1 \
  | grep -v Warning | tail -8 | tee "$OUT/video_smoke.txt"
stamp "FLUX: flux-dev 1024px full fine-tune step under a 16 GiB cap (lean options, block swap; synthetic cache)"
timeout "${FLUX_S:-40}" python3 benchmarks/flux_lean_step.py --steps 3 --out "$OUT/flux_lean.md" 2>&1 \
  | grep -v Warning | tail -12
stamp "FLUX cached sampling: flux-dev 1024px, 10 Euler steps, --cache none / teacache / fbcache (random weights)"
timeout "${FLUX_CACHE_S:-30}" python3 benchmarks/flux_cache_sampling.py --steps 10 --out "$OUT/flux_cache.md" 2>&1 \
  | grep -v Warning | tail -8
stamp "Wan: Wan2.1-T2V-1.3B 33 x 480 x 480 full fine-tune step (lean options; synthetic cache), vs wan_memory.py's plan"
timeout "${WAN_S:-45}" python3 benchmarks/wan_lean_step.py --steps 3 --out "$OUT/wan_lean.md" 2>&1 \
  | grep -v Warning | tail -8
stamp "LoRA: flux-dev rank 16 at 1024px (bf16 base of zeros written to /dev/shm, grad checkpointing; synthetic cache)"
timeout "${LORA_S:-55}" python3 benchmarks/lora_step.py --device cuda --steps 3 --work /dev/shm/lora_step \
  --out "$OUT/lora_step.md" 2>&1 | grep -v Warning | tail -6
# the planner's predicted CUDA peak vs max_memory_allocated over 2 Trainer steps; reuses the LoRA step's zero base
stamp "planner: predicted vs measured peak (DiT-XL/2 256px batch 8; flux-dev LoRA 16 at 512px)"
timeout "${PLAN_S:-50}" python3 benchmarks/plan_check.py --work /dev/shm/plan_check \
  --base /dev/shm/lora_step/base.safetensors --out "$OUT/plan_check.md" 2>&1 | grep -v Warning | tail -6
rm -rf /dev/shm/lora_step /dev/shm/plan_check
stamp "done"
