"""Sample from a trained model: an EMA export, a training checkpoint folder, or a checkpoint a model family
knows (an official DiT or Latte .pt, a diffusers DiT folder, an official flux1-dev / flux1-schnell .safetensors).
The checkpoint's model family decides the noise, the conditioning, the sampler and the outputs (images:
images/NNNNNN.png, grid.png; video: videos/NNNNNN.mp4, strips/, grid.gif; with --npz samples.npz).

    python sample.py --ckpt latest --num_samples 20                       # newest checkpoint under ./outputs
    python sample.py --ckpt outputs/000-DiT-Ti-4/checkpoints/step-001000 --cfg_scale 2 --sampler ddim \\
        --num_sampling_steps 50
    torchrun --nproc_per_node 4 sample.py --ckpt DiT-XL-2-256x256.pt --image_size 256 --cfg_scale 4 --npz
    python sample.py --ckpt latest --prompt "a handwritten seven"         # a model trained on captions
    python sample.py --ckpt latest --height 16 --width 32                 # another size (whole patches; video
                                                                          # also --num_frames)
"""
from opendit import config as cfglib
from opendit.inference import sample_to_folder


def main(cfg: cfglib.SampleConfig) -> None:
    sample_to_folder(cfg)


if __name__ == "__main__":
    from opendit.cli import parse_config, run_entry  # a bad flag or file: one line `error: ...`, exit status 2

    run_entry(main, parse_config(cfglib.SampleConfig, __doc__), check=cfglib.check_config)
    from opendit.distributed import exit_process
    exit_process()
