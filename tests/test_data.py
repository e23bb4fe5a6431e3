import logging

import numpy as np
import pytest
import torch
from PIL import Image

from opendit.data import (DIGITS, FOLDER, DigitsDataset, ImageFolderDataset, ResumableDistributedSampler,
                          build_dataloader, center_crop_arr, digits_split)


# ---- digits -------------------------------------------------------------------------------------
def test_digits_count_classes_range_shape():
    ds = DigitsDataset(image_size=24)
    assert len(ds) == 1797 and ds.num_classes == 10 and ds.channels == 1
    x, y = ds[0]
    assert x.shape == (1, 24, 24) and x.dtype == torch.float32 and isinstance(y, int)
    xs = torch.stack([ds[i][0] for i in range(0, 1797, 97)])
    assert xs.min() == -1.0 and xs.max() == 1.0  # background is exactly -1, full ink exactly 1
    assert sorted({ds[i][1] for i in range(40)}) == list(range(10))
    rgb, _ = DigitsDataset(image_size=12, channels=3)[3]
    assert rgb.shape == (3, 12, 12) and torch.equal(rgb[0], rgb[2])


@pytest.mark.parametrize("where", ["scikit-learn's file", "load_digits"])
def test_digits_read_without_scikit_learn_equal_load_digits(monkeypatch, where):
    """The digits come from scikit-learn's csv directly (no 1.3 s import per process), or from load_digits where
    the file is not found: the same arrays either way."""
    import importlib.util

    from sklearn.datasets import load_digits

    from opendit.data import digits
    if where == "load_digits":
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    images, labels = digits._load_raw()
    bunch = load_digits()
    assert images.dtype == np.float32 and labels.dtype == np.int64 and images.flags.c_contiguous
    assert np.array_equal(images, bunch.images) and np.array_equal(labels, bunch.target)


def test_digits_split_deterministic_and_stratified():
    (xa, ya), (xh, yh) = digits_split()
    (xa2, _), (xh2, yh2) = digits_split()
    assert len(ya) + len(yh) == 1797 and np.array_equal(xh, xh2) and np.array_equal(yh, yh2)
    assert xa.shape[1:] == (8, 8) and xa.max() == 16 and xa.min() == 0
    assert np.array_equal(np.unique(yh), np.arange(10))
    assert len(DigitsDataset(8, split="held_out")) == len(yh)
    (_, _), (_, other) = digits_split(seed=1)
    assert not np.array_equal(yh, other)


# ---- center crop --------------------------------------------------------------------------------
def _noise_image(width, height, seed=0, mode="RGB"):
    rng = np.random.default_rng(seed)
    channels = (3,) if mode == "RGB" else ()
    return Image.fromarray(rng.integers(0, 256, (height, width) + channels, dtype=np.uint8))


