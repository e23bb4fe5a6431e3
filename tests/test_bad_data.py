"""Bad data: unreadable, truncated, zero-byte, decompression-bomb and permission-denied files, empty class folders,
corrupt videos and latent-cache shards. Each is skipped and counted, or refused with an error naming it and the fix.

Permission-denied files are simulated by making `open` raise PermissionError for them (the tests may run as
root, whom chmod 000 does not stop); `test_real_permission_denied_file` uses a real 000 file (as root, read by a
forked child that drops to the user nobody).
"""
import builtins
import importlib.util
import io
import json
import logging
import os
import pickle
import shutil
import struct
import tempfile
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from opendit.data import CaptionedImageDataset, ImageFolderDataset, LatentDataset, VideoCSVDataset, build_dataloader
from opendit.data import skipped as skipped_mod
from opendit.data.latents import MANIFEST, write_shard
from opendit.data.skipped import WARN_FIRST, count_skipped

needs_av = pytest.mark.skipif(importlib.util.find_spec("av") is None, reason="needs PyAV (pip install av)")
KINDS = ("folder", "captions")


def _png_bytes(width=20, height=16, seed=0, fmt="PNG") -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def _bomb_png(width=100_000, height=100_000) -> bytes:
    """A tiny PNG whose header declares width x height pixels (10^10 by default, far over PIL's limit)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _write(root, files: dict) -> dict:
    """files {relative name: bytes} under root, each image with a same-stem .txt caption -> {name: path}."""
    paths = {}
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.with_suffix(".txt").write_text(f"caption of {name}")
        paths[name] = str(path)
    return paths


def _dataset(kind, root, size=8):
    return ImageFolderDataset(str(root), size) if kind == "folder" else CaptionedImageDataset(str(root), size)


def _bad_image_files() -> dict:
    jpeg, png = _png_bytes(48, 40, fmt="JPEG"), _png_bytes(48, 40)
    return {
        "a/truncated.jpg": jpeg[: len(jpeg) // 2],
        "a/truncated.png": png[: len(png) // 2],
        "a/zero.png": b"",
        "b/random.png": np.random.default_rng(0).integers(0, 256, 3000, np.uint8).tobytes(),
        "b/bomb.png": _bomb_png(),
    }


def _warnings(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ---- each kind of bad image ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_each_bad_image_is_skipped_warned_once_and_counted(kind, tmp_path, caplog):
    bad = _write(tmp_path, _bad_image_files())
    _write(tmp_path, {f"{c}/good{i}.png": _png_bytes(seed=i) for c in "ab" for i in range(2)})
    ds = _dataset(kind, tmp_path)
    assert len(ds) == 9
    loader = build_dataloader(ds, global_batch_size=3, dp_size=1, dp_rank=0, seed=0)
    with caplog.at_level(logging.WARNING):
        for epoch in range(2):
            loader.set_epoch(epoch)
            batches = list(loader)
            assert len(batches) == 3 and all(b[0].shape == (3, 3, 8, 8) for b in batches)  # slots refilled
    warned = _warnings(caplog)
    assert len(warned) == 5
    for name, path in bad.items():
        assert sum(path in w for w in warned) == 1, name
    assert any("bomb.png" in w and "DecompressionBombError" in w for w in warned)
    assert ds.num_skipped == 5 and count_skipped(ds) == 5


@pytest.mark.parametrize("kind", KINDS)
def test_decompression_bomb_warning_range_is_skipped(kind, tmp_path, monkeypatch, caplog):
    """PIL only warns between MAX_IMAGE_PIXELS and twice that; opendit skips those images as well."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 400)
    paths = _write(tmp_path, {"a/big.png": _png_bytes(24, 24), "a/small.png": _png_bytes(16, 16, seed=1)})
    ds = _dataset(kind, tmp_path)
    with warnings.catch_warnings(record=True) as leaked, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        x = ds[0][0]  # big.png (576 pixels: over 400, under 800) -> replaced by small.png
    assert ds._bad == {0} and torch.equal(x, ds[1][0])
    assert not [w for w in leaked if issubclass(w.category, Image.DecompressionBombWarning)]
    assert paths["a/big.png"] in caplog.text and "DecompressionBombWarning" in caplog.text


@pytest.mark.parametrize("kind", KINDS)
def test_permission_denied_image_is_skipped(kind, tmp_path, monkeypatch, caplog):
    """Simulated: open() raises PermissionError for the file, as it would for another user's 0600 file."""
    paths = _write(tmp_path, {"a/locked.png": _png_bytes(), "a/open.png": _png_bytes(seed=1)})
    ds = _dataset(kind, tmp_path)
    real_open = builtins.open

    def guarded_open(file, *args, **kwargs):
        if os.fspath(file) == paths["a/locked.png"]:
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    with caplog.at_level(logging.WARNING):
        x = ds[0][0]
    assert ds._bad == {0} and torch.equal(x, ds[1][0])
    assert "locked.png" in caplog.text and "PermissionError" in caplog.text


