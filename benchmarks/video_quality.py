"""Video quality benchmark: train the moving-digits demo recipe on the CPU, sample clips of every class from the
EMA, and ask an independent classifier (trained on real digit frames only) which digit each frame shows; check
that the digit moves smoothly, as the real ones do.

    python benchmarks/video_quality.py                     # the docs/video.md figure (at most 20 min on 2 CPU cores)
    python benchmarks/video_quality.py --max_steps 20 --samples_per_class 2 --sampling_steps 10   # smoke run

Prints: the classifier's accuracy on real held-out frames and on the generated frames (target >= 80%), and the
digit's motion: the mean step (px per frame) and mean change of velocity (px per frame^2; bounces included) of
its centre of mass, for real and generated clips, and the share of generated frame-to-frame steps of at most
2 px (no jumps).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opendit import config as cfglib  # noqa: E402
from opendit.data import MovingDigitsDataset  # noqa: E402
from bench_common import sample_checkpoint  # noqa: E402  (benchmarks/, beside this file)


def frames_and_labels(ds, clips, frames_per_clip=None):
    """Real frames [n, S*S] in [-1, 1] and their digit, from the first `clips` clips of ds."""
    xs, ys = [], []
    for i in range(min(clips, len(ds))):
        video, label, _ = ds[i]  # [1, T, S, S]
        picked = video[0] if frames_per_clip is None else video[0, :: max(1, ds.num_frames // frames_per_clip)]
        xs.append(picked.flatten(1).numpy())
        ys += [label] * len(picked)
    return np.concatenate(xs), np.array(ys)


def train_classifier(image_size, num_frames):
    """An RBF SVM on real moving-digit frames (train split) -> (classifier, accuracy on held-out real frames)."""
    from sklearn.svm import SVC

    train = MovingDigitsDataset(image_size, num_frames, split="train", seed=1)
    held = MovingDigitsDataset(image_size, num_frames, split="held_out", seed=2)
    x, y = frames_and_labels(train, len(train), frames_per_clip=4)
    clf = SVC(gamma="scale", C=10.0).fit(x, y)
    xh, yh = frames_and_labels(held, 200)
    return clf, float((clf.predict(xh) == yh).mean())


def motion(clips: np.ndarray) -> dict:
    """clips float [n, T, S, S] in [0, 1] -> the centre of mass's mean step and mean change of velocity."""
    n, t, s, _ = clips.shape
    grid = np.arange(s, dtype=np.float64)
    mass = clips.sum(axis=(2, 3)) + 1e-9  # [n, T]
    cy = (clips.sum(axis=3) * grid).sum(axis=2) / mass
    cx = (clips.sum(axis=2) * grid).sum(axis=2) / mass
    velocity = np.stack([np.diff(cx, axis=1), np.diff(cy, axis=1)], axis=-1)  # [n, T-1, 2]
    step = np.linalg.norm(velocity, axis=-1)
    accel = np.linalg.norm(np.diff(velocity, axis=1), axis=-1)
    return {"mean_step_px": float(step.mean()),
            "mean_velocity_change_px": float(accel.mean()) if t > 2 else None,  # needs 3 frames
            "steps_at_most_2px": float((step <= 2.0).mean())}


def train(a) -> str:
    """Train the demo recipe -> its last checkpoint folder."""
    from opendit.training.loop import Trainer

    train_cfg = cfglib.TrainConfig(model=a.model, dataset="moving_digits", image_size=a.image_size,
                                   num_frames=a.num_frames, vae="none", batch_size=a.batch_size, lr=a.lr,
                                   ema_decay=a.ema_decay, max_steps=a.max_steps, ckpt_every=a.max_steps,
                                   log_every=max(1, a.max_steps // 20), num_workers=0, outputs=a.outputs,
                                   global_seed=a.seed)
    trainer = Trainer(train_cfg)
    trainer.train()
    return str(sorted((trainer.run_dir / "checkpoints").glob("step-*"))[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Latte-Ti/4")
    p.add_argument("--image_size", type=int, default=16)
    p.add_argument("--num_frames", type=int, default=3)
    p.add_argument("--max_steps", type=int, default=1500)
    p.add_argument("--batch_size", type=int, default=48)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--ema_decay", type=float, default=0.995)
    p.add_argument("--samples_per_class", type=int, default=10)
    p.add_argument("--cfg_scale", type=float, default=12.0)
    p.add_argument("--sampling_steps", type=int, default=100)
    p.add_argument("--sampler", default="ddpm", choices=("ddpm", "ddim"))
    p.add_argument("--outputs", default="outputs/video_quality")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", default=None, help="evaluate this checkpoint instead of training one")
    a = p.parse_args()

    t0 = time.time()
    ckpt = a.ckpt or train(a)
    train_s = time.time() - t0

    sample_cfg = cfglib.SampleConfig(ckpt=str(ckpt), cfg_scale=a.cfg_scale, num_sampling_steps=a.sampling_steps,
                                     sampler=a.sampler, seed=a.seed)
    labels, n = list(range(10)), 10 * a.samples_per_class
    clips, sample_s = sample_checkpoint(sample_cfg, labels, n, chunk=20)  # uint8 [n, T, S, S, 3]
    grey = clips[..., 0].astype(np.float32) / 255.0  # [n, T, S, S] in [0, 1]
    wanted = np.repeat([labels[i % 10] for i in range(n)], a.num_frames)

    clf, real_acc = train_classifier(a.image_size, a.num_frames)
    gen_acc = float((clf.predict(grey.reshape(n * a.num_frames, -1) * 2 - 1) == wanted).mean())
    real = MovingDigitsDataset(a.image_size, a.num_frames, split="held_out", seed=3)
    real_clips = np.stack([(real[i][0][0].numpy() + 1) / 2 for i in range(n)])
    result = dict(model=a.model, image_size=a.image_size, num_frames=a.num_frames, steps=a.max_steps,
                  batch_size=a.batch_size, train_seconds=round(train_s, 1), sample_seconds=round(sample_s, 1),
                  clips=n, classifier_accuracy_real_held_out_frames=round(real_acc, 4),
                  generated_frame_accuracy=round(gen_acc, 4), motion_real=motion(real_clips),
                  motion_generated=motion(grey))
    print(json.dumps(result, indent=1))
    print(f"\nclassifier on real held-out frames: {real_acc:.1%}; on generated frames: {gen_acc:.1%} "
          f"(target >= 80%); training {train_s / 60:.1f} min, sampling {sample_s / 60:.1f} min")


if __name__ == "__main__":
    main()
