"""FLUX quality benchmark: train flux-debug (or FLUX.2's flux2-klein-debug, through diffusers' own transformer) on
the captioned digits on the CPU (pixel space, tiny random local T5 and CLIP encoders, or Qwen3), sample from prompts
naming each digit ("a handwritten seven"), and ask an independent
classifier (trained on real digits only) which digit each sample shows.

    python benchmarks/flux_quality.py                      # the docs/flux.md figure (at most 20 min on 2 CPU cores)
    python benchmarks/flux_quality.py --model flux2-klein-debug    # the same for FLUX.2 [klein] (README's figure)
    python benchmarks/flux_quality.py --max_steps 20 --samples_per_digit 2 --sampling_steps 5     # smoke run
    python benchmarks/flux_quality.py --dataset webdataset   # the same digits streamed from tar shards (written by
                                                             # python -m opendit.data.shards when missing)

Prints: the classifier's accuracy on real held-out digits, and the share of samples showing the digit their
prompt names (target >= 80%).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.digits_quality import train_classifier  # noqa: E402
from opendit import config as cfglib  # noqa: E402
from opendit.data.captions import DIGIT_WORDS  # noqa: E402
from benchmarks.bench_common import sample_checkpoint  # noqa: E402


def encoders(folder: Path, model: str) -> dict:
    """The model's tiny random text encoders over the demo's words, as flags (what train_flux.sh's and
    train_flux2.sh's digits recipes make): FLUX.1 T5 and CLIP, FLUX.2 [klein] Qwen3."""
    from opendit.encoders.tiny_clip import save_tiny_clip
    from opendit.families import family_of
    from opendit.families.flux.tiny_t5 import save_tiny_t5
    from opendit.families.wrapped.flux2 import save_tiny_qwen3

    made = {"flux": dict(t5=save_tiny_t5, clip=lambda f: save_tiny_clip(f, words="digits")),
            "flux2": dict(text_encoder=save_tiny_qwen3)}[family_of(model).name]
    for flag, save in made.items():
        if not (folder / flag / "config.json").is_file():
            save(folder / flag)
    return {flag: str(folder / flag) for flag in made}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux-debug")
    p.add_argument("--image_size", type=int, default=16)
    p.add_argument("--max_steps", type=int, default=2000)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ema_decay", type=float, default=0.995)
    p.add_argument("--samples_per_digit", type=int, default=20)
    p.add_argument("--cfg_scale", type=float, default=4.0, help="true classifier-free guidance (empty negative)")
    p.add_argument("--sampling_steps", type=int, default=50)
    p.add_argument("--outputs", default="outputs/flux_quality")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", default=None, help="evaluate this checkpoint instead of training one")
    p.add_argument("--dataset", default="captioned_digits", choices=("captioned_digits", "webdataset", "parquet"),
                   help="the built-in digits, or the same digits as tar shards / Parquet files under OUTPUTS/shards")
    a = p.parse_args()
    text = encoders(Path(a.outputs) / "encoders", a.model)
    data = {}
    if a.dataset != "captioned_digits":
        from opendit.data.shards import write

        data = dict(data_path=write(str(Path(a.outputs) / "shards"), formats=(a.dataset,),
                                    image_size=a.image_size)[a.dataset])

    train_s = 0.0
    ckpt = a.ckpt
    if ckpt is None:
        from opendit.training.loop import Trainer

        t0 = time.time()
        trainer = Trainer(cfglib.TrainConfig(
            model=a.model, dataset=a.dataset, **data, image_size=a.image_size, vae="none", **text,
            batch_size=a.batch_size, lr=a.lr, ema_decay=a.ema_decay, max_steps=a.max_steps, ckpt_every=a.max_steps,
            log_every=max(1, a.max_steps // 20), num_workers=0, outputs=a.outputs, global_seed=a.seed))
        trainer.train()
        train_s = time.time() - t0
        ckpt = str(sorted((trainer.run_dir / "checkpoints").glob("step-*"))[-1])

    prompts = [f"a handwritten {word}" for word in DIGIT_WORDS]
    sample_cfg = cfglib.SampleConfig(ckpt=ckpt, cfg_scale=a.cfg_scale, num_sampling_steps=a.sampling_steps,
                                     seed=a.seed, prompts=prompts)
    n = 10 * a.samples_per_digit
    images, sample_s = sample_checkpoint(sample_cfg, prompts, n)
    wanted = np.array([i % 10 for i in range(n)])
    x = images.reshape(n, -1).astype(np.float32) / 127.5 - 1.0  # same scaling as the real digits

    clf, real_acc = train_classifier(a.image_size)
    gen_acc = float((clf.predict(x) == wanted).mean())
    result = dict(model=a.model, dataset=a.dataset, image_size=a.image_size, steps=a.max_steps, batch_size=a.batch_size,
                  cfg_scale=a.cfg_scale, sampling_steps=a.sampling_steps, train_seconds=round(train_s, 1),
                  sample_seconds=round(sample_s, 1), samples=n, classifier_accuracy_real_held_out=round(real_acc, 4),
                  prompted_digit_accuracy=round(gen_acc, 4))
    print(json.dumps(result, indent=1))
    print(f"\nclassifier on real held-out digits: {real_acc:.1%}; samples showing the prompt's digit: {gen_acc:.1%} "
          f"(target >= 80%); training {train_s / 60:.1f} min, sampling {sample_s / 60:.1f} min")


if __name__ == "__main__":
    main()
