"""Video quality benchmark: train the moving-digits demo recipe on the CPU, sample clips of every class from the
EMA, and ask an independent classifier (trained on real digit frames only) which digit each frame shows; check
that the digit moves smoothly, as the real ones do.

    python benchmarks/video_quality.py                     # the docs/video.md figure (at most 20 min on 2 CPU cores)
    python benchmarks/video_quality.py --recipe wan_digits  # Wan-debug on captions: digit and direction per prompt
    python benchmarks/video_quality.py --recipe wan22_i2v_digits   # Wan2.2 image-to-video: first frame + caption
    python benchmarks/video_quality.py --max_steps 20 --samples_per_class 2 --sampling_steps 10   # smoke run

Prints: the classifier's accuracy on real held-out frames and on the generated frames (target >= 80%), and the
digit's motion: the mean step (px per frame) and mean change of velocity (px per frame^2; bounces included) of
its centre of mass, for real and generated clips, and the share of generated frame-to-frame steps of at most
2 px (no jumps). With --recipe wan_digits each clip is prompted with a digit and a direction ("the digit 3
moving up and left"), and it also prints the share of clips whose digit moved the prompted way (target >= 70%).
With --recipe wan22_i2v_digits each clip is given a held-out clip's first frame and caption: the classifier checks
every frame shows the image's digit, the direction check as above, and the generated first frame is compared with
the image (mean absolute error as a share of the pixel range).
"""
import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opendit import config as cfglib  # noqa: E402
from opendit.data import MovingDigitsDataset  # noqa: E402
from benchmarks.bench_common import sample_checkpoint  # noqa: E402


def interior(frames, border: bool):
    """[..., S, S] -> [..., S - 2, S - 2] without the canvas's 1 px border (border=True), else as it is: the
    classifier and the centre of mass look at the digit only."""
    return frames[..., 1:-1, 1:-1] if border else frames


