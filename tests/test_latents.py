"""Cached VAE latents: preprocess.py writes them, LatentDataset reads them, the Trainer trains on them."""
import json
import sys

import numpy as np
import pytest
import torch

from opendit.data import LATENTS, DigitsDataset, LatentDataset
from tests.test_train import ROOT, _run, run_trainer, save_tiny_vae, tiny_cfg

sys.path.insert(0, str(ROOT))
import preprocess  # noqa: E402  (the entry script, run in-process)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Digits at 32px through the tiny VAE (8x down, 4 channels) -> (cache folder, vae folder)."""
    root = tmp_path_factory.mktemp("latents")
    vae = save_tiny_vae(root / "vae")
    _preprocess(vae, root / "cache")
    return str(root / "cache"), vae


def _preprocess(vae, out, *extra):
    from opendit.distributed import cleanup

    try:
        return preprocess.main(["--dataset", "digits", "--image_size", "32", "--vae", vae, "--out", str(out),
                                "--batch_size", "256", "--num_workers", "0", *extra])
    finally:
        cleanup()


def test_dataset_shapes_count_labels(cache):
    path, vae = cache
    ds = LATENTS(path, None)
    digits = DigitsDataset(32, channels=3)
    assert len(ds) == len(digits) == 1797 and ds.latent_shape == (4, 4, 4) and ds.num_classes == 10
    (mean, std), label = ds[1000]
    assert mean.shape == std.shape == (4, 4, 4) and mean.dtype == torch.float32 and (std > 0).all()
    assert [ds[i][1] for i in range(0, 1797, 97)] == [digits[i][1] for i in range(0, 1797, 97)]
    manifest = json.loads(open(ds.path + "/manifest.json").read())
    assert manifest["vae"] == vae and manifest["image_size"] == 32 and manifest["classes"][3] == "3"


