"""Video DiT (VDiT, Latte) beyond the conformance table (which trains Latte-debug on the moving digits from the command
line, resumes it exactly and samples MP4s, strips, grids and an npz): a CSV of real MP4s (one corrupt, one missing, one
too short) trains from the command line, its captions conditioning through a tiny local CLIP; cached video latents
train like the clips they came from; two processes sample what one does and sequence parallelism trains what one
process does; an official Latte .pt is named from its shapes; the flow objective samples with Euler."""
import json
import sys

import numpy as np
import pytest
import torch

from opendit import config as cfglib
from opendit.data import write_mp4
from tests.run_each import cli, losses_of, run_each, run_here
from tests.test_train import ROOT, run_trainer, save_tiny_vae

av = pytest.importorskip("av")


def video_cfg(outputs, **kw):
    base = dict(model="Latte-debug", dataset="moving_digits", image_size=8, num_frames=4, batch_size=4,
                max_steps=3, log_every=1, ckpt_every=100, num_workers=0, outputs=str(outputs), lr=1e-3,
                ema_decay=0.9)
    return cfglib.TrainConfig(**{**base, **kw})


def write_csv_videos(root):
    """Three good 12-frame videos (labels 0, 1, 0), one corrupt, one missing, one too short (2 frames)."""
    rng = np.random.default_rng(0)
    for name, frames in (("a", 12), ("b", 12), ("c", 12), ("short", 2)):
        write_mp4(root / f"{name}.mp4", rng.integers(0, 255, (frames, 24, 32, 3), dtype=np.uint8))
    (root / "corrupt.mp4").write_bytes(rng.integers(0, 255, 4000, dtype=np.uint8).tobytes())
    rows = [("a.mp4", "a red ball"), ("b.mp4", "a blue box"), ("corrupt.mp4", "x"), ("missing.mp4", "y"),
            ("short.mp4", "z"), ("c.mp4", "a red box")]
    (root / "captions.csv").write_text("path,caption\n" + "".join(f"{p},{c}\n" for p, c in rows))
    (root / "labels.csv").write_text("path,label\n" + "".join(f"{p},{i % 2}\n" for i, (p, _) in enumerate(rows)))


def test_csv_of_mp4s_with_captions_through_vae_and_clip_then_sample_prompts(tmp_path):
    from opendit.encoders.tiny_clip import save_tiny_clip

    write_csv_videos(tmp_path)
    vae, clip = save_tiny_vae(tmp_path / "vae"), save_tiny_clip(tmp_path / "clip", words=["a", "red", "blue", "ball",
                                                                                         "box"])
    run = cli("train.py", "--model", "VDiT-debug", "--dataset", "video_csv", "--data_path", tmp_path / "captions.csv",
              "--image_size", "16", "--num_frames", "4", "--frame_interval", "2", "--vae", vae, "--clip", clip,
              "--batch_size", "3", "--max_steps", "2", "--log_every", "1", "--num_workers", "0",
              "--outputs", tmp_path / "out")
    for bad in ("corrupt.mp4", "missing.mp4", "short.mp4"):  # skipped with a warning each, never a crash
        assert bad in run.stderr
    out = tmp_path / "samples"
    run_here("sample.py", "--ckpt", "latest", "--outputs", tmp_path / "out", "--prompts", "a red ball", "a blue box",
        "--num_sampling_steps", "2", "--cfg_scale", "3", "--npz", "--out", out)
    assert np.load(out / "samples.npz")["arr_0"].shape == (2, 4, 16, 16, 3)


def test_captions_need_a_text_encoder_and_prompts_need_a_caption_model(tmp_path):
    write_csv_videos(tmp_path)
    with pytest.raises(ValueError, match="--clip"):
        run_trainer(video_cfg(tmp_path / "o", dataset="video_csv", data_path=str(tmp_path / "captions.csv")))
    run_trainer(video_cfg(tmp_path / "l", dataset="video_csv", data_path=str(tmp_path / "labels.csv"), max_steps=1))
    sys.path.insert(0, str(ROOT))
    import sample

    with pytest.raises(SystemExit, match="trained on class labels"):
        sample.main(cfglib.SampleConfig(ckpt="latest", outputs=str(tmp_path / "l"), prompts=["a red ball"],
                                        out=str(tmp_path / "s")))


def test_cached_video_latents_train_like_clips_on_the_fly(tmp_path):
    vae = save_tiny_vae(tmp_path / "vae")
    run_here("preprocess.py", "--family", "video", "--dataset", "moving_digits", "--image_size", "16",
        "--num_frames", "4", "--vae", vae, "--out", tmp_path / "cache", "--batch_size", "64", "--num_workers", "0")
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert manifest["latent_shape"] == [4, 4, 2, 2] and manifest["num_frames"] == 4 and manifest["captions"]
    common = dict(model="VDiT-debug", image_size=16, batch_size=4, max_steps=3)
    cached, fly = tmp_path / "c", tmp_path / "f"
    trainer, _ = run_trainer(video_cfg(cached, dataset="latents", data_path=str(tmp_path / "cache"), **common))
    assert trainer.encoders.vae is None and trainer.cfg.num_frames == 4 and trainer.cfg.vae == vae
    run_trainer(video_cfg(fly, vae=vae, **common))
    # same clips (epoch 0's start), weights and posterior noise: equal up to conv rounding of the encoder
    np.testing.assert_allclose(losses_of(cached / "000-VDiT-debug"), losses_of(fly / "000-VDiT-debug"), rtol=1e-5)