def test_real_permission_denied_file(tmp_path):
    """A real 000 file. Root reads any file, so as root the reading runs in a forked child that drops to nobody."""
    folder = tempfile.mkdtemp()  # (pytest's tmp_path sits in a 0700 folder that nobody may not enter)
    try:
        os.chmod(folder, 0o755)
        paths = _write(Path(folder), {"a/locked.png": _png_bytes(), "a/open.png": _png_bytes(seed=1)})
        os.chmod(os.path.dirname(paths["a/locked.png"]), 0o755)
        os.chmod(paths["a/open.png"], 0o644)
        os.chmod(paths["a/locked.png"], 0)
        ds = ImageFolderDataset(folder, 8)
        Image.open(paths["a/open.png"]).load()  # PIL's plugins imported before the child may lose access to them
        if os.geteuid() != 0:
            ds[0]
            assert ds._bad == {0} and ds.skips.reasons == {"PermissionError": 1}
            return
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                ds[0]
                code = 0 if ds._bad == {0} and ds.skips.reasons == {"PermissionError": 1} else 2
            finally:
                os.write(write_end, bytes([code]))
                os._exit(0)
        os.close(write_end)
        result = os.read(read_end, 1)
        os.waitpid(pid, 0)
        assert result == b"\x00", f"child reported {result!r} (1: an exception, 2: not skipped as PermissionError)"
    finally:
        os.chmod(os.path.join(folder, "a", "locked.png"), 0o600)
        shutil.rmtree(folder, ignore_errors=True)


def test_unreadable_caption_file_skips_its_image(tmp_path, monkeypatch, caplog):
    paths = _write(tmp_path, {"locked.png": _png_bytes(), "open.png": _png_bytes(seed=1)})
    locked_txt = paths["locked.png"][:-4] + ".txt"
    real_open = builtins.open

    def guarded_open(file, *args, **kwargs):
        if os.fspath(file) == locked_txt:
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    with caplog.at_level(logging.WARNING):
        ds = CaptionedImageDataset(str(tmp_path), 8)
    assert [os.path.basename(p) for p, _ in ds.samples] == ["open.png"] and ds.num_uncaptioned == 1
    assert "locked.txt" in caplog.text and "PermissionError" in caplog.text


def test_unlistable_folder_is_named(tmp_path, monkeypatch, caplog):
    _write(tmp_path, {"a/x.png": _png_bytes(), "b/hidden_from_us/y.png": _png_bytes(seed=1)})
    locked = str(tmp_path / "b" / "hidden_from_us")
    real_scandir = os.scandir

    def guarded_scandir(path="."):
        if isinstance(path, str) and path == locked:  # (rmtree passes file descriptors)
            raise PermissionError(13, "Permission denied", locked)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", guarded_scandir)
    with caplog.at_level(logging.WARNING):
        ds = ImageFolderDataset(str(tmp_path), 8)
    assert len(ds) == 1
    assert f"skipping folder {locked}: cannot list it" in caplog.text and "permissions" in caplog.text
    assert "'b'" in caplog.text  # and b, now without images, is named as an empty class


# ---- empty classes, nothing usable ------------------------------------------------------------------------------
def test_empty_class_folders_keep_labels_and_are_named_once(tmp_path, caplog):
    _write(tmp_path, {"apple/1.png": _png_bytes(), "zebra/1.png": _png_bytes(seed=1)})
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes_only").mkdir()
    (tmp_path / "notes_only" / "readme.txt").write_text("no images here")
    with caplog.at_level(logging.WARNING):
        ds = ImageFolderDataset(str(tmp_path), 8)
    assert ds.classes == ["apple", "empty", "notes_only", "zebra"] and ds.num_classes == 4
    assert [label for _, label in ds.samples] == [0, 3]  # labels stay the sorted folder names
    warned = _warnings(caplog)
    assert len(warned) == 1 and "2 of 4 class folders hold no images ('empty', 'notes_only')" in warned[0]
    assert str(tmp_path) in warned[0]


