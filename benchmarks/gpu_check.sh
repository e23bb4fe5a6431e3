#!/usr/bin/env bash
# Every GPU check and benchmark, for a short lease on one GPU (H200). Run from the repository root; no install
# (PYTHONPATH=.). One device command may run 600 s, so a stage starts only when its timeout still fits in
# TOTAL_S (default 570 s); the stages that did not fit are printed with the command that runs them next:
#   OUT=$OUT bash benchmarks/gpu_check.sh                 # part 1 and as much of part 2 as fits (~9.5 min)
#   OUT=$OUT PART=2 bash benchmarks/gpu_check.sh          # part 2 alone (~10 min), in a second call
# Part 1 (~7.5 min on an H200, 2026-12-04): DiT training and sampling throughput, kernels, optimizer offload,
# the gpu-marked tests, the FID Inception, train.py / sample.py smoke runs (image and video), FLUX cached
# sampling, the lean Wan2.1-1.3B step, FLUX.2 [klein] and Z-Image LoRA steps, the planner's predicted vs measured
# peak for each family's debug model (at most 90 s, not yet timed on a GPU). Part 2 (~11 min): editing LoRA steps
# with a reference (Kontext [dev], Qwen-Image-Edit-2511), opendit vs diffusers on the same weights (at most 240 s),
# then flux-dev (12B) rows, whose set-up reads a 24 GB base of
# zeros on the host: the LoRA step, the lean full fine-tune under 16 GiB, the lean Wan2.2-TI2V-5B step, the
# planner's predicted vs measured peak.
# Each stage's output lands under $WORK (default /tmp/gpu_check); $OUT/gpu_check.tgz holds all of it and is
# rewritten after every stage (the device tool returns at most 8 files), $OUT/log.txt the whole log.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_results}
WORK=${WORK:-/tmp/gpu_check}
PART=${PART:-all}
TOTAL_S=${TOTAL_S:-570}
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/log.txt") 2>&1
start=$(date +%s)
SKIPPED=()
pack() { tar czf "$OUT/gpu_check.tgz" -C "$WORK" . 2>/dev/null; }
# stage PART SECONDS TITLE: true when the stage belongs to PART and its SECONDS still fit in TOTAL_S
stage() {
  pack
  [[ $PART == all || $PART == "$1" ]] || return 1
  local used=$(( $(date +%s) - start ))
  if (( used + $2 > TOTAL_S )); then SKIPPED+=("part $1: $3 (${2} s)"); return 1; fi
  echo "== $3 (t=${used} s, at most ${2} s)"
}
quiet() { grep -v Warning; }