def test_cached_posterior_equals_encoding_the_image(cache):
    from opendit.encoders import load_vae

    path, vae_dir = cache
    vae, ds = load_vae(vae_dir), LatentDataset(path)
    x = torch.stack([DigitsDataset(32, channels=3)[i][0] for i in (0, 5, 1796)])
    with torch.no_grad():
        posterior = vae.encode(x).latent_dist
    mean = torch.stack([ds[i][0][0] for i in (0, 5, 1796)])
    std = torch.stack([ds[i][0][1] for i in (0, 5, 1796)])
    # batch 256 vs 3 changes CPU conv blocking only: fp32 rounding level
    torch.testing.assert_close(mean, posterior.mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(std, posterior.std, rtol=1e-5, atol=1e-6)


def test_training_on_cache_matches_training_on_the_fly(cache, tmp_path):
    path, vae = cache
    common = dict(image_size=32, max_steps=3, batch_size=16)
    trainer, cached = run_trainer(tiny_cfg(tmp_path / "c", dataset="latents", data_path=path, **common))
    assert trainer.encoders.vae is None and trainer.cfg.vae == vae  # VAE not run, but named for sampling
    assert (trainer.model.input_size, trainer.model.in_channels) == (4, 4)
    _, fly = run_trainer(tiny_cfg(tmp_path / "f", vae=vae, **common))
    assert all(np.isfinite(cached)) and len(cached) == 3
    # same data order, weights and posterior noise: equal up to conv rounding of the encoder
    np.testing.assert_allclose(cached, fly, rtol=1e-5)  # exactly equal on x86 CPU here
    from opendit.config import SampleConfig
    from opendit.inference import load_model

    loaded = load_model(SampleConfig(ckpt="latest", outputs=str(tmp_path / "c")), torch.device("cpu"))
    assert loaded.encoders.vae is not None and loaded.cfg.vae == vae and loaded.model.in_channels == 4  # decodes


def test_cache_flags_must_agree(cache, tmp_path):
    path, _ = cache
    with pytest.raises(ValueError, match="--image_size 64 disagrees.*pass --image_size 32"):
        run_trainer(tiny_cfg(tmp_path, dataset="latents", data_path=path, image_size=64))
    with pytest.raises(ValueError, match="--vae other/vae disagrees"):
        run_trainer(tiny_cfg(tmp_path, dataset="latents", data_path=path, image_size=32, vae="other/vae"))


def test_interrupted_or_missing_cache_is_refused(cache, tmp_path):
    path, _ = cache
    (tmp_path / "c.partial").mkdir()
    with pytest.raises(FileNotFoundError, match="incomplete.*interrupted"):
        LatentDataset(str(tmp_path / "c"))
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        LatentDataset(str(tmp_path))
    bad = tmp_path / "old"
    bad.mkdir()
    manifest = json.loads(open(path + "/manifest.json").read())
    (bad / "manifest.json").write_text(json.dumps({**manifest, "version": 0}))
    with pytest.raises(ValueError, match="version 0.*rebuild"):
        LatentDataset(str(bad))


def test_flip_both_caches_the_mirror_and_picks_per_epoch(tmp_path):
    vae = save_tiny_vae(tmp_path / "vae")
    _preprocess(vae, tmp_path / "cache", "--flip_both", "--dtype", "float16", "--shard_size", "500")
    ds = LatentDataset(str(tmp_path / "cache"), seed=3)
    assert len(ds) == 1797 and len(ds.manifest["shards"]) == 4
    fixed = LatentDataset(str(tmp_path / "cache"), random_flip=False)
    firsts = [[ds[i][0][0] for i in range(20)] for ds.epoch in (0, 1)]
    unflipped = [fixed[i][0][0] for i in range(20)]
    same = [[torch.equal(a, b) for a, b in zip(epoch, unflipped)] for epoch in firsts]
    assert 0 < sum(same[0]) < 20 and same[0] != same[1]  # about half flipped, differently per epoch


def _slow_cache(vae, out, nproc):
    _run(["preprocess.py", "--dataset", "digits", "--image_size", "32", "--vae", vae, "--out", str(out),
          "--batch_size", "128", "--num_workers", "0", "--shard_size", "300"], nproc=nproc)
    return LatentDataset(str(out))


@pytest.mark.slow
def test_two_process_preprocess_equals_one(tmp_path):
    vae = save_tiny_vae(tmp_path / "vae")
    one, two = _slow_cache(vae, tmp_path / "one", 1), _slow_cache(vae, tmp_path / "two", 2)
    assert len(one) == len(two) == 1797 and one.manifest["count"] == two.manifest["count"]
    for i in (0, 1, 897, 898, 899, 1796):  # around the rank boundary (898)
        (m1, s1), y1 = one[i]
        (m2, s2), y2 = two[i]
        assert y1 == y2
        torch.testing.assert_close((m1, s1), (m2, s2), rtol=1e-5, atol=1e-6)


def test_a_webdataset_cache_streams_like_the_npy_cache_and_resumes_its_shards(cache, tmp_path, monkeypatch):
    """--cache_format webdataset: the same posteriors as the .npy cache, readable by webdataset itself, training
    from it equals training from the .npy cache in the stream's order; an interrupted preprocess restarted with
    --skip_existing keeps the finished shard ranges (their files untouched) and writes only the rest."""
    import webdataset as wds

    from opendit.data.latent_shards import LatentStream

    path, vae = cache
    out = tmp_path / "tars"
    _preprocess(vae, out, "--cache_format", "webdataset", "--shard_size", "500")
    npy, tars = LatentDataset(path), LATENTS(str(out), None)
    assert isinstance(tars, LatentStream) and len(tars) == 1797 and tars.source.sizes == [500, 500, 500, 297]
    for i in (0, 499, 500, 1796):
        torch.testing.assert_close(tars[i][0], npy[i][0], rtol=1e-5, atol=1e-6)
        assert tars[i][1] == npy[i][1]
    first = next(iter(wds.WebDataset(str(out / "s000000-00000.tar"), shardshuffle=False).decode()))
    assert first["__key__"] == "000000000" and first["mean.npy"].shape == (4, 4, 4)
    _, streamed = run_trainer(tiny_cfg(tmp_path / "t", dataset="latents", data_path=str(out), image_size=32,
                                       max_steps=2, shuffle_buffer=100))
    assert all(np.isfinite(streamed))

    # an interrupted run: ranges 0 and 2 finished, range 1 half written
    partial = tmp_path / "again.partial"
    partial.mkdir()
    import shutil
    for j in (0, 2):
        shutil.copy(out / f"s{j:06d}-00000.tar", partial)
        shutil.copy(out / f"s{j:06d}.done.json", partial)
    (partial / "s000001-00000.tar.partial").write_bytes(b"cut")
    kept = {j: (partial / f"s{j:06d}-00000.tar").stat().st_mtime_ns for j in (0, 2)}
    encoded = []
    real = preprocess.encode_slice
    monkeypatch.setattr(preprocess, "encode_slice", lambda *a, **kw: encoded.append(a[2][0]) or real(*a, **kw))
    _preprocess(vae, tmp_path / "again", "--cache_format", "webdataset", "--shard_size", "500", "--skip_existing")
    assert encoded == [500, 1500]  # ranges 1 and 3 only
    assert {j: (tmp_path / "again" / f"s{j:06d}-00000.tar").stat().st_mtime_ns for j in (0, 2)} == kept
    resumed = LATENTS(str(tmp_path / "again"), None)
    torch.testing.assert_close(resumed[700][0], tars[700][0], atol=0, rtol=0)
    with pytest.raises(ValueError, match="--skip_existing keeps finished shards"):
        _preprocess(vae, tmp_path / "npy", "--skip_existing")
