#!/usr/bin/env bash
# Launch FLUX training. RECIPE=digits (the built-in demo, CPU-sized: flux-debug on 16 px captioned digits through
# tiny random local T5 / CLIP encoders, made on first use), RECIPE=lora_digits (the LoRA demo: a flux-debug base
# trained on the digits 0-4 only, then a rank-8 LoRA on 5-9 with their captions beside prior images of 0-4 that
# the base made; benchmarks/lora_quality.py scores it) or RECIPE=finetune (a full fine-tune of flux-dev from the official weights with the memory-lean
# options). NGPU, MODEL and extra flags come from the environment / command line:
#   RECIPE=digits bash train_flux.sh                                             # CPU demo
#   RECIPE=lora_digits bash train_flux.sh                                        # CPU LoRA demo (extra flags: LoRA)
#   RECIPE=finetune FLUX=/models/FLUX.1-dev DATA=/data/my_images bash train_flux.sh
#   RECIPE=digits_shards bash train_flux.sh                                      # the demo from tar shards
#   RECIPE=cc12m NGPU=8 FLUX=/models/FLUX.1-schnell DATA=/data/cc12m/dataset.json VAL=/data/coco_val.json bash train_flux.sh
# RECIPE=cc12m is torchtitan's FLUX.1 [schnell] pretraining recipe (from scratch, 256 px, 64 samples per GPU, AdamW
# 1e-4 with 3,000 warm-up steps, clip 1.0, text dropout 0.447, 30,000 steps, full activation checkpointing, FSDP)
# streamed from a local copy of cc12m-wds (DATA: its shard list, python -m opendit.data.shards --list, or a pattern;
# each rank reads its own partition of the shards); VAL (optional): held-out shards scored every 1,000 steps at 8
# fixed timesteps (MLPerf's validation loss).
# FLUX is a local copy of the FLUX.1-dev repository (flux1-dev.safetensors, vae/, text_encoder/, tokenizer/,
# text_encoder_2/, tokenizer_2/); DATA a folder of images with a .txt caption beside each (or a CSV / JSONL of
# path,caption).
set -euo pipefail
NGPU=${NGPU:-1}
RECIPE=${RECIPE:-digits}
launch() {
  if [ "$NGPU" -gt 1 ]; then
    torchrun --standalone --nproc_per_node "$NGPU" train.py "$@"
  else
    python train.py "$@"
  fi
}
case "$RECIPE" in
  digits)
    MODEL=${MODEL:-flux-debug}
    ENC=${ENC:-outputs/flux_demo_encoders}
    [ -f "$ENC/t5/config.json" ] || python -m opendit.families.flux.tiny_t5 "$ENC/t5"
    [ -f "$ENC/clip/config.json" ] || python -m opendit.encoders.tiny_clip "$ENC/clip" --words digits
    set -- --model "$MODEL" --dataset captioned_digits --image_size 16 --vae none --t5 "$ENC/t5" --clip "$ENC/clip" \
      --batch_size 64 --lr 1e-3 --ema_decay 0.995 --max_steps 2000 --ckpt_every 1000 --log_every 100 \
      --num_workers 0 "$@" ;;
  lora_digits)
    # OUT/base: the base's run (skipped when its last checkpoint is there; an interrupted one resumes);
    # OUT/lora: a new LoRA run each time. BASE_STEPS, LORA_STEPS, BATCH and RANK size them. The LoRA stage has
    # no text dropout: every caption names a new digit (the empty caption, which CFG's negative uses, is left
    # as the base made it; with dropout the adapter forgets 0-4 faster).
    MODEL=${MODEL:-flux-debug}
    ENC=${ENC:-outputs/flux_demo_encoders}
    OUT=${OUT:-outputs/flux_lora_digits}
    BASE_STEPS=${BASE_STEPS:-1200}
    LORA_STEPS=${LORA_STEPS:-1200}
    BATCH=${BATCH:-64}
    RANK=${RANK:-8}
    PRIOR=${PRIOR:-10}                 # prior images per 0-4 caption (20 captions); 0: no prior preservation
    PRIOR_REPEATS=${PRIOR_REPEATS:-4}
    PRIOR_WEIGHT=${PRIOR_WEIGHT:-1.0}
    [ -f "$ENC/t5/config.json" ] || python -m opendit.families.flux.tiny_t5 "$ENC/t5"
    [ -f "$ENC/clip/config.json" ] || python -m opendit.encoders.tiny_clip "$ENC/clip" --words digits
    common=(--model "$MODEL" --dataset captioned_digits --image_size 16 --vae none --t5 "$ENC/t5" --clip "$ENC/clip"
            --batch_size "$BATCH" --ema_decay 0.995 --num_workers 0)
    last=$(printf 'step-%06d' "$BASE_STEPS")
    base=$(ls -d "$OUT"/base/*/checkpoints/"$last"/ema.safetensors 2>/dev/null | sort | tail -n 1 || true)
    if [ -z "$base" ]; then
      echo "== stage 1: the $MODEL base on the digits 0-4 ($BASE_STEPS steps) -> $OUT/base"
      start=$SECONDS
      launch "${common[@]}" --digits 0-4 --lr 1e-3 --max_steps "$BASE_STEPS" --ckpt_every "$BASE_STEPS" \
        --log_every 100 --load auto --outputs "$OUT/base"
      echo "== stage 1 took $((SECONDS - start)) s"
      base=$(ls -d "$OUT"/base/*/checkpoints/"$last"/ema.safetensors | sort | tail -n 1)
    else
      echo "== stage 1: done, the base is $base"
    fi
    data=(--digits 5-9)
    if [ "$PRIOR" -gt 0 ]; then  # prior preservation: the base's own 0-4 images, captioned, beside 5-9
      if [ ! -f "$OUT/prior/$(printf '%06d' $((PRIOR * 20 - 1))).txt" ]; then
        echo "== stage 1b: $PRIOR prior images per 0-4 caption, sampled from the base -> $OUT/prior"
        start=$SECONDS
        rm -rf "$OUT/prior"
        python -c "from opendit.data.captions import digit_caption as c; print('\n'.join(c(d, v) for d in range(5) for v in range(4)))" \
          > "$OUT/prior_prompts.txt"
        python -m opendit.prior --ckpt "$base" --prompts_file "$OUT/prior_prompts.txt" --num "$PRIOR" \
          --out "$OUT/prior" --cfg_scale 4 --num_sampling_steps 50 --batch_size 200
        echo "== stage 1b took $((SECONDS - start)) s"
      fi
      printf '[[datasets]]\nkind = "captioned_digits"\nname = "new digits 5-9"\ndigits = "5-9"\n\n[[datasets]]\nkind = "captions"\nname = "prior: the base on 0-4"\npath = "%s"\nprior = true\nrepeats = %s\n' \
        "$OUT/prior" "$PRIOR_REPEATS" > "$OUT/data.toml"
      data=(--dataset_config "$OUT/data.toml" --prior_loss_weight "$PRIOR_WEIGHT")
    fi
    start=$SECONDS
    echo "== stage 2: a rank-$RANK LoRA on the digits 5-9 ($LORA_STEPS steps) -> $OUT/lora"
    launch "${common[@]}" "${data[@]}" --init_weights "$base" --lora_rank "$RANK" --lr 2e-3 --text_dropout_prob 0 \
      --max_steps "$LORA_STEPS" --ckpt_every "$LORA_STEPS" --log_every 100 --outputs "$OUT/lora" "$@"
    echo "== stage 2 took $((SECONDS - start)) s"
    lora=$(ls -d "$OUT"/lora/*/checkpoints/step-* | sort | tail -n 1)
    echo "base (trained on 0-4): $base"
    echo "LoRA checkpoint (base + adapter): $lora"
    echo "adapter file (diffusers layout; kohya: lora_kohya.safetensors): $lora/lora.safetensors"
    echo "sample: python sample.py --ckpt $lora --prompts \"a handwritten seven\" --cfg_scale 4" \
      "  # or --ckpt $base --lora $lora/lora.safetensors"
    exit 0 ;;
  digits_shards)
    MODEL=${MODEL:-flux-debug}
    ENC=${ENC:-outputs/flux_demo_encoders}
    SHARDS=${SHARDS:-outputs/digit_shards}
    [ -f "$ENC/t5/config.json" ] || python -m opendit.families.flux.tiny_t5 "$ENC/t5"
    [ -f "$ENC/clip/config.json" ] || python -m opendit.encoders.tiny_clip "$ENC/clip" --words digits
    [ -f "$SHARDS/tar/dataset.json" ] || python -m opendit.data.shards --out "$SHARDS" --formats webdataset
    set -- --model "$MODEL" --dataset webdataset --data_path "$SHARDS/tar/dataset.json" --image_size 16 --vae none \
      --t5 "$ENC/t5" --clip "$ENC/clip" --batch_size 64 --lr 1e-3 --ema_decay 0.995 --max_steps 2000 \
      --ckpt_every 1000 --log_every 100 --num_workers 1 "$@" ;;
  cc12m)
    FLUX=${FLUX:?set FLUX to a local FLUX.1-schnell folder (vae/, text_encoder/, tokenizer/, text_encoder_2/, tokenizer_2/)}
    val=()
    [ -n "${VAL:-}" ] && val=(--val_every 1000 --val_data_path "$VAL" --val_samples 1024 --val_timesteps 8)
    set -- --model flux-schnell --dataset webdataset --data_path "${DATA:?set DATA to cc12m-wds shards (a .json list or a pattern)}" \
      --stream_partitions "$NGPU" --image_size 256 --vae "$FLUX/vae" --t5 "$FLUX" --clip "$FLUX" --t5_max_length 256 \
      --batch_size $((64 * NGPU)) --lr 1e-4 --warmup_steps 3000 --grad_clip 1.0 --max_steps 30000 \
      --text_dropout_prob 0.447 --plugin fsdp --grad_checkpoint 1 --mixed_precision bf16 --ckpt_every 1000 \
      --log_every 100 --load auto "${val[@]}" "$@" ;;
  finetune)
    MODEL=${MODEL:-flux-dev}
    FLUX=${FLUX:?set FLUX to a local FLUX.1-dev folder}
    set -- --model "$MODEL" --init_weights "$FLUX/flux1-dev.safetensors" --vae "$FLUX/vae" --t5 "$FLUX" \
      --clip "$FLUX" --dataset captions --data_path "${DATA:?set DATA to a folder of images with .txt captions}" \
      --image_size 1024 --batch_size "${BATCH:-1}" --lr 1e-5 --guidance 1.0 --mixed_precision bf16 \
      --master_weights bf16_exact --optimizer_offload --optimizer_state_dtype u16 --fused_backward \
      --grad_checkpoint 1 --blocks_to_swap "${SWAP:-45}" --ema_decay 0 --max_steps 2000 --ckpt_every 500 \
      --log_every 10 "$@" ;;
  *) echo "unknown RECIPE=$RECIPE (digits, digits_shards, lora_digits, finetune, cc12m)" >&2; exit 2 ;;
esac
if [ "$NGPU" -gt 1 ]; then
  exec torchrun --standalone --nproc_per_node "$NGPU" train.py "$@"
fi
exec python train.py "$@"
