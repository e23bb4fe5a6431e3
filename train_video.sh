#!/usr/bin/env bash
# Launch video DiT training. NGPU, MODEL and extra flags come from the environment / command line.
#   RECIPE=wan_digits bash train_video.sh      # text-to-video demo on CPUs: Wan-debug on captioned 3-frame 16 px
#                                              # moving digits (4 px a frame), flow matching, a tiny local UMT5
#   RECIPE=wan22_i2v_digits bash train_video.sh   # image-to-video demo: Wan2.2-I2V-debug, the same clips, each
#                                              # conditioned on its own first frame (I2V-A14B's mask + latent)
#   RECIPE=moving_digits bash train_video.sh   # the class-conditional demo: Latte-Ti/4 on 3-frame 16 px clips,
#                                              # flow matching (98% of frames show the digit; IDDPM's 79%)
#   RECIPE=wan_t2v_1_3b WAN=/models/Wan2.1-T2V-1.3B-Diffusers DATA=/data/clips.csv NGPU=8 bash train_video.sh
#       # full fine-tune of Wan2.1-T2V-1.3B from a local diffusers Wan folder (transformer/, vae/, text_encoder/,
#       # tokenizer/) on a CSV of path,caption: 33 frames at 480 px, bf16, zero2; on one GPU: NGPU=1 adds the
#       # memory-lean options (offloaded u16 states, fused backward, block swap)
#   RECIPE=wan22_ti2v_5b WAN=/models/Wan2.2-TI2V-5B-Diffusers DATA=/data/clips.csv bash train_video.sh
#       # full fine-tune of Wan2.2-TI2V-5B on one GPU (lean options, 49 frames at 704 px, the 16x Wan2.2 VAE); a
#       # share --i2v_prob of the clips (default 0.2) is trained image-to-video from its own first frame
#   RECIPE=wan22_a14b_expert WAN=/models/Wan2.2-I2V-A14B-Diffusers EXPERT=high DATA=/data/clips.csv NGPU=8 \
#       bash train_video.sh     # one expert of an A14B release (MODEL=Wan2.2-T2V-A14B for text-to-video), zero3
#       # and sequence parallel 4, on its side of the boundary; run again with EXPERT=low for the other one
#   RECIPE=ucf101 NGPU=8 DATA=/data/ucf101/train.csv bash train_video.sh --plugin zero2 --mixed_precision bf16
#       # Latte's paper setting: Latte-XL/2, 16 frames every 3rd, 256 px, UCF-101's 101 classes (path,label)
set -euo pipefail
NGPU=${NGPU:-1}
RECIPE=${RECIPE:-wan_digits}
case "$RECIPE" in
  wan_digits|wan22_i2v_digits)
    [ "$RECIPE" = wan22_i2v_digits ] && MODEL=${MODEL:-Wan2.2-I2V-debug}
    MODEL=${MODEL:-Wan-debug}
    ENC=${ENC:-outputs/wan_demo_umt5}
    [ -f "$ENC/config.json" ] || python -m opendit.families.wan.tiny_umt5 "$ENC"
    set -- --model "$MODEL" --dataset moving_digits --image_size 16 --num_frames 3 --frame_interval 4 --vae none \
      --umt5 "$ENC" --batch_size 32 --lr 2e-3 --ema_decay 0.995 --max_steps 5000 --ckpt_every 2500 --log_every 250 \
      --sample_every 1000 --num_workers 0 "$@" ;;
  wan_t2v_1_3b)
    MODEL=${MODEL:-Wan2.1-T2V-1.3B}
    WAN=${WAN:?set WAN to a local Wan2.1-T2V-1.3B-Diffusers folder}
    if [ "$NGPU" -gt 1 ]; then LEAN=(--plugin zero2); else
      LEAN=(--master_weights bf16_exact --optimizer_offload --optimizer_state_dtype u16 --fused_backward \
            --blocks_to_swap "${SWAP:-20}"); fi
    set -- --model "$MODEL" --init_weights "$WAN" --vae "$WAN/vae" --umt5 "$WAN" --dataset video_csv \
      --data_path "${DATA:?set DATA to a CSV of path,caption}" --image_size 480 --num_frames 33 \
      --batch_size "${BATCH:-1}" --lr 1e-5 --weight_decay 0 --mixed_precision bf16 --grad_checkpoint 1 \
      "${LEAN[@]}" --ema_decay 0 --max_steps 2000 --ckpt_every 500 --log_every 10 "$@" ;;
  wan22_ti2v_5b)
    MODEL=${MODEL:-Wan2.2-TI2V-5B}
    WAN=${WAN:?set WAN to a local Wan2.2-TI2V-5B-Diffusers folder}
    set -- --model "$MODEL" --init_weights "$WAN" --vae "$WAN/vae" --umt5 "$WAN" --dataset video_csv \
      --data_path "${DATA:?set DATA to a CSV of path,caption}" --image_size 704 --num_frames 49 \
      --batch_size "${BATCH:-1}" --lr 1e-5 --weight_decay 0 --mixed_precision bf16 --grad_checkpoint 1 \
      --master_weights bf16_exact --optimizer_offload --optimizer_state_dtype u16 --fused_backward \
      --blocks_to_swap "${SWAP:-10}" --ema_decay 0 --max_steps 2000 --ckpt_every 500 --log_every 10 "$@" ;;
  wan22_a14b_expert)
    MODEL=${MODEL:-Wan2.2-I2V-A14B}
    WAN=${WAN:?set WAN to a local Wan2.2 A14B folder (diffusers: transformer/ + transformer_2/, vae/, text_encoder/)}
    set -- --model "$MODEL" --init_weights "$WAN" --expert "${EXPERT:?set EXPERT to high or low}" --vae "$WAN/vae" \
      --umt5 "$WAN" --dataset video_csv --data_path "${DATA:?set DATA to a CSV of path,caption}" --image_size 480 \
      --num_frames 33 --batch_size "${BATCH:-8}" --lr 1e-5 --weight_decay 0 --mixed_precision bf16 \
      --grad_checkpoint 1 --plugin zero3 --sequence_parallel_size "${SP:-4}" --ema_decay 0 --max_steps 2000 \
      --ckpt_every 500 --log_every 10 "$@" ;;
  moving_digits)
    MODEL=${MODEL:-Latte-Ti/4}
    set -- --model "$MODEL" --dataset moving_digits --image_size 16 --num_frames 3 --vae none --batch_size 48 \
      --lr 2e-3 --ema_decay 0.995 --max_steps 1500 --objective flow --ckpt_every 500 --log_every 50 --num_workers 0 \
      "$@" ;;
  ucf101)
    MODEL=${MODEL:-Latte-XL/2}
    set -- --model "$MODEL" --dataset video_csv --data_path "${DATA:?set DATA to a CSV of path,label (UCF-101)}" \
      --image_size 256 --num_frames 16 --frame_interval 3 --vae "${VAE:-stabilityai/sd-vae-ft-ema}" \
      --batch_size 40 --lr 1e-4 --weight_decay 0 --ema_decay 0.9999 --max_steps 150000 --ckpt_every 10000 \
      --log_every 100 "$@" ;;
  *) echo "unknown RECIPE=$RECIPE (wan_digits, wan22_i2v_digits, moving_digits, wan_t2v_1_3b, wan22_ti2v_5b, wan22_a14b_expert, ucf101)" >&2; exit 2 ;;
esac
if [ "$NGPU" -gt 1 ]; then
  exec torchrun --standalone --nproc_per_node "$NGPU" train.py "$@"
fi
exec python train.py "$@"