@pytest.mark.parametrize("kind", KINDS)
def test_only_unreadable_images_is_a_clear_error(kind, tmp_path):
    files = _bad_image_files()
    del files["b/bomb.png"]
    _write(tmp_path, files)
    ds = _dataset(kind, tmp_path)
    with pytest.raises(RuntimeError) as info:
        ds[2]
    message = str(info.value)
    assert f"all 4 {'captioned images of' if kind == 'captions' else 'images under'} {str(tmp_path)!r}" in message
    assert "are unreadable (" in message and "UnidentifiedImageError" in message and "OSError" in message
    assert "truncated by an interrupted download" in message and "permissions" in message
    assert "--dataset " + ("captioned_digits" if kind == "captions" else "digits") in message


# ---- the total across workers, epochs and ranks; capped warnings --------------------------------------------------
@pytest.fixture()
def three_bad(tmp_path):
    files = {f"a/good{i}.png": _png_bytes(12, 12, seed=i) for i in range(9)}
    files.update({"a/zbad0.png": b"", "a/zbad1.png": b"not a png", "a/zbad2.jpg": b"\xff\xd8\xff"})  # 9, 10, 11
    _write(tmp_path, files)
    return tmp_path


@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)])
def test_count_skipped_across_workers_and_epochs(three_bad, num_workers, persistent):
    ds = ImageFolderDataset(str(three_bad), 8)
    loader = build_dataloader(ds, global_batch_size=4, dp_size=1, dp_rank=0, seed=0, num_workers=num_workers)
    if persistent:  # the same sampler, with workers that live across epochs
        loader = DataLoader(ds, batch_size=4, sampler=loader.sampler, num_workers=2, persistent_workers=True)
    for epoch in range(3):  # the shuffle hands each bad file to another worker in another epoch
        loader.sampler.set_epoch(epoch)
        assert sum(len(y) for _, y in loader) == 12
        assert count_skipped(ds) == 3  # distinct files, not one per worker or epoch
    assert ds.num_skipped == (3 if num_workers == 0 else 0)  # workers' finds never reach this copy


def test_copies_share_the_count_and_warn_once(three_bad, caplog):
    """Pickled copies are what spawned DataLoader workers get; a forked worker shares the folder the same way."""
    ds = ImageFolderDataset(str(three_bad), 8)
    worker0, worker1 = pickle.loads(pickle.dumps(ds)), pickle.loads(pickle.dumps(ds))
    with caplog.at_level(logging.WARNING):
        for i in range(len(ds)):
            worker0[i]
        for i in range(len(ds)):
            worker1[i]
    assert worker0.num_skipped == worker1.num_skipped == 3 and ds.num_skipped == 0
    assert len(_warnings(caplog)) == 3 and count_skipped(ds) == 3


