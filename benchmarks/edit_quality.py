"""Editing quality: train FLUX.1 Kontext's CPU-sized model (flux1-kontext-debug-diffusers, pixel space, a tiny random
CLIP + T5 over the instructions' words) on the edit-digits pairs of the training split, then edit held-out digits
(never seen in training) with each instruction and score the edits:

- "the next digit": the share of edits an independent classifier (an SVM trained on real digits only) reads as the
  next digit (target >= 90%);
- "mirror it", "rotate it a quarter turn", "make the strokes thicker": the share of edits within DISTANCE (mean
  absolute pixel difference, pixels in [0, 1]) of the input transformed exactly (target >= 90%); beside it the same
  share for the input returned unedited, the baseline an edit must beat;
- kept: the share of edits that keep the background, >= 95% of the pixels away from the intended image's strokes
  (more than one pixel away) staying dark.

    python benchmarks/edit_quality.py                     # README's figures (at most 20 min on 2 CPU cores)
    python benchmarks/edit_quality.py --max_steps 20 --samples_per_edit 4 --sampling_steps 4     # smoke run
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image
from scipy.ndimage import maximum_filter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import sample_checkpoint  # noqa: E402
from benchmarks.digits_quality import train_classifier  # noqa: E402
from opendit import config as cfglib  # noqa: E402
from opendit.data.edit_pairs import EDITS, EditDigitsDataset  # noqa: E402

MODEL = "flux1-kontext-debug-diffusers"
DISTANCE = 0.1  # mean absolute pixel difference (pixels in [0, 1]) an exact edit's neighbourhood spans
DARK, INK = 0.25, 0.5  # a background pixel kept is below DARK; a stroke pixel is above INK


def edit_scores(edited: np.ndarray, inputs: np.ndarray, intended: np.ndarray) -> dict:
    """uint8 [N, S, S] edits, their inputs and the exact edits -> the shares within DISTANCE (of the edits; of the
    inputs unedited) and of edits keeping the background."""
    def near(a):
        return float((np.abs(a / 255.0 - intended / 255.0).mean((1, 2)) <= DISTANCE).mean())
    away = ~maximum_filter(intended / 255.0 > INK, size=(1, 3, 3))  # more than one pixel from a stroke
    dark = ((edited / 255.0 < DARK) | ~away).mean((1, 2)) >= 0.95
    return dict(within=near(edited), unedited_within=near(inputs), kept=float(dark.mean()))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image_size", type=int, default=12)
    p.add_argument("--max_steps", type=int, default=4000)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ema_decay", type=float, default=0.995)
    p.add_argument("--caption_dropout_prob", type=float, default=0.1, help="drops the instruction this often: what "
                   "classifier-free guidance needs")
    p.add_argument("--cfg_scales", type=float, nargs="+", default=[1.0, 4.0], help="edits sampled at each (1: off)")
    p.add_argument("--samples_per_edit", type=int, default=100)
    p.add_argument("--sampling_steps", type=int, default=20)
    p.add_argument("--outputs", default="outputs/edit_quality")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", default=None, help="evaluate this checkpoint instead of training one")
    a = p.parse_args()
    from opendit.families.wrapped.tiny_text import write_text_encoder
    out = Path(a.outputs)
    text = write_text_encoder(MODEL, out / "text_encoder", "edit_digits")

    train_s, ckpt = 0.0, a.ckpt
    if ckpt is None:
        from opendit.training.loop import Trainer
        t0 = time.time()
        trainer = Trainer(cfglib.TrainConfig(
            model=MODEL, dataset="edit_digits", image_size=a.image_size, vae="none", text_encoder=text,
            batch_size=a.batch_size, lr=a.lr, ema_decay=a.ema_decay, max_steps=a.max_steps, ckpt_every=a.max_steps,
            caption_dropout_prob=a.caption_dropout_prob, log_every=max(1, a.max_steps // 20), num_workers=0,
            outputs=a.outputs, global_seed=a.seed))
        trainer.train()
        train_s = time.time() - t0
        ckpt = str(sorted((trainer.run_dir / "checkpoints").glob("step-*"))[-1])

    held = EditDigitsDataset(a.image_size, split="held_out")
    n = min(a.samples_per_edit, len(held))
    inputs = np.stack([np.asarray(held._pixels(i, -1)) for i in range(n)])
    clf, real_acc = train_classifier(a.image_size)
    folder = out / "inputs"
    folder.mkdir(parents=True, exist_ok=True)
    for f in folder.glob("*.png"):
        f.unlink()
    for i, x in enumerate(inputs):
        Image.fromarray(x).save(folder / f"{i:04d}.png")
    rows, sample_s = {}, 0.0
    for cfg_scale in a.cfg_scales:
        for e, instruction in enumerate(EDITS):
            sample_cfg = cfglib.SampleConfig(ckpt=ckpt, cfg_scale=cfg_scale, num_sampling_steps=a.sampling_steps,
                                             seed=a.seed, prompts=[instruction] * n, image=str(folder))
            images, seconds = sample_checkpoint(sample_cfg, [instruction] * n, n)
            sample_s += seconds
            edited, key = images[..., 0], f"cfg {cfg_scale:g}: {instruction}"
            if e == 0:
                wanted = (held._labels[:n] + 1) % 10
                x = edited.reshape(n, -1).astype(np.float32) / 127.5 - 1.0  # as the classifier's real digits
                rows[key] = dict(next_digit_read=float((clf.predict(x) == wanted).mean()))
            else:
                intended = np.stack([np.asarray(held._pixels(i, e)) for i in range(n)])
                rows[key] = edit_scores(edited, inputs, intended)
    result = dict(model=MODEL, image_size=a.image_size, steps=a.max_steps, batch_size=a.batch_size,
                  caption_dropout_prob=a.caption_dropout_prob,
                  sampling_steps=a.sampling_steps, edits_each=n, distance=DISTANCE,
                  classifier_accuracy_real_held_out=round(real_acc, 4), train_seconds=round(train_s, 1),
                  sample_seconds=round(sample_s, 1),
                  edits={k: {m: round(v, 4) for m, v in r.items()} for k, r in rows.items()})
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