stage 1 5 "device" && { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  2>&1 | tee "$WORK/device.txt"

# a, ours (per-block compile) and b (whole-model compile, the slowest to compile) first, then the single-flag
# rows while --time_budget lasts; the table is rewritten after every row, so a timeout keeps the finished ones
S=${THROUGHPUT_S:-110}
stage 1 "$S" "training throughput (DiT-XL/2, 256px, batch 256)" && timeout "$S" python3 \
  benchmarks/train_throughput.py --model DiT-XL/2 --image_size 256 --batch_size 256 --recipe_batch_size 32 \
  --warmup 3 --steps 8 --time_budget $(( S - 35 )) --out "$WORK/train_throughput.md" --profile all \
  --profile_out "$WORK/step_profile.md" 2>&1 | quiet | tail -60

S=${SAMPLING_S:-35}
stage 1 "$S" "sampling throughput (DiT-XL/2, 256px, batch 256, cfg 4: 512 per model call)" && timeout "$S" \
  python3 benchmarks/sample_throughput.py --model DiT-XL/2 --image_size 256 --batch_size 256 --steps 10 \
  --warmup_steps 2 --time_budget $(( S - 8 )) --out "$WORK/sampling.md" 2>&1 | quiet | tail -14

S=${KERNELS_S:-40}
stage 1 "$S" "kernel benchmark" && timeout "$S" python3 benchmarks/kernel_speed.py 2>&1 \
  | tee "$WORK/kernels.md" | tail -30

S=${OPTIM_S:-90}
stage 1 "$S" "optimizer offload (DiT-XL/2, batch 32)" && timeout "$S" python3 benchmarks/optim_offload.py \
  --batch_size 32 --steps 4 --out "$WORK/optim_offload.md" 2>&1 | quiet | tail -12

S=${TESTS_S:-50}
stage 1 "$S" "gpu tests (kernels bf16 on CUDA, compile, fused backward, block swap, fp8 LoRA base)" && timeout "$S" \
  python3 -m pytest -q -p no:cacheprovider -x tests/test_kernels.py tests/test_attention.py \
  tests/test_kernels_compile.py tests/test_perf.py tests/test_optim_fused.py tests/test_optim_multi_tensor.py \
  tests/test_block_swap.py tests/test_lora_fp8.py -m gpu 2>&1 | tail -25 | tee "$WORK/gpu_tests.txt"

stage 1 15 "opendit.eval on CUDA: the FID Inception (random weights) through the CLI, FID / IS / precision-recall" \
  && timeout 15 python3 -m pytest -q -p no:cacheprovider tests/test_eval.py \
  -k "real_inception_architecture or identical_sets" 2>&1 | tail -6 | tee "$WORK/eval_tests.txt"

FAST="--model DiT-B/4 --image_size 32 --batch_size 64 --log_every 2 --num_workers 0 --mixed_precision bf16
  --master_weights fp32_copy"
stage 1 100 "train.py on CUDA: the one-GPU fast path (ddp, bf16 weights + fp32_copy master, kernels, flash, compile), resume; zero2 with validation and a preview" \
  && { rm -rf /tmp/gpu_train /tmp/gpu_train_zero2
  timeout 40 python3 train.py $FAST --max_steps 6 --ckpt_every 3 --enable_modulate_kernel --enable_layernorm_kernel \
    --enable_flashattn --compile --outputs /tmp/gpu_train \
  && timeout 30 python3 train.py $FAST --max_steps 8 --outputs /tmp/gpu_train --load latest \
  && timeout 30 python3 train.py --model DiT-B/4 --image_size 32 --batch_size 64 --max_steps 4 --log_every 2 \
    --num_workers 0 --plugin zero2 --mixed_precision bf16 --enable_modulate_kernel --val_every 2 --val_samples 64 \
    --sample_every 4 --preview_steps 10 --outputs /tmp/gpu_train_zero2 \
  && ls /tmp/gpu_train_zero2/*/previews; } 2>&1 | quiet | tail -20 | tee "$WORK/train_smoke.txt"

stage 1 40 "video on CUDA: Latte-S/2 on moving digits (bf16 weights + fp32_copy, kernels, flash), then sample.py" \
  && { rm -rf /tmp/gpu_video
  timeout 25 python3 train.py --model Latte-S/2 --dataset moving_digits --image_size 32 --num_frames 8 \
    --batch_size 16 --max_steps 4 --log_every 2 --num_workers 0 --mixed_precision bf16 --master_weights fp32_copy \
    --enable_modulate_kernel --enable_layernorm_kernel --enable_flashattn --outputs /tmp/gpu_video \
  && timeout 15 python3 sample.py --ckpt latest --outputs /tmp/gpu_video --num_samples 4 --num_sampling_steps 10 \
    --mixed_precision bf16 --enable_flashattn --out /tmp/gpu_video/samples; } 2>&1 | quiet | tail -8 \
  | tee "$WORK/video_smoke.txt"

S=${FLUX_CACHE_S:-30}
stage 1 "$S" "FLUX cached sampling: flux-dev 1024px, 10 Euler steps, --cache none / teacache / fbcache (random weights)" \
  && timeout "$S" python3 benchmarks/flux_cache_sampling.py --steps 10 --out "$WORK/flux_cache.md" 2>&1 \
  | quiet | tail -8

S=${WAN_S:-60}
stage 1 "$S" "Wan: Wan2.1-T2V-1.3B 33 x 480 x 480 full fine-tune step (lean options; synthetic cache), vs wan_memory.py's plan" \
  && timeout "$S" python3 benchmarks/wan_lean_step.py --steps 3 --out "$WORK/wan_lean.md" 2>&1 | quiet | tail -8

# diffusers' own transformers: the device has no diffusers; a carried .whl/ folder (benchmarks/README.md) brings it
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
S=${WRAPPED_S:-120}
stage 1 "$S" "diffusers' transformers: FLUX.2 [klein] 4B, Z-Image, Qwen-Image and Chroma1-HD LoRA 16 steps at 1024px (random weights, synthetic conditions, bf16, checkpointing)" \
  && { python3 -c "import diffusers" 2>/dev/null || echo "no diffusers here: carry its wheel in .whl/ (benchmarks/README.md)"; } \
  && for m in flux2-klein-4b z-image qwen-image chroma1-hd; do timeout $((S / 4)) python3 benchmarks/wrapped_step.py --device cuda \
  --model "$m" --image_size 1024 --lora_rank 16 --out "$WORK/wrapped_step.md" 2>&1 | quiet | tail -3; done
S=${PLAN_FAMILIES_S:-90}
stage 1 "$S" "planner per family: predicted vs measured peak of 2 steps of each family's debug model (pixel space, 64 px, video 5 frames, the batch that plans >= 256 MiB; bf16)" \
  && timeout "$S" python3 benchmarks/plan_check.py --families --device cuda --work /dev/shm/plan_families \
  --out "$WORK/plan_families.md" 2>&1 | quiet | tail -30
rm -rf /dev/shm/plan_families
S=${EDIT_S:-90}
stage 2 "$S" "editing: FLUX.1 Kontext [dev] and Qwen-Image-Edit-2511 LoRA 16 at 1024px with one reference each (its tokens join the target's: Qwen's at its pipeline's 1024x1024 area; random weights, synthetic conditions, bf16, checkpointing)" \
  && for m in flux1-kontext-dev-diffusers qwen-image-edit-2511; do timeout $((S / 2)) python3 benchmarks/wrapped_step.py \
  --device cuda --model "$m" --image_size 1024 --lora_rank 16 --references 1 --out "$WORK/wrapped_step.md" 2>&1 | quiet \
  | tail -3; done
S=${LTX2_S:-60}
stage 1 "$S" "LTX-2 19B LoRA rank 16, 3 steps of 25 frames at 512px (random weights, synthetic conditions, bf16, checkpointing)" \
  && timeout "$S" python3 benchmarks/wrapped_step.py --device cuda --model ltx2-19b --image_size 512 --num_frames 25 \
  --lora_rank 16 --out "$WORK/wrapped_step.md" 2>&1 | quiet | tail -3

S=${VS_DIFFUSERS_S:-240}
stage 2 "$S" "opendit vs diffusers on the same weights (DiT-XL, Latte-XL, FLUX.1 3072 wide, Wan2.1-1.3B wide; bf16 autocast; training and CFG sampling steps, eager then compiled; then LoRA 16 against PEFT)" \
  && { timeout $((S * 2 / 3)) python3 benchmarks/vs_diffusers.py --device cuda --size gpu --dtype bf16 --repeats 5 \
  2>&1 | quiet | tee "$WORK/vs_diffusers.md" | grep "^|\|FAIL\|Error"
  timeout $((S / 3)) python3 benchmarks/vs_diffusers.py --device cuda --size gpu --dtype bf16 --repeats 5 --lora 16 \
  2>&1 | quiet | tee "$WORK/vs_diffusers_lora.md" | grep "^|\|FAIL\|Error"; }

# part 2: flux-dev (12B). The LoRA step writes the zero base (11 s) that the lean step and the planner reuse.
BASE=/dev/shm/lora_step/base.safetensors
S=${LORA_S:-100}
stage 2 "$S" "LoRA: flux-dev rank 16 at 1024px (bf16 base of zeros written to /dev/shm, grad checkpointing; synthetic cache)" \
  && timeout "$S" python3 benchmarks/lora_step.py --device cuda --steps 3 --work /dev/shm/lora_step \
  --out "$WORK/lora_step.md" 2>&1 | quiet | tail -6

S=${LORA_FP8_S:-100}
stage 2 "$S" "LoRA: the same with --base_dtype fp8 (the blocks' frozen Linear weights in e4m3, upcast per layer)" \
  && timeout "$S" python3 benchmarks/lora_step.py --device cuda --steps 3 --work /dev/shm/lora_step --base_dtype fp8 \
  --out "$WORK/lora_step_fp8.md" 2>&1 | quiet | tail -6

S=${FLUX_S:-120}
stage 2 "$S" "FLUX: flux-dev 1024px full fine-tune step under a 16 GiB cap (lean options, block swap; synthetic cache, base of zeros)" \
  && timeout "$S" python3 benchmarks/flux_lean_step.py --steps 3 --base "$BASE" --out "$WORK/flux_lean.md" 2>&1 \
  | quiet | tail -12

S=${WAN22_S:-75}
stage 2 "$S" "Wan2.2: Wan2.2-TI2V-5B 49 x 704 x 704 full fine-tune step (48-channel 16x VAE latents; lean options; synthetic cache, base of zeros)" \
  && timeout "$S" python3 benchmarks/wan_lean_step.py --model Wan2.2-TI2V-5B --num_frames 49 --height 704 \
  --width 704 --steps 3 --base /dev/shm/wan22_base.safetensors --out "$WORK/wan22_lean.md" 2>&1 | quiet | tail -8

S=${PLAN_S:-80}
stage 2 "$S" "planner: predicted vs measured peak (DiT-XL/2 256px batch 8; flux-dev LoRA 16 at 512px)" \
  && timeout "$S" python3 benchmarks/plan_check.py --work /dev/shm/plan_check --base "$BASE" \
  --out "$WORK/plan_check.md" 2>&1 | quiet | tail -6
rm -rf /dev/shm/lora_step /dev/shm/plan_check /dev/shm/wan22_base.safetensors

pack
echo "== done (t=$(( $(date +%s) - start )) s); results: $OUT/gpu_check.tgz"
if (( ${#SKIPPED[@]} )); then
  printf 'not run (TOTAL_S %s s spent):\n' "$TOTAL_S"; printf '  %s\n' "${SKIPPED[@]}"
  echo "run them in the next call: OUT=\$OUT PART=2 bash benchmarks/gpu_check.sh (or PART=1)"
fi
