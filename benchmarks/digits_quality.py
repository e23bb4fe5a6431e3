"""Digits quality benchmark: train a small DiT on the built-in digits on the CPU, sample every class from the
EMA, and ask an independent classifier (trained on real digits only) which digit each sample shows.

    python benchmarks/digits_quality.py                    # the README demo's recipe (RECIPE=digits bash train_img.sh)
    python benchmarks/digits_quality.py --eval_every 200 --max_steps 2000   # the quality-vs-steps curve
    python benchmarks/digits_quality.py --max_steps 50 --samples_per_class 4    # smoke run

Prints: the classifier's accuracy on real held-out digits, and on the generated samples (target >= 95% for the
demo recipe); with --eval_every, one row per evaluated checkpoint: steps, training minutes to reach it, accuracy.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opendit import config as cfglib  # noqa: E402
from opendit.data import DigitsDataset  # noqa: E402
from benchmarks.bench_common import sample_checkpoint  # noqa: E402

# The demo recipe of train_img.sh (RECIPE=digits): keep the two in step.
RECIPE = dict(model="DiT-Ti/4", image_size=8, batch_size=64, lr=1e-3, ema_decay=0.995, max_steps=1000)


def train_classifier(image_size: int):
    """An RBF SVM on real digits at the samples' resolution -> (classifier, accuracy on real held-out digits)."""
    from sklearn.svm import SVC

    def arrays(split):
        ds = DigitsDataset(image_size, split=split)
        items = [ds[i] for i in range(len(ds))]
        return np.stack([x.numpy().ravel() for x, _ in items]), np.array([y for _, y in items])

    (x_train, y_train), (x_held, y_held) = arrays("train"), arrays("held_out")
    clf = SVC(gamma="scale", C=10.0).fit(x_train, y_train)
    return clf, float((clf.predict(x_held) == y_held).mean())


def score(ckpt: Path, clf, a) -> tuple[float, float]:
    """(share of samples the classifier names right, sampling seconds) of one checkpoint's EMA."""
    sample_cfg = cfglib.SampleConfig(ckpt=str(ckpt), cfg_scale=a.cfg_scale, num_sampling_steps=a.sampling_steps,
                                     sampler="ddpm", seed=a.seed)
    labels, n = list(range(10)), 10 * a.samples_per_class
    images, seconds = sample_checkpoint(sample_cfg, labels, n)
    wanted = np.array([labels[i % 10] for i in range(n)])
    x = images.reshape(n, -1).astype(np.float32) / 127.5 - 1.0  # same scaling as the real digits
    return float((clf.predict(x) == wanted).mean()), seconds


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=RECIPE["model"])
    p.add_argument("--image_size", type=int, default=RECIPE["image_size"])
    p.add_argument("--max_steps", type=int, default=RECIPE["max_steps"])
    p.add_argument("--batch_size", type=int, default=RECIPE["batch_size"])
    p.add_argument("--lr", type=float, default=RECIPE["lr"])
    p.add_argument("--ema_decay", type=float, default=RECIPE["ema_decay"])
    p.add_argument("--eval_every", type=int, default=0, help="also evaluate every N steps' checkpoint (the curve)")
    p.add_argument("--samples_per_class", type=int, default=20)
    p.add_argument("--cfg_scale", type=float, default=2.0)
    p.add_argument("--sampling_steps", type=int, default=100)
    p.add_argument("--outputs", default="outputs/digits_quality")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    from opendit.training.loop import Trainer

    every = a.eval_every or a.max_steps
    train_cfg = cfglib.TrainConfig(model=a.model, dataset="digits", image_size=a.image_size, num_classes=10,
                                   vae="none", batch_size=a.batch_size, lr=a.lr, ema_decay=a.ema_decay,
                                   max_steps=a.max_steps, ckpt_every=every, keep_last=a.max_steps // every + 1,
                                   log_every=max(1, a.max_steps // 20), num_workers=0, outputs=a.outputs,
                                   global_seed=a.seed)
    t0 = time.time()
    trainer = Trainer(train_cfg)
    trainer.train()
    train_s = time.time() - t0
    ckpts = sorted((trainer.run_dir / "checkpoints").glob("step-*"))
    reached = {c: (c / "meta.json").stat().st_mtime - t0 for c in ckpts}  # training time to each checkpoint

    clf, real_acc = train_classifier(a.image_size)
    rows = []
    for ckpt in ckpts:
        acc, sample_s = score(ckpt, clf, a)
        rows.append(dict(steps=int(ckpt.name.split("-")[1]), train_minutes=round(reached[ckpt] / 60, 2),
                         generated_class_accuracy=round(acc, 4), sample_seconds=round(sample_s, 1)))
    result = dict(model=a.model, image_size=a.image_size, batch_size=a.batch_size, lr=a.lr, ema_decay=a.ema_decay,
                  train_seconds=round(train_s, 1), samples=10 * a.samples_per_class,
                  classifier_accuracy_real_held_out=round(real_acc, 4), checkpoints=rows)
    print(json.dumps(result, indent=1))
    print("\n| steps | training (min) | classifier on generated samples |\n|---:|---:|---:|")
    for r in rows:
        print(f"| {r['steps']} | {r['train_minutes']:.1f} | {r['generated_class_accuracy']:.1%} |")
    print(f"\nclassifier on real held-out digits: {real_acc:.1%}; on the last checkpoint's samples: "
          f"{rows[-1]['generated_class_accuracy']:.1%} (target >= 95%); training {train_s / 60:.1f} min")


if __name__ == "__main__":
    main()
