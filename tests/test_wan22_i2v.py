"""Wan2.2 image-to-video: the conditioning inputs against the official code's constructions (image2video.py's mask,
textimage2video.py's per-token timesteps), the training objective's image paths (TI2V: clean first frame at t = 0,
left out of the loss; I2V: mask + conditioning latent in y; an image dropped like a caption), one expert's share of
the schedule, and the entry scripts: train, cache, train on the cache and sample.py --image for both kinds."""
import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from opendit import config as cfglib
from opendit.families.wan.family import WanEncoders, WanFamily, WanFlowObjective
from opendit.families.wan.first_frame import (condition_video, i2v_inputs, load_first_frame, ti2v_timesteps,
                                              with_first_frame)
from tests.run_each import run_here
from tests.test_train import ROOT
from tests.families.test_video import write_csv_videos


def official_i2v_mask(frames: int, lat_h: int, lat_w: int) -> torch.Tensor:
    """wan/image2video.py's mask, as written there: ones on the first of `frames` pixel frames, the first repeated
    4 times, grouped by 4 -> [4, 1 + (frames - 1) // 4, lat_h, lat_w]."""
    msk = torch.ones(1, frames, lat_h, lat_w)
    msk[:, 1:] = 0
    msk = torch.concat([torch.repeat_interleave(msk[:, 0:1], repeats=4, dim=1), msk[:, 1:]], dim=1)
    msk = msk.view(1, msk.shape[1] // 4, 4, lat_h, lat_w)
    return msk.transpose(1, 2)[0]


@pytest.mark.parametrize("frames", [1, 5, 13])
def test_i2v_mask_equals_the_official_image2video_mask(frames):
    latent = torch.randn(2, 16, 1 + (frames - 1) // 4, 3, 5)
    y = i2v_inputs(latent, torch.tensor([True, False]))
    assert y.shape == (2, 20, *latent.shape[2:])
    torch.testing.assert_close(y[0, :4], official_i2v_mask(frames, 3, 5))
    torch.testing.assert_close(y[0, 4:], latent[0])
    assert not y[1].any()  # the image dropped: no mask, no latent


def test_ti2v_timesteps_equal_the_official_construction():
    """textimage2video.py: temp_ts = (mask2[0][0][:, ::2, ::2] * t).flatten(), mask2 ones with latent frame 0 at
    zero (patch 1x2x2)."""
    t = torch.tensor([731.0, 88.0])
    mask2 = torch.ones(48, 3, 8, 6)
    mask2[:, 0] = 0
    ours = ti2v_timesteps(t, torch.tensor([True, False]), (3, 4, 3))
    torch.testing.assert_close(ours[0], (mask2[0][:, ::2, ::2] * t[0]).flatten())
    torch.testing.assert_close(ours[1], torch.full((36,), 88.0))


def test_conditioning_clip_and_first_frame_replacement():
    first = torch.rand(2, 3, 4, 4) * 2 - 1
    video = condition_video(first, 5)
    assert video.shape == (2, 3, 5, 4, 4) and torch.equal(video[:, :, 0], first) and not video[:, :, 1:].any()
    x, z0 = torch.randn(2, 8, 3, 2, 2), torch.randn(2, 8, 1, 2, 2)
    out = with_first_frame(x, z0, torch.tensor([False, True]))
    assert torch.equal(out[0], x[0]) and torch.equal(out[1, :, :1], z0[1]) and torch.equal(out[1, :, 1:], x[1, :, 1:])


class Recorder:
    """A stand-in model: returns a fixed prediction and keeps its inputs."""

    def __init__(self, pred):
        self.pred, self.calls = pred, []

    def __call__(self, x, t, context, y=None):
        self.calls.append(dict(x=x, t=t, y=y))
        return self.pred


def objective(image, prob=1.0, t_range=(0.0, 1.0)):
    encoders = WanEncoders(vae=None, text=None, empty=torch.zeros(4, 6))
    return WanFlowObjective(encoders, 1.0, "uniform", 0.0, image=image, image_prob=prob, patch_size=(1, 2, 2),
                            t_range=t_range)


def test_ti2v_loss_sees_a_clean_first_frame_at_t0_and_leaves_it_out():
    x, noise = torch.randn(2, 4, 3, 4, 4), torch.randn(2, 4, 3, 4, 4)
    t, context = torch.tensor([0.6, 0.3]), torch.randn(2, 4, 6)
    first = torch.tensor([True, False])
    pred = torch.randn_like(x)
    model = Recorder(pred)
    loss, _ = objective("ti2v").losses(model, x, {"context": context, "first": first}, t, noise)
    call = model.calls[0]
    assert torch.equal(call["x"][0, :, 0], x[0, :, 0])  # the given frame, clean
    assert torch.equal(call["x"][1, :, 0], ((1 - t[1]) * x[1, :, 0] + t[1] * noise[1, :, 0]))
    assert call["t"].shape == (2, 12) and not call["t"][0, :4].any() and (call["t"][0, 4:] == 600).all()
    assert (call["t"][1] == 300).all()
    target = noise - x
    torch.testing.assert_close(loss[0], (pred[0, :, 1:] - target[0, :, 1:]).pow(2).mean())
    torch.testing.assert_close(loss[1], (pred[1] - target[1]).pow(2).mean())
    changed = pred.clone()
    changed[:, :, 0] += 5  # what the model says about the given frame does not count
    loss2, _ = objective("ti2v").losses(Recorder(changed), x, {"context": context, "first": first}, t, noise)
    assert loss2[0] == loss[0] and loss2[1] > loss[1]


def test_i2v_prepare_builds_y_from_each_clips_first_frame_and_drops_images_like_captions():
    clips = torch.rand(6, 1, 5, 8, 8) * 2 - 1
    batch = (clips, torch.zeros(6), ["a"] * 6, torch.randn(6, 4, 6))
    torch.manual_seed(0)
    x, cond = objective("i2v", prob=0.5).prepare(batch, "cpu")
    torch.manual_seed(0)
    kept = torch.rand(6) < 0.5  # prepare's first draw
    assert 0 < kept.sum() < 6 and cond["y"].shape == (6, 5, 5, 8, 8)
    torch.testing.assert_close(cond["y"][kept], i2v_inputs(condition_video(clips[:, :, 0], 5), kept)[kept])
    assert not cond["y"][~kept].any()
    _, val = objective("i2v", prob=0.5).prepare(batch, "cpu", train=False)  # validation: every clip conditioned
    assert val["y"][:, :4, 0].all()
    pred = torch.randn(6, 1, 5, 8, 8)
    model = Recorder(pred)
    loss, _ = objective("i2v").losses(model, x, cond, torch.full((6,), 0.5), torch.zeros_like(x))
    assert model.calls[0]["y"] is cond["y"] and loss.shape == (6,)


def test_text_to_video_draws_nothing_for_images():
    batch = (torch.rand(2, 1, 5, 8, 8), torch.zeros(2), ["a"] * 2, torch.randn(2, 4, 6))
    torch.manual_seed(0)
    objective(None).prepare(batch, "cpu")
    after = torch.rand(1)
    torch.manual_seed(0)
    torch.rand(2)  # the caption dropout's draw only
    assert torch.equal(torch.rand(1), after)


@pytest.mark.parametrize("expert, low, high", [("high", 0.875, 1.0), ("low", 0.0, 0.875)])
def test_an_expert_trains_its_share_of_the_schedule(expert, low, high):
    cfg = WanFamily().fill_defaults(cfglib.TrainConfig(model="Wan2.2-T2V-A14B", umt5="none", vae="none",
                                                       expert=expert))
    assert cfg.expert_boundary == 0.875 and cfg.flow_shift == 12.0 and cfg.i2v_prob == 0.0
    torch.manual_seed(0)
    t = WanFamily().objective(cfg, WanEncoders(vae=None, text=None)).sample_t(4096, "cpu")
    torch.manual_seed(0)
    free = WanFamily().objective(dataclasses.replace(cfg, expert="none"), None).sample_t(4096 * 8, "cpu")
    inside = free[(free >= low) & (free <= high)]
    assert t.shape == (4096,) and low <= t.min() and t.max() <= high
    assert torch.equal(t, inside[:4096])  # the distribution's own draws in the range, in order


def test_image_and_expert_flags_refuse_models_without_them():
    with pytest.raises(ValueError, match="text-to-video only"):
        WanFamily().fill_defaults(cfglib.TrainConfig(model="Wan-debug", umt5="none", vae="none", i2v_prob=0.5))
    with pytest.raises(ValueError, match="not two experts"):
        WanFamily().fill_defaults(cfglib.TrainConfig(model="Wan2.2-debug", umt5="none", vae="none", expert="high"))
    cfg = WanFamily().fill_defaults(cfglib.TrainConfig(model="Wan2.2-debug", umt5="none", vae="none"))
    assert cfg.i2v_prob == 0.2 and cfg.expert == "none"


def test_first_frame_is_scaled_to_cover_then_centre_cropped(tmp_path):
    from PIL import Image

    array = np.zeros((20, 40), dtype=np.uint8)
    array[:, 10:30] = 255  # a white band in the middle half
    Image.fromarray(array).save(tmp_path / "wide.png")
    frame = load_first_frame(tmp_path / "wide.png", 10, 10, channels=1)
    assert frame.shape == (1, 10, 10) and frame.min() > 0.75  # 20x10 after scaling; the centre 10 columns are white
    assert frame.mean() > 0.95  # (Lanczos rings a little at the band's edges)


@pytest.mark.slow
def test_image_to_video_through_the_entry_scripts(tmp_path):
    """Pixel space: TI2V (Wan2.2-debug) trains with its default share of image-conditioned clips and samples from
    --image, its first frame exactly the image; I2V (Wan2.2-I2V-debug) trains, refuses to sample without --image
    and samples with it. With the tiny Wan2.1 VAE: the I2V cache stores each clip's conditioning latent, training on
    it runs, and sample.py --image decodes a clip."""
    from PIL import Image

    from opendit.families.wan.tiny_umt5 import save_tiny_umt5
    from opendit.families.wan.vae import save_tiny_wan_vae

    umt5 = save_tiny_umt5(tmp_path / "umt5", max_length=16)
    Image.fromarray((np.random.default_rng(0).random((12, 20)) * 255).astype(np.uint8)).save(tmp_path / "first.png")
    common = ["--umt5", umt5, "--batch_size", "4", "--max_steps", "2", "--log_every", "1", "--num_workers", "0"]
    pixels = [*common, "--vae", "none", "--dataset", "moving_digits", "--image_size", "16", "--num_frames", "3"]
    run_here("train.py", "--model", "Wan2.2-debug", *pixels, "--outputs", tmp_path / "ti2v")
    run_here("sample.py", "--ckpt", "latest", "--outputs", tmp_path / "ti2v", "--prompt", "the digit 3 moving up",
        "--image", tmp_path / "first.png", "--num_sampling_steps", "2", "--npz", "--out", tmp_path / "s_ti2v")
    clip = np.load(tmp_path / "s_ti2v" / "samples.npz")["arr_0"][0]
    image = (load_first_frame(tmp_path / "first.png", 16, 16, channels=1)[0].numpy() + 1) * 127.5
    assert np.abs(clip[0, :, :, 0] - image).max() <= 0.5  # the given frame, to the uint8 rounding

    run_here("train.py", "--model", "Wan2.2-I2V-debug", *pixels, "--sample_every", "2", "--preview_steps", "2",
        "--outputs", tmp_path / "i2v")  # the preview samples with the image dropped
    run = [*("--ckpt", "latest", "--outputs", tmp_path / "i2v", "--prompt", "a"), "--num_sampling_steps", "2"]
    out = subprocess.run([sys.executable, "sample.py", *map(str, run), "--out", str(tmp_path / "none")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "pass --image with the first frame" in out.stderr.splitlines()[-1]
    run_here("sample.py", *run, "--image", tmp_path / "first.png", "--npz", "--out", tmp_path / "s_i2v")
    assert np.load(tmp_path / "s_i2v" / "samples.npz")["arr_0"].shape == (1, 3, 16, 16, 3)

    vae = save_tiny_wan_vae(tmp_path / "vae")
    videos = tmp_path / "videos"
    videos.mkdir()
    write_csv_videos(videos)  # three readable 12-frame clips with captions (and some broken rows, skipped)
    run_here("preprocess.py", "--family", "wan", "--model", "Wan2.2-I2V-debug", "--dataset", "video_csv", "--data_path",
        videos / "captions.csv", "--image_size", "32", "--num_frames", "5", "--vae", vae, "--umt5", umt5,
        "--batch_size", "4", "--num_workers", "0", "--out", tmp_path / "cache")
    run_here("train.py", "--model", "Wan2.2-I2V-debug", *common, "--batch_size", "2", "--dataset", "latents",
        "--data_path", tmp_path / "cache", "--outputs", tmp_path / "cached")
    run_here("sample.py", "--ckpt", "latest", "--outputs", tmp_path / "cached", "--prompt", "a", "--image",
        tmp_path / "first.png", "--num_sampling_steps", "2", "--npz", "--out", tmp_path / "s_cached")
    assert np.load(tmp_path / "s_cached" / "samples.npz")["arr_0"].shape == (1, 5, 32, 32, 3)


def test_the_cached_conditioning_latent_is_the_one_training_encodes(tmp_path):
    """preprocess.py's first_frame array for an I2V model equals what the objective encodes from the same clip."""
    from opendit.families.wan.vae import load_wan_vae, save_tiny_wan_vae

    vae = load_wan_vae(save_tiny_wan_vae(tmp_path / "vae"), "cpu")
    clips = torch.rand(2, 3, 5, 16, 16) * 2 - 1
    cached = WanFamily().cache_encode(WanEncoders(vae=vae, text=None, first_frame=True), clips)["first_frame"]
    live = WanFlowObjective(WanEncoders(vae=vae, text=None), 1.0, "uniform", 0.0, image="i2v",
                            image_prob=1.0).first_latent((clips, None, None), "cpu")
    torch.testing.assert_close(cached, live)
    assert cached.shape == (2, 16, 2, 2, 2)