@pytest.mark.parametrize("width,height", [(64, 40), (40, 64), (30, 10), (17, 16), (100, 100)])
def test_center_crop_size_and_steps(width, height):
    image = _noise_image(width, height)
    out = center_crop_arr(image, 16)
    assert out.size == (16, 16)
    # the ADM recipe, spelled out: BOX halving while short side >= 32, BICUBIC to short side 16, crop
    ref = image
    while min(ref.size) >= 32:
        ref = ref.resize((ref.size[0] // 2, ref.size[1] // 2), Image.BOX)
    s = 16 / min(ref.size)
    ref = ref.resize((round(ref.size[0] * s), round(ref.size[1] * s)), Image.BICUBIC)
    arr = np.asarray(ref)
    top, left = (arr.shape[0] - 16) // 2, (arr.shape[1] - 16) // 2
    assert np.array_equal(np.asarray(out), arr[top:top + 16, left:left + 16])


def test_center_crop_keeps_the_middle():
    arr = np.zeros((20, 60, 3), np.uint8)
    arr[:, 20:40] = 255  # white middle third of a wide image
    out = np.asarray(center_crop_arr(Image.fromarray(arr), 10))
    assert out.shape == (10, 10, 3) and out[:, 2:8].min() > 200


# ---- image folders ------------------------------------------------------------------------------
@pytest.fixture()
def folder(tmp_path):
    (tmp_path / "cat").mkdir()
    (tmp_path / "dog").mkdir()
    (tmp_path / "dog" / "nested").mkdir()
    for i, (w, h) in enumerate([(40, 24), (24, 40), (32, 32)]):
        _noise_image(w, h, seed=i).save(tmp_path / "cat" / f"c{i}.png")
    _noise_image(50, 30, seed=10).save(tmp_path / "dog" / "d0.JPG", quality=95)
    _noise_image(30, 50, seed=11, mode="L").save(tmp_path / "dog" / "nested" / "d1.jpeg")
    (tmp_path / "dog" / "notes.txt").write_text("not an image, and not an image extension either")
    bad = {
        "cat/zero.png": b"",
        "dog/garbage.jpg": b"this is not a jpeg at all" * 20,
    }
    good = (tmp_path / "cat" / "c0.png").read_bytes()
    bad["dog/truncated.png"] = good[: len(good) // 2]
    for name, data in bad.items():
        (tmp_path / name).write_bytes(data)
    return tmp_path, [str(tmp_path / n) for n in bad]


def test_folder_labels_and_listing(folder):
    root, _ = folder
    ds = ImageFolderDataset(str(root), 16)
    assert ds.classes == ["cat", "dog"] and ds.num_classes == 2
    assert len(ds) == 8  # 5 good + 3 bad files; notes.txt ignored
    assert [label for _, label in ds.samples] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_corrupt_files_skipped_counted_and_batches_stay_full(folder, caplog):
    root, bad_paths = folder
    ds = ImageFolderDataset(str(root), 16, seed=3)
    loader = build_dataloader(ds, global_batch_size=4, dp_size=1, dp_rank=0, seed=0)
    with caplog.at_level(logging.WARNING, logger="opendit.data.image_folder"):
        for epoch in range(2):
            loader.set_epoch(epoch)
            batches = list(loader)
            assert len(batches) == 2
            for x, y in batches:
                assert x.shape == (4, 3, 16, 16) and y.shape == (4,)
                assert x.min() >= -1 and x.max() <= 1
    assert ds.num_skipped == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3  # one per bad file, not one per epoch
    for path in bad_paths:
        assert sum(path in w for w in warnings) == 1


def test_all_files_corrupt_raises(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.png").write_bytes(b"")
    ds = ImageFolderDataset(str(tmp_path), 8)
    with pytest.raises(RuntimeError, match="all 1 images.*unreadable"):
        ds[0]


def _flip_pattern(ds, epoch, ref):
    ds.set_epoch(epoch)
    flips = []
    for i in range(len(ds)):
        x, plain = ds[i][0], ref[i][0]
        assert torch.equal(x, plain) or torch.equal(x, plain.flip(-1))
        flips.append(not torch.equal(x, plain))
    return flips


def test_flip_deterministic_per_seed_epoch_index(tmp_path):
    (tmp_path / "a").mkdir()
    for i in range(12):
        _noise_image(20, 20, seed=i).save(tmp_path / "a" / f"{i:02d}.png")
    ref = ImageFolderDataset(str(tmp_path), 8, random_flip=False)
    one, two = (ImageFolderDataset(str(tmp_path), 8, seed=5) for _ in range(2))
    patterns = [_flip_pattern(one, e, ref) for e in range(3)]
    assert patterns == [_flip_pattern(two, e, ref) for e in (0, 1, 2)]  # same (seed, epoch, index)
    assert all(any(p) and not all(p) for p in patterns)
    assert patterns[0] != patterns[1] != patterns[2]
    other_seed = ImageFolderDataset(str(tmp_path), 8, seed=6)
    assert _flip_pattern(other_seed, 0, ref) != patterns[0]
    # order of access does not matter (no hidden RNG state)
    one.set_epoch(1)
    assert [not torch.equal(one[i][0], ref[i][0]) for i in reversed(range(12))] == patterns[1][::-1]


def test_epoch_reaches_dataloader_workers(tmp_path):
    (tmp_path / "a").mkdir()
    for i in range(8):
        _noise_image(12, 12, seed=i).save(tmp_path / "a" / f"{i}.png")
    ds = ImageFolderDataset(str(tmp_path), 8, seed=1)
    loader = build_dataloader(ds, 4, 1, 0, seed=0, num_workers=2)
    loader.set_epoch(2)
    # the loop sets the epoch on the loader; the worker copies of the dataset must flip for epoch 2
    expected_ds = ImageFolderDataset(str(tmp_path), 8, seed=1)
    expected_ds.set_epoch(2)
    expected = torch.stack([expected_ds[i][0] for i in loader.sampler])
    assert torch.equal(torch.cat([x for x, _ in loader]), expected)


# ---- clear errors -------------------------------------------------------------------------------
def test_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing_dir.*--data_path.*--dataset digits"):
        ImageFolderDataset(str(tmp_path / "missing_dir"), 16)
    with pytest.raises(FileNotFoundError, match="no class folders"):
        ImageFolderDataset(str(tmp_path), 16)
    (tmp_path / "empty_class").mkdir()
    (tmp_path / "empty_class" / "readme.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="no images found.*expected layout"):
        ImageFolderDataset(str(tmp_path), 16)


def test_dataset_spec_errors():
    for bad in (0, -8, 16.0, "16", None, True):
        with pytest.raises(ValueError, match="image_size must be a positive int"):
            DIGITS(image_size=bad)
    with pytest.raises(ValueError, match="'folder' needs a data path; pass --data_path <folder of class folders> or "
                                         "use --dataset digits"):
        FOLDER(image_size=16)
    assert isinstance(DIGITS(image_size=8, channels=3), DigitsDataset)


def test_batch_not_divisible_names_both_numbers():
    ds = DigitsDataset(8)
    with pytest.raises(ValueError, match="global batch size 10 is not divisible by the data-parallel size 4"):
        build_dataloader(ds, global_batch_size=10, dp_size=4, dp_rank=0, seed=0)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        ResumableDistributedSampler(5, 2, 0, global_batch_size=8)


# ---- sampler ------------------------------------------------------------------------------------
def _samplers(n, dp, gbs, **kw):
    return [ResumableDistributedSampler(n, dp, r, global_batch_size=gbs, **kw) for r in range(dp)]


def _global_batches(samplers):
    """Reassemble global batches from the ranks' streams: [num_batches, G] as lists."""
    b = samplers[0].local_batch_size
    per_rank = [list(s) for s in samplers]
    n_batches = len(per_rank[0]) // b
    return [sum((per_rank[r][k * b:(k + 1) * b] for r in range(len(samplers))), []) for k in range(n_batches)]


@pytest.mark.parametrize("drop_last", [True, False])
def test_shards_disjoint_and_cover_epoch(drop_last):
    samplers = _samplers(103, 4, 8, seed=7, drop_last=drop_last)
    streams = [list(s) for s in samplers]
    assert all(len(st) == len(s) for st, s in zip(streams, samplers))
    assert len({len(st) for st in streams}) == 1
    flat = sum(streams, [])
    if drop_last:
        assert len(flat) == 96 and len(set(flat)) == 96  # disjoint; 103 % 8 = 7 dropped
    else:
        assert len(flat) == 104 and set(flat) == set(range(103))  # all covered, one padded sample
    perm = samplers[0].permutation().tolist()
    assert sum(_global_batches(samplers), []) == (perm + perm)[: len(flat)]  # rank slices of each global batch


def test_epochs_and_seeds_change_the_order():
    s = ResumableDistributedSampler(50, 1, 0, seed=0)
    e0 = list(s)
    s.set_epoch(1)
    assert list(s) != e0 and sorted(s) == list(range(50))
    assert list(ResumableDistributedSampler(50, 1, 0, seed=1)) != e0
    assert list(ResumableDistributedSampler(50, 1, 0, seed=0)) == e0
    assert list(ResumableDistributedSampler(50, 1, 0, shuffle=False)) == list(range(50))


def test_resume_same_dp_size_gives_identical_rest():
    full = _global_batches(_samplers(100, 2, 10, seed=3))
    run = _samplers(100, 2, 10, seed=3)
    for s in run:
        s.advance(4)  # trained on 4 global batches
    states = [s.state_dict() for s in run]
    assert all(st == states[0] for st in states) and states[0]["consumed"] == 40
    resumed = _samplers(100, 2, 10, seed=3)
    for s in resumed:
        s.load_state_dict(states[0])
        s.set_epoch(0)  # the training loop re-enters the saved epoch: the position must survive
    assert _global_batches(resumed) == full[4:]
    assert len(resumed[0]) == 30


@pytest.mark.parametrize("new_dp", [1, 2, 8])
def test_resume_other_dp_size_gives_same_global_batches(new_dp):
    full = _global_batches(_samplers(100, 4, 16, seed=0))
    saver = ResumableDistributedSampler(100, 4, 1, global_batch_size=16, seed=0)
    saver.advance(2)
    state = saver.state_dict()
    resumed = _samplers(100, new_dp, 16, seed=0)
    for s in resumed:
        s.load_state_dict(state)
    assert _global_batches(resumed) == full[2:]


def test_epoch_end_and_state_checks():
    s = ResumableDistributedSampler(20, 2, 0, global_batch_size=4, seed=0)
    s.advance(10)  # past the end is clamped to the epoch's end
    assert s.epoch_finished and list(s) == [] and s.consumed == 20
    s.set_epoch(1)
    assert s.consumed == 0 and len(list(s)) == 10
    with pytest.raises(ValueError, match="dataset of 20 samples, this one has 30"):
        ResumableDistributedSampler(30, 2, 0, global_batch_size=4).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="seed 0"):
        ResumableDistributedSampler(20, 2, 0, global_batch_size=4, seed=9).load_state_dict(s.state_dict())


# ---- loader end to end --------------------------------------------------------------------------
def test_loader_resume_mid_epoch_and_global_rng_untouched():
    ds = DigitsDataset(8)
    loader = build_dataloader(ds, global_batch_size=64, dp_size=2, dp_rank=1, seed=11)
    assert loader.batch_size == 32 and loader.sampler.num_replicas == 2
    rng = torch.get_rng_state()
    it = iter(loader)
    assert torch.equal(torch.get_rng_state(), rng)  # iter() must not draw from the global RNG
    seen = []
    for step, (x, y) in enumerate(it):
        seen.append((x, y))
        loader.advance()
        if step == 4:
            state = loader.state_dict()
    assert len(seen) == 1797 // 64
    resumed = build_dataloader(ds, global_batch_size=64, dp_size=2, dp_rank=1, seed=11)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(seen) - 5
    for (x, y), (x2, y2) in zip(seen[5:], rest):
        assert torch.equal(x, x2) and torch.equal(y, y2)