def frames_and_labels(ds, clips, frames_per_clip=None):
    """Real frames [n, S'*S'] in [-1, 1] (S' = S, or S - 2 inside a border) and their digit, from the first
    `clips` clips of ds."""
    xs, ys = [], []
    for i in range(min(clips, len(ds))):
        video, label, _ = ds[i]  # [1, T, S, S]
        picked = video[0] if frames_per_clip is None else video[0, :: max(1, ds.num_frames // frames_per_clip)]
        xs.append(interior(picked, ds.border).flatten(1).numpy())
        ys += [label] * len(picked)
    return np.concatenate(xs), np.array(ys)


def centred(frames: np.ndarray) -> np.ndarray:
    """Frames [n, S*S] in [-1, 1] -> each rolled so that its centre of mass is the frame's centre."""
    s = int(round(frames.shape[1] ** 0.5))
    grid, out = np.arange(s), frames.reshape(-1, s, s).copy()
    for i, f in enumerate(out):
        ink = (f + 1) / 2 + 1e-9
        cy, cx = (ink.sum(1) * grid).sum() / ink.sum(), (ink.sum(0) * grid).sum() / ink.sum()
        out[i] = np.roll(f, (int(round((s - 1) / 2 - cy)), int(round((s - 1) / 2 - cx))), axis=(0, 1))
    return out.reshape(len(frames), -1)


class CentredSVC:
    """An RBF SVM on frames centred on their ink (centred()): blind to where the digit is, so a digit that
    travels over half the frame (the text-to-video demo) is named as well as one that stays put."""

    def __init__(self, **kw):
        from sklearn.svm import SVC

        self.svc = SVC(**kw)

    def fit(self, x, y):
        self.svc.fit(centred(x), y)
        return self

    def predict(self, x):
        return self.svc.predict(centred(x))


def train_classifier(image_size, num_frames, centre: bool = False, **data):
    """An RBF SVM on real moving-digit frames (train split) -> (classifier, accuracy on held-out real frames).
    centre: classify frames centred on their ink (CentredSVC); data: the recipe's dataset options (Wan's demo:
    digit_size, bounce)."""
    from sklearn.svm import SVC

    train = MovingDigitsDataset(image_size, num_frames, split="train", seed=1, **data)
    held = MovingDigitsDataset(image_size, num_frames, split="held_out", seed=2, **data)
    x, y = frames_and_labels(train, len(train), frames_per_clip=4)
    clf = (CentredSVC if centre else SVC)(gamma="scale", C=10.0).fit(x, y)
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


# The two demo recipes (train_video.sh's): training flags, and how the quality run samples them.
RECIPES = {
    "moving_digits": dict(train=dict(model="Latte-Ti/4", image_size=16, num_frames=3, batch_size=48, lr=2e-3,
                                     ema_decay=0.995, max_steps=1500, objective="flow"),
                          sample=dict(cfg_scale=12.0, sampling_steps=100, sampler=None), data={}, centre=False),
    "wan_digits": dict(train=dict(model="Wan-debug", image_size=16, num_frames=3, batch_size=32, lr=2e-3,
                                  ema_decay=0.995, max_steps=5000, timestep_sampling="logit_normal"),
                       sample=dict(cfg_scale=None, sampling_steps=None, sampler=None),
                       data=dict(digit_size=8, bounce=False, border=True, frame_interval=4), centre=True),
    # image-to-video: Wan2.2-I2V-debug (I2V-A14B's conditioning: mask + first-frame latent) given each held-out
    # clip's first frame and its caption
    "wan22_i2v_digits": dict(train=dict(model="Wan2.2-I2V-debug", image_size=16, num_frames=3, batch_size=32,
                                        lr=2e-3, ema_decay=0.995, max_steps=5000, timestep_sampling="logit_normal"),
                             sample=dict(cfg_scale=None, sampling_steps=None, sampler=None),
                             data=dict(digit_size=8, bounce=False, border=True, frame_interval=4), centre=True),
}
CAPTIONED = ("wan_digits", "wan22_i2v_digits")


def directions_agree(clips: np.ndarray, prompts: list[str], travel: float) -> np.ndarray:
    """clips float [n, T, S, S] in [0, 1] -> bool [n]: the centre of mass moved from the first frame to the last as
    prompt i says, per axis: at least travel / 2 px the named way, less than that along an axis it does not name."""
    from opendit.data.moving_digits import DIRECTIONS

    unit = dict(DIRECTIONS)
    s = clips.shape[-1]
    grid = np.arange(s, dtype=np.float64)
    mass = clips.sum(axis=(2, 3)) + 1e-9
    cx = (clips.sum(axis=2) * grid).sum(axis=2) / mass
    cy = (clips.sum(axis=3) * grid).sum(axis=2) / mass
    moved = np.stack([cx[:, -1] - cx[:, 0], cy[:, -1] - cy[:, 0]], axis=1)  # [n, 2]
    seen = np.where(np.abs(moved) >= travel / 2, np.sign(moved), 0)
    wanted = np.array([unit[p.split(" moving ")[1]] for p in prompts])
    return (seen == wanted).all(axis=1)


def first_frame_prompts(real, n: int, folder: Path) -> tuple[list[str], list[int], np.ndarray]:
    """The image-to-video demo's conditions: held-out clip i's caption, its digit and its first frame (uint8
    [n, S, S]), the frames written as folder/0000.png ... (sample.py --image folder: one per prompt)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    prompts, firsts = [real.caption(i) for i in range(n)], []
    for i in range(n):
        first = ((real[i][0][0, 0].numpy() + 1) * 127.5).round().astype(np.uint8)
        Image.fromarray(first).save(folder / f"{i:04d}.png")
        firsts.append(first)
    return prompts, [int(p.split()[2]) for p in prompts], np.stack(firsts)


def tiny_umt5(outputs: str) -> str:
    from opendit.families.wan.tiny_umt5 import save_tiny_umt5

    folder = Path(outputs) / "tiny_umt5"
    return str(folder) if (folder / "config.json").is_file() else save_tiny_umt5(folder, max_length=16)


def train(a) -> str:
    """Train the demo recipe -> its last checkpoint folder."""
    from opendit.training.loop import Trainer

    own = {"umt5": tiny_umt5(a.outputs), "timestep_sampling": a.timestep_sampling} if a.recipe in CAPTIONED \
        else {"objective": a.objective}
    train_cfg = cfglib.TrainConfig(model=a.model, dataset="moving_digits", image_size=a.image_size,
                                   num_frames=a.num_frames, frame_interval=a.frame_interval, vae="none",
                                   batch_size=a.batch_size, lr=a.lr,
                                   ema_decay=a.ema_decay, max_steps=a.max_steps, ckpt_every=a.max_steps,
                                   log_every=max(1, a.max_steps // 20), num_workers=0, outputs=a.outputs,
                                   global_seed=a.seed, **own)
    trainer = Trainer(train_cfg)
    trainer.train()
    return str(sorted((trainer.run_dir / "checkpoints").glob("step-*"))[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="moving_digits", choices=tuple(RECIPES),
                   help="moving_digits: Latte on class labels; wan_digits: Wan-debug on captions; "
                        "wan22_i2v_digits: Wan2.2-I2V-debug given each clip's first frame and caption")
    p.add_argument("--model")
    p.add_argument("--image_size", type=int)
    p.add_argument("--num_frames", type=int)
    p.add_argument("--max_steps", type=int)
    p.add_argument("--batch_size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--ema_decay", type=float)
    p.add_argument("--objective", choices=("diffusion", "flow"),
                   help="moving_digits: Latte's training objective (the recipe's: flow)")
    p.add_argument("--timestep_sampling", choices=("uniform", "logit_normal"), help="Wan recipes: training t")
    p.add_argument("--samples_per_class", type=int, default=10,
                   help="clips per digit (wan_digits: spread over the 8 directions)")
    p.add_argument("--cfg_scale", type=float)
    p.add_argument("--sampling_steps", type=int)
    p.add_argument("--sampler", help="default: the family's (Latte ddpm, or euler with --objective flow; Wan unipc)")
    p.add_argument("--outputs", default="outputs/video_quality")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", default=None, help="evaluate this checkpoint instead of training one")
    a = p.parse_args()
    recipe = RECIPES[a.recipe]
    a.frame_interval = recipe["data"].get("frame_interval", 1)
    for key, value in {**recipe["train"], **recipe["sample"]}.items():
        if getattr(a, key) is None:
            setattr(a, key, value)

    t0 = time.time()
    ckpt = a.ckpt or train(a)
    train_s = time.time() - t0

    sample_cfg = cfglib.SampleConfig(ckpt=str(ckpt), cfg_scale=a.cfg_scale, num_sampling_steps=a.sampling_steps,
                                     sampler=a.sampler, seed=a.seed)
    n = 10 * a.samples_per_class
    digits = [i % 10 for i in range(n)]
    border = recipe["data"].get("border", False)
    real = MovingDigitsDataset(a.image_size, a.num_frames, split="held_out", seed=3, **recipe["data"])
    first_error = None
    if a.recipe == "wan22_i2v_digits":  # held-out clips' first frames and captions: the digit is the image's
        folder = Path(a.outputs) / "first_frames"
        prompts, digits, firsts = first_frame_prompts(real, n, folder)
        sample_cfg = dataclasses.replace(sample_cfg, image=str(folder))
        clips, sample_s = sample_checkpoint(sample_cfg, prompts, n, chunk=20)
        first_error = float(np.abs(clips[:, 0, ..., 0].astype(np.float32) - firsts).mean() / 255)
    elif a.recipe == "wan_digits":
        from opendit.data.moving_digits import DIRECTIONS

        prompts = [f"the digit {d} moving {DIRECTIONS[(i // 10) % 8][0]}" for i, d in enumerate(digits)]
        clips, sample_s = sample_checkpoint(sample_cfg, prompts, n, chunk=20)
    else:
        prompts = None
        clips, sample_s = sample_checkpoint(sample_cfg, list(range(10)), n, chunk=20)  # uint8 [n, T, S, S, 3]
    grey = interior(clips[..., 0].astype(np.float32) / 255.0, border)  # [n, T, S', S'] in [0, 1]
    wanted = np.repeat(digits, a.num_frames)

    clf, real_acc = train_classifier(a.image_size, a.num_frames, recipe["centre"], **recipe["data"])
    gen_acc = float((clf.predict(grey.reshape(n * a.num_frames, -1) * 2 - 1) == wanted).mean())
    real_clips = interior(np.stack([(real[i][0][0].numpy() + 1) / 2 for i in range(n)]), border)
    result = dict(recipe=a.recipe, model=a.model, image_size=a.image_size, num_frames=a.num_frames,
                  steps=a.max_steps, batch_size=a.batch_size, train_seconds=round(train_s, 1),
                  sample_seconds=round(sample_s, 1), clips=n,
                  classifier_accuracy_real_held_out_frames=round(real_acc, 4),
                  generated_frame_accuracy=round(gen_acc, 4), motion_real=motion(real_clips),
                  motion_generated=motion(grey))
    summary = f"classifier on real held-out frames: {real_acc:.1%}; on generated frames: {gen_acc:.1%}"
    if prompts is not None:
        travel = real.speed * (a.num_frames - 1)
        real_prompts = [real.caption(i) for i in range(n)]
        result["direction_real"] = float(directions_agree(real_clips, real_prompts, travel).mean())
        result["direction_generated"] = float(directions_agree(grey, prompts, travel).mean())
        summary += (f" (target >= 90%); clips moving as prompted: {result['direction_generated']:.1%} "
                    f"(target >= 70%; real clips {result['direction_real']:.1%})")
    else:
        summary += " (target >= 80%)"
    if first_error is not None:
        result["first_frame_mean_abs_error"] = round(first_error, 4)
        summary += f"; first frame vs the given image: mean |error| {first_error:.3f} of the pixel range"
    print(json.dumps(result, indent=1))
    print(f"\n{summary}; training {train_s / 60:.1f} min, sampling {sample_s / 60:.1f} min")


if __name__ == "__main__":
    main()
