"""Bucketed training end to end: class folders and captioned images of mixed shapes train from the command line,
resume exactly (also at another world size), validate per bucket, cache each item at its bucket's size, and the
trained models sample at a non-square size."""
import dataclasses
import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.test_buckets import _image, mixed_shape_folder
from tests.test_train import _run, run_trainer, save_tiny_vae, tiny_cfg

SHAPES = ((48, 16), (16, 48), (32, 32), (40, 20), (20, 40), (30, 31))


def class_folders(root, repeat=6):
    """Two class folders of landscape, portrait and square images."""
    for label in ("a", "b"):
        (root / label).mkdir(parents=True, exist_ok=True)
        for k in range(repeat // 2):
            for j, (w, h) in enumerate(SHAPES):
                _image(w, h, seed=100 * k + 10 * j + len(label)).save(root / label / f"{k}_{j}.png")
    return root


def _bucketed(outputs, data, **kw):
    return tiny_cfg(outputs, **{**dict(dataset="folder", data_path=str(data), image_size=16, buckets="auto",
                                       batch_size=4), **kw})


def test_bucketed_training_resumes_exactly_and_validates_per_bucket(tmp_path, capfd):
    data = class_folders(tmp_path / "data")
    trainer, full = run_trainer(_bucketed(tmp_path / "a", data, max_steps=6, ckpt_every=3, val_every=3,
                                          val_samples=6))
    logged = capfd.readouterr().err
    assert "aspect-ratio buckets (--buckets auto)" in logged and "30 items, 24 trained per epoch" in logged
    shapes = {tuple(trainer.dataset[i][0].shape) for i in range(len(trainer.dataset))}
    assert len(shapes) >= 4 and (3, 16, 16) in shapes  # landscape, portrait and square buckets
    assert all(np.isfinite(full))
    run_trainer(_bucketed(tmp_path / "b", data, max_steps=3, ckpt_every=3, val_every=3, val_samples=6))
    _, resumed = run_trainer(_bucketed(tmp_path / "b", data, max_steps=6, ckpt_every=3, val_every=3, val_samples=6,
                                       load="latest"))
    assert resumed == full[3:]  # exact in fp32
    val = [json.loads(line) for line in (tmp_path / "a" / "000-DiT-debug" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in val if r.get("kind") == "val"] == [3, 6]
    with pytest.raises(ValueError, match="same --buckets"):  # other buckets: the data order cannot continue
        run_trainer(_bucketed(tmp_path / "b", data, max_steps=9, ckpt_every=3, val_every=3, val_samples=6,
                              load="latest", buckets="16x16,32x8,8x32"))


def test_buckets_refused_where_items_have_no_sizes(tmp_path):
    with pytest.raises(ValueError, match="--buckets: --dataset digits has no per-item sizes"):
        run_trainer(tiny_cfg(tmp_path, buckets="auto"))


def test_bucketed_latent_cache_keeps_each_item_at_its_bucket_size(tmp_path):
    import preprocess

    data = class_folders(tmp_path / "data", repeat=4)
    vae = save_tiny_vae(tmp_path / "vae")
    out = tmp_path / "cache"
    manifest = preprocess.main(["--dataset", "folder", "--data_path", str(data), "--image_size", "32", "--vae", vae,
                                "--out", str(out), "--buckets", "auto", "--model", "DiT-debug", "--num_workers", "0",
                                "--batch_size", "5"])
    assert manifest["buckets"] == "auto" and manifest["latent_shape"] == [4, 4, 4]
    shapes = {tuple(s["latent_shape"]) for s in manifest["shards"]}
    assert shapes == {(4, 2, 8), (4, 4, 4), (4, 8, 2)} and manifest["count"] == 24  # landscape, square, portrait
    for entry in manifest["shards"]:  # one bucket per shard, at that bucket's latent size
        w, h, _ = manifest["bucket_sizes"][entry["bucket"]]
        assert entry["latent_shape"] == [4, h // 8, w // 8]
    cfg = tiny_cfg(tmp_path / "run", dataset="latents", data_path=str(out), image_size=None, batch_size=4, max_steps=2)
    trainer, losses = run_trainer(cfg)
    assert trainer.cfg.buckets == "auto" and all(np.isfinite(losses))
    with pytest.raises(ValueError, match="--buckets 32x32 disagrees with the latent cache"):
        run_trainer(tiny_cfg(tmp_path / "run2", dataset="latents", data_path=str(out), image_size=None, batch_size=4,
                             buckets="32x32"))


@pytest.mark.parametrize("model", ["flux-debug", "flux2-klein-debug", "z-image-debug"])
def test_captioned_photos_train_from_the_command_line_and_sample_non_square(tmp_path, model):
    """The issue's acceptance: FLUX (and the diffusers-transformer models) on a folder of portrait, landscape and
    square captioned photos, then a 32x16 sample."""
    from opendit.families.wrapped.flux2 import save_tiny_qwen3
    from tests.families.test_flux import tiny_text_encoders

    if model == "flux-debug":
        t5, clip = tiny_text_encoders(tmp_path / "encoders", words="all")
        text = ["--t5", t5, "--clip", clip]
    else:
        text = ["--text_encoder", save_tiny_qwen3(tmp_path / "qwen3", words="all")]
    data = mixed_shape_folder(tmp_path / "photos", shapes=SHAPES, repeat=4)
    out = _run(["train.py", "--model", model, "--dataset", "captions", "--data_path", str(data),
                "--image_size", "16", "--buckets", "auto", *text, "--batch_size", "4",
                "--max_steps", "3", "--log_every", "1", "--num_workers", "0", "--outputs", str(tmp_path / "out")])
    assert "aspect-ratio buckets" in out.stderr + out.stdout
    _run(["sample.py", "--ckpt", "latest", "--outputs", str(tmp_path / "out"), "--prompts", "a picture 1",
          "--num_samples", "2", "--width", "32", "--height", "16", "--out", str(tmp_path / "samples")])
    pngs = sorted((tmp_path / "samples" / "images").glob("*.png"))
    assert len(pngs) == 2 and {Image.open(p).size for p in pngs} == {(32, 16)}


@pytest.mark.slow
def test_bucketed_resume_at_another_world_size(tmp_path):
    """Two processes train 3 steps and checkpoint; one process resumes where they stopped: the same global batches
    follow (each rank draws its own noise, so losses depend on the world size; the data order does not)."""
    import torch.distributed as dist

    from opendit.training.loop import Trainer
    from tests.test_buckets import _global_batches

    data = class_folders(tmp_path / "data")
    _run(["train.py", "--model", "DiT-debug", "--dataset", "folder", "--data_path", str(data), "--image_size", "16",
          "--buckets", "auto", "--batch_size", "4", "--log_every", "1", "--num_workers", "0", "--ckpt_every", "3",
          "--lr", "1e-3", "--ema_decay", "0.9", "--max_steps", "3", "--outputs", str(tmp_path / "run")], nproc=2)
    try:
        trainer = Trainer(_bucketed(tmp_path / "run", data, max_steps=6, ckpt_every=3, load="latest"))
        sampler = trainer.loader.sampler
        assert (sampler.num_replicas, sampler.consumed) == (1, 12)
        two_ranks, _ = _global_batches(sampler.groups, dp=2, seed=0, batch=4)  # what 2 ranks would train next
        assert torch.equal(torch.tensor(list(sampler)).view(-1, 4), two_ranks[3:])
        losses = trainer.train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert len(losses) == 3 and all(np.isfinite(losses))


def test_video_buckets_by_shape_and_frame_count(tmp_path):
    """Videos of three shapes and two lengths: each clip goes to the longest bucket length it has frames for and the
    nearest aspect ratio; a too-short clip is left out; Latte trains on the buckets."""
    pytest.importorskip("av")
    from opendit.data import VideoCSVDataset, write_mp4
    from opendit.data.buckets import parse_buckets

    rng = np.random.default_rng(0)
    rows = ["path,label"]
    for k, (w, h) in enumerate(((32, 16), (16, 32), (24, 24))):
        for frames in (3, 6, 4, 8):
            name = f"v{k}_{frames}.mp4"
            write_mp4(tmp_path / name, rng.integers(0, 256, (frames, h, w, 3), dtype=np.uint8))
            rows.append(f"{name},{k}")
    write_mp4(tmp_path / "short.mp4", rng.integers(0, 256, (1, 16, 16, 3), dtype=np.uint8))
    rows.append("short.mp4,0")
    (tmp_path / "videos.csv").write_text("\n".join(rows) + "\n")
    ds = VideoCSVDataset(str(tmp_path / "videos.csv"), 16, num_frames=2)
    assignment = ds.use_buckets(parse_buckets("32x16,16x32,24x24", 0, 8, frames=(4, 2)))
    assert assignment.ids[-1] == -1  # one frame: shorter than every bucket
    for i in range(len(ds) - 1):
        clip, label, _ = ds[i]
        bucket = assignment.size_of(i)
        frames = int(ds.samples[i][0].split("_")[-1].split(".")[0])
        assert bucket.frames == (4 if frames >= 4 else 2)
        assert clip.shape == (3, bucket.frames, bucket.height, bucket.width)
        assert (bucket.width > bucket.height) == (label == 0) and (bucket.width < bucket.height) == (label == 1)
    from tests.families.test_video import video_cfg

    cfg = video_cfg(tmp_path / "run", dataset="video_csv", data_path=str(tmp_path / "videos.csv"), image_size=16,
                    num_frames=2, buckets="32x16,16x32,24x24", bucket_frames=[4, 2], batch_size=2, max_steps=3)
    trainer, losses = run_trainer(cfg)
    assert len(losses) == 3 and all(np.isfinite(losses))
    # a frame count no clip reaches: one line naming it, before any model is built or folder made
    with pytest.raises(ValueError, match=r"none of the 13 items .* fits a bucket .*shorter than every "
                                         r"--bucket_frames 16; list a frame count the clips have"):
        run_trainer(dataclasses.replace(cfg, bucket_frames=[16], outputs=str(tmp_path / "never")))
    assert not (tmp_path / "never").exists()