@pytest.mark.slow
def test_two_process_video_sampling_writes_what_one_process_does(tmp_path):
    run_trainer(video_cfg(tmp_path, max_steps=1))
    common = ["--ckpt", "latest", "--outputs", tmp_path, "--num_samples", "5", "--batch_size", "2",
              "--num_sampling_steps", "3", "--npz"]
    run_here("sample.py", *common, "--out", tmp_path / "one")
    cli("sample.py", *common, "--out", tmp_path / "two", nproc=2)
    one, two = (np.load(tmp_path / d / "samples.npz")["arr_0"] for d in ("one", "two"))
    assert one.shape == (5, 4, 8, 8, 3) and np.array_equal(one, two)


SP_MODELS = ["Latte-debug", "VDiT-debug"]


@pytest.fixture(scope="module")
def sp_runs(tmp_path_factory):
    """Each SP_MODELS model trained by train.py in one process (in the test's) and at 2 SP ranks (both models in
    one torchrun launch) -> the outputs root holding <model>/one and <model>/sp."""
    root = tmp_path_factory.mktemp("video_sp")
    args = {m: ["--model", m, "--dataset", "moving_digits", "--image_size", "8", "--num_frames", "3", "--batch_size",
                "4", "--max_steps", "3", "--log_every", "1", "--num_workers", "0"] for m in SP_MODELS}
    for m in SP_MODELS:
        run_here("train.py", *args[m], "--outputs", root / m / "one")
    run_each("train.py", [[*args[m], "--outputs", root / m / "sp", "--sequence_parallel_size", "2"]
                          for m in SP_MODELS], nproc=2)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("model", SP_MODELS)
def test_torchrun_video_sequence_parallel_training_equals_one_process(sp_runs, model):
    """Latte through DSP (frames split, one all-to-all per temporal block), VDiT through FastSeq: 2 SP ranks
    train what one process does."""
    name = model.replace("/", "-")
    np.testing.assert_allclose(losses_of(sp_runs / model / "sp" / f"000-{name}"),
                               losses_of(sp_runs / model / "one" / f"000-{name}"), rtol=1e-5)


@pytest.mark.parametrize("num_classes", [5, 0])
def test_an_official_latte_pt_is_named_and_sized_from_its_shapes(tmp_path, num_classes):
    """A Latte release (.pt with {"ema": state_dict}, no config) samples with no --model: name, frames, classes
    (0: Latte's unconditional releases) and sigma come from the tensor shapes."""
    from opendit.inference import complete_sample_config, load_model
    from opendit.families import build_model

    torch.manual_seed(0)
    latte = build_model("Latte-debug", input_size=(4, 8, 8), in_channels=4, num_classes=num_classes)
    torch.save({"ema": latte.state_dict(), "model": latte.state_dict()}, tmp_path / "latte.pt")
    cfg = cfglib.SampleConfig(ckpt=str(tmp_path / "latte.pt"), vae="none", image_size=8, in_channels=4,
                              num_sampling_steps=2, cfg_scale=1.0)  # no VAE offline: sample its latent space
    loaded = load_model(cfg, torch.device("cpu"))
    run = loaded.cfg
    cfg = complete_sample_config(loaded.family, cfg, run)
    assert (run.model, run.num_frames, run.num_classes, run.learn_sigma) == ("Latte-debug", 4, num_classes, True)
    conditions = loaded.family.conditions(cfg, run)
    assert conditions == ([None] if num_classes == 0 else list(range(5)))
    clips = loaded.family.sample_batch(loaded, loaded.family.make_sampler(cfg, run), range(2), conditions, cfg,
                                       torch.device("cpu"))
    assert clips.shape == (2, 4, 8, 8, 4)  # latent space itself: 4 channels


def test_flow_matching_objective_trains_and_samples_with_euler(tmp_path):
    """--objective flow: velocity targets, no learned variance, Euler sampling (the default for such a model);
    a DDPM sampler is refused for it, and Euler for a diffusion model."""
    trainer, losses = run_trainer(video_cfg(tmp_path, objective="flow", max_steps=30, log_every=10, lr=2e-3,
                                            batch_size=8))
    assert not trainer.cfg.learn_sigma and losses[-1] < 0.8 * losses[0], losses
    out = tmp_path / "samples"
    run_here("sample.py", "--ckpt", "latest", "--outputs", tmp_path, "--class_labels", "3", "7",
        "--num_sampling_steps", "3", "--npz", "--out", out)
    assert np.load(out / "samples.npz")["arr_0"].shape == (2, 4, 8, 8, 3)
    sys.path.insert(0, str(ROOT))
    import sample

    with pytest.raises(ValueError, match="--sampler ddpm does not apply to a model trained with --objective flow"):
        sample.main(cfglib.SampleConfig(ckpt="latest", outputs=str(tmp_path), sampler="ddpm", out=str(out)))
    run_trainer(video_cfg(tmp_path / "d", max_steps=1))
    with pytest.raises(ValueError, match="--sampler euler does not apply .* --objective diffusion; use ddpm or ddim"):
        sample.main(cfglib.SampleConfig(ckpt="latest", outputs=str(tmp_path / "d"), sampler="euler", out=str(out)))