def test_count_skipped_unions_ranks(three_bad, monkeypatch):
    """Both ranks met bad file 11 (in two epochs), the other rank also file 9: 2 distinct files, not 3."""
    ds = ImageFolderDataset(str(three_bad), 8)
    ds[11]  # this rank finds file 11 (zbad2.jpg), then reads file 0
    sent = []

    def all_gather_object(out, obj, group=None):
        sent.append(obj)
        out[0], out[1] = obj, ([9, 11] if len(sent) == 1 else [])

    monkeypatch.setattr(skipped_mod.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(skipped_mod.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(skipped_mod.dist, "all_gather_object", all_gather_object)
    assert count_skipped(ds) == 2
    ds[10]  # zbad1.png
    assert count_skipped(ds) == 3
    assert sent == [[11], [10]]  # each index travels once


def test_count_skipped_of_datasets_without_files():
    assert count_skipped(torch.utils.data.TensorDataset(torch.zeros(4, 2))) == 0


def test_warnings_are_capped(tmp_path, caplog):
    files = {f"a/bad{i:03d}.png": b"" for i in range(120)}
    files["a/zz_good.png"] = _png_bytes()
    _write(tmp_path, files)
    ds = ImageFolderDataset(str(tmp_path), 8)
    with caplog.at_level(logging.WARNING):
        ds[0]  # reads bad000 .. bad119, then the good one
    warned = _warnings(caplog)
    assert ds.num_skipped == 120 and count_skipped(ds) == 120
    assert len(warned) == WARN_FIRST + 2  # 10 files, "further ... not logged one by one", "... 100 ... so far"
    assert sum("skipping unreadable image" in w for w in warned) == WARN_FIRST
    assert "not logged one by one" in warned[WARN_FIRST] and "100 unreadable images skipped so far" in warned[-1]


def test_skip_folder_is_removed_with_the_dataset(three_bad):
    ds = ImageFolderDataset(str(three_bad), 8)
    folder = ds.skips.folder
    assert os.path.isdir(folder)
    del ds
    import gc

    gc.collect()
    assert not os.path.exists(folder)


def test_folders_of_ended_processes_are_swept(three_bad, tmp_path, monkeypatch):
    """Entry scripts end with os._exit (no finalizers): the next dataset removes folders of dead pids, after an hour."""
    import subprocess

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    old, fresh, alive = (tmp_path / "tmp" / f"opendit-skipped-{pid}-x{i}"
                         for i, pid in enumerate((dead.pid, dead.pid, os.getpid())))
    for folder in (old, fresh, alive):
        folder.mkdir()
        (folder / "3").touch()
    for folder in (old, alive):
        os.utime(folder, (0, 0))
    ds = ImageFolderDataset(str(three_bad), 8)
    assert not old.exists() and fresh.exists() and alive.exists()
    assert ds.skips.folder.startswith(str(tmp_path / "tmp" / f"opendit-skipped-{os.getpid()}-"))


# ---- videos -------------------------------------------------------------------------------------------------------
@needs_av
def test_bad_videos_zero_byte_truncated_missing(tmp_path, caplog):
    from opendit.data import write_mp4

    frames = np.random.default_rng(0).integers(0, 256, (12, 16, 16, 3), np.uint8)
    good = open(write_mp4(str(tmp_path / "good.mp4"), frames), "rb").read()
    (tmp_path / "zero.mp4").write_bytes(b"")
    (tmp_path / "half.mp4").write_bytes(good[: len(good) // 2])
    (tmp_path / "random.mp4").write_bytes(np.random.default_rng(1).integers(0, 256, 2048, np.uint8).tobytes())
    (tmp_path / "list.csv").write_text("path,label\nzero.mp4,0\nhalf.mp4,1\nmissing.mp4,2\nrandom.mp4,3\ngood.mp4,4\n")
    ds = VideoCSVDataset(str(tmp_path / "list.csv"), image_size=8, num_frames=4)
    with caplog.at_level(logging.WARNING):
        labels = [ds[i][1] for i in range(len(ds))]
    assert labels == [4] * 5 and ds._bad == {0, 1, 2, 3} and count_skipped(ds) == 4
    warned = _warnings(caplog)
    assert len(warned) == 4
    for name in ("zero.mp4", "half.mp4", "missing.mp4", "random.mp4"):
        assert sum(name in w for w in warned) == 1
    (tmp_path / "bad.csv").write_text("path,label\nzero.mp4,0\nmissing.mp4,1\n")
    with pytest.raises(RuntimeError, match=r"all 2 videos listed in .*bad\.csv.* are unreadable \(.*"
                                           r"FileNotFoundError.*likely causes.*--dataset moving_digits"):
        VideoCSVDataset(str(tmp_path / "bad.csv"), image_size=8, num_frames=4)[0]


# ---- latent caches ------------------------------------------------------------------------------------------------
def _latent_cache(root, shards=2, per_shard=3):
    root.mkdir()
    entries = []
    for k in range(shards):
        rng = np.random.default_rng(k)
        entries.append(write_shard(str(root), f"r000-{k:05d}", {
            "mean": rng.standard_normal((per_shard, 4, 2, 2)).astype(np.float32),
            "std": np.ones((per_shard, 4, 2, 2), np.float32),
            "label": np.arange(per_shard, dtype=np.int64)}))
    manifest = dict(version=1, image_size=16, latent_shape=[4, 2, 2], num_classes=3, classes=["a", "b", "c"],
                    count=shards * per_shard, flip_both=False, shards=entries)
    (root / MANIFEST).write_text(json.dumps(manifest))
    return root


def test_latent_cache_truncated_or_corrupt_shard(tmp_path):
    cache = _latent_cache(tmp_path / "cache")
    assert len(LatentDataset(str(cache))) == 6
    shard = cache / "r000-00001.mean.npy"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(ValueError, match=r"shard file r000-00001\.mean\.npy is truncated \(\d+ of \d+ bytes\).*"
                                         r"re-run preprocess\.py"):
        LatentDataset(str(cache))
    shard.write_bytes(b"garbage" * 20)
    with pytest.raises(ValueError, match=r"r000-00001\.mean\.npy has no valid \.npy header.*re-run preprocess\.py"):
        LatentDataset(str(cache))
    np.save(shard, np.zeros((2, 4, 2, 2), np.float32))
    with pytest.raises(ValueError, match=r"r000-00001\.mean\.npy holds shape \(2, 4, 2, 2\), the manifest says 3"):
        LatentDataset(str(cache))
    shard.write_bytes(data)
    ds = LatentDataset(str(cache))
    shard.write_bytes(data[:-10])  # damaged after the dataset was built (another job rewriting the cache)
    with pytest.raises(ValueError, match=r"cannot read shard file r000-00001\.mean\.npy.*re-run preprocess\.py"):
        ds[4]
