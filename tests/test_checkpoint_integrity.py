"""Checkpoint integrity: the manifest (sizes and CRC-32 of every file), verification on load, `latest` and
`--load auto` falling back past a bad checkpoint, a full disk during a save (a real EFBIG in a subprocess),
and step directories from before manifests."""
import errno
import json
import logging
import multiprocessing
import os
import zlib

import pytest
import torch

from opendit.checkpoint import manifest as integrity
from opendit.checkpoint import save as ckpt_save
from opendit.checkpoint import (CheckpointCorruptError, find_resume_checkpoint, latest_run_checkpoint,
                                load_checkpoint, load_weights, resolve_checkpoint, save_checkpoint)
from tests.distributed import run_distributed
from tests.test_checkpoint import make_run, run_steps
from tests.test_ema import tiny_dit


def saved_run(root, steps=(1,), seed=0):
    """A model + AdamW + EMA + scheduler run saved at each of `steps`; (run, {step: path})."""
    run = make_run("none", seed=seed)
    paths = {}
    for step in steps:
        run_steps(run, torch.Generator().manual_seed(step), 1)
        paths[step] = save_checkpoint(str(root), step, *run)
    return run, paths


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def truncate(path, keep=0.5):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


def flip_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def test_manifest_lists_every_file_with_its_size_and_crc32(tmp_path):
    _, paths = saved_run(tmp_path)
    step = paths[1]
    manifest = json.loads(open(os.path.join(step, "manifest.json")).read())
    on_disk = sorted(os.path.relpath(os.path.join(d, f), step) for d, _, fs in os.walk(step) for f in fs)
    assert sorted(manifest["files"]) == [f for f in on_disk if f != "manifest.json"]
    assert {"__0_0.distcp", ".metadata", "trainer.pt", "meta.json", "ranks/rank-00000.pt"} <= set(manifest["files"])
    for name, entry in manifest["files"].items():
        data = open(os.path.join(step, name), "rb").read()
        assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name
    # the DCP files are checksummed by the rank that wrote them: the writer reports them
    writer = ckpt_save.RecordingWriter(str(tmp_path / "w"))
    import torch.distributed.checkpoint as dcp
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"x": torch.ones(3)}, storage_writer=writer, no_dist=True)
    assert writer.written == {"__0_0.distcp"}


@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata", "trainer.pt", "ranks/rank-00000.pt", "meta.json"])
def test_a_truncated_file_is_an_error_naming_it(tmp_path, victim):
    _, paths = saved_run(tmp_path)
    truncate(os.path.join(paths[1], victim))
    with pytest.raises(CheckpointCorruptError, match=rf"{victim}.*truncated.*earlier step folder"):
        load_checkpoint(paths[1], *make_run("none", seed=1))
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        resolve_checkpoint("latest", str(tmp_path))  # the only checkpoint: nothing to fall back to


def test_a_flipped_byte_fails_the_checksum_and_checksums_false_skips_it(tmp_path):
    _, paths = saved_run(tmp_path)
    flip_byte(os.path.join(paths[1], "__0_0.distcp"))
    with pytest.raises(CheckpointCorruptError, match=r"__0_0.distcp has CRC-32 \w+, the manifest says"):
        load_checkpoint(paths[1], *make_run("none", seed=1))
    with pytest.raises(CheckpointCorruptError, match="CRC-32"):
        load_weights(paths[1])  # sample.py's reading of a step folder verifies too
    load_checkpoint(paths[1], tiny_dit(seed=1), checksums=False)  # sizes only: the same size loads


def test_latest_falls_back_to_the_previous_verifying_checkpoint_with_a_warning(tmp_path, caplog):
    outputs = tmp_path / "outputs"
    root = outputs / "000-DiT-debug" / "checkpoints"
    _, paths = saved_run(root, steps=(1, 2, 3))
    fresh = tiny_dit(seed=5)
    load_checkpoint(paths[2], fresh)
    model_at_2 = params(fresh)
    truncate(os.path.join(paths[3], "__0_0.distcp"))
    with caplog.at_level(logging.WARNING):
        assert resolve_checkpoint("latest", str(root)) == paths[2]
        assert latest_run_checkpoint(str(outputs)) == paths[2]
        assert find_resume_checkpoint(str(outputs)) == paths[2]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned and all("skipping checkpoint" in w and "step-000003" in w and "truncated" in w for w in warned)
    fresh = tiny_dit(seed=6)
    load_checkpoint(latest_run_checkpoint(str(outputs)), fresh)
    assert all(torch.equal(p, model_at_2[n]) for n, p in fresh.named_parameters())
    flip_byte(os.path.join(paths[2], "trainer.pt"))  # checksum failure: skipped too
    assert resolve_checkpoint("latest", str(root)) == paths[1]
    assert resolve_checkpoint("latest", str(root), checksums=False) == paths[2]  # sizes only
    os.remove(os.path.join(paths[1], "trainer.pt"))  # incomplete: not a candidate at all
    with pytest.raises(CheckpointCorruptError, match="step-000003.*truncated.*step-000002.*CRC-32"):
        latest_run_checkpoint(str(outputs))
    with pytest.raises(CheckpointCorruptError, match="none verifies"):
        find_resume_checkpoint(str(outputs))  # checkpoints exist: never silently start over


def test_find_resume_checkpoint_for_load_auto(tmp_path):
    outputs = tmp_path / "outputs"
    assert find_resume_checkpoint(str(outputs)) is None  # no outputs folder yet: a first start
    (outputs / "000-DiT-debug").mkdir(parents=True)  # a run that stopped before its first checkpoint
    assert find_resume_checkpoint(str(outputs)) is None
    model = tiny_dit()
    save_checkpoint(str(outputs / "999-DiT-debug" / "checkpoints"), 5, model)
    newest = save_checkpoint(str(outputs / "1000-DiT-debug" / "checkpoints"), 7, model)  # numeric order
    leftover = outputs / "1000-DiT-debug" / "checkpoints" / ".tmp-step-000009"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"partial")
    assert latest_run_checkpoint(str(outputs)) == newest and leftover.exists()  # latest only ignores it
    assert find_resume_checkpoint(str(outputs)) == newest
    assert not leftover.exists()  # a start with --load auto removes it


def test_a_checkpoint_without_manifest_still_loads_unverified(tmp_path, caplog):
    run, paths = saved_run(tmp_path)
    os.remove(os.path.join(paths[1], "manifest.json"))  # as saved before manifests existed
    with caplog.at_level(logging.INFO, logger="opendit.checkpoint.manifest"):
        assert resolve_checkpoint("latest", str(tmp_path)) == paths[1]
        fresh = make_run("none", seed=3)
        step, _ = load_checkpoint(paths[1], *fresh)
    assert step == 1 and all(torch.equal(p, q) for p, q in zip(fresh[0].parameters(), run[0].parameters()))
    assert any("no manifest.json" in r.getMessage() and "not verified" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("content, match", [(b"{not json", "JSONDecodeError"), (b"\xff\xfe\x00", "UnicodeDecodeError"),
                                            (b"[1, 2]", "ValueError: not the object save_checkpoint writes")])
def test_a_corrupt_meta_json_or_manifest_is_an_error_naming_it(tmp_path, content, match):
    _, paths = saved_run(tmp_path)
    step = paths[1]
    (tmp_path / "step-000001" / "meta.json").write_bytes(content)
    with pytest.raises(CheckpointCorruptError, match="meta.json"):  # with the manifest: its size or checksum
        load_checkpoint(step, tiny_dit())
    os.remove(os.path.join(step, "manifest.json"))  # without one: the parse itself
    with pytest.raises(CheckpointCorruptError, match=rf"meta.json is corrupt \({match}.*earlier step folder"):
        load_checkpoint(step, tiny_dit())
    with open(os.path.join(step, "manifest.json"), "wb") as f:
        f.write(content)
    with pytest.raises(CheckpointCorruptError, match=r"manifest.json is corrupt.*delete manifest.json"):
        load_checkpoint(step, tiny_dit())


def test_latest_then_load_reads_each_file_for_its_checksum_once(tmp_path, monkeypatch):
    _, paths = saved_run(tmp_path)
    integrity._VERIFIED.clear()  # the save remembered its own checksums; start as a new process would
    calls = []
    real = integrity.crc32_file
    monkeypatch.setattr(integrity, "crc32_file", lambda p: calls.append(os.path.basename(p)) or real(p))
    load_checkpoint(resolve_checkpoint("latest", str(tmp_path)), *make_run("none", seed=1))
    assert sorted(calls) == sorted(set(calls)) and "__0_0.distcp" in calls


# ---- a full disk (a real EFBIG from RLIMIT_FSIZE) during a save -------------------------------------------

def _save_on_a_full_disk(root, queue):
    """Child process: a good save at step 1, then a file size limit below the shard's size, then step 2."""
    import resource
    import signal

    model = tiny_dit(seed=0)
    first = save_checkpoint(root, 1, model)
    limit = os.path.getsize(os.path.join(first, "__0_0.distcp")) // 2
    with torch.no_grad():
        model.pos_embed.add_(1.0)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        save_checkpoint(root, 2, model)
        queue.put(("saved", None, None))
    except Exception as e:
        queue.put((type(e).__name__, getattr(e, "errno", None), str(e)))


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    outputs = tmp_path / "outputs"
    root = outputs / "000-DiT-debug" / "checkpoints"
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_save_on_a_full_disk, args=(str(root), queue))
    proc.start()
    kind, err, message = queue.get(timeout=120)
    proc.join(timeout=60)
    assert kind == "OSError" and err == errno.EFBIG, (kind, err, message)
    assert str(root / "step-000002") in message and "disk may be full" in message
    assert "previous checkpoint" in message and ".tmp-step-000002" in message
    assert (root / ".tmp-step-000002").is_dir() and not (root / "step-000002").exists()
    assert latest_run_checkpoint(str(outputs)) == str(root / "step-000001")  # the leftover is ignored
    fresh = tiny_dit(seed=3)
    load_checkpoint(str(root / "step-000001"), fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), tiny_dit(seed=0).parameters()))
    assert find_resume_checkpoint(str(outputs)) == str(root / "step-000001")  # the next start cleans up
    assert sorted(os.listdir(root)) == ["step-000001"]


def test_a_save_error_names_the_folder_and_the_cause(tmp_path, monkeypatch):
    """ENOSPC from a small file (rank file, trainer.pt): an OSError naming the checkpoint, not torch's
    RuntimeError from its zip writer."""
    model = tiny_dit()
    save_checkpoint(str(tmp_path), 1, model)
    real = ckpt_save.write_bytes

    def no_space(path, data):
        if path.endswith("trainer.pt"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(path, data)
    monkeypatch.setattr(ckpt_save, "write_bytes", no_space)
    with pytest.raises(OSError, match=r"step-000002 failed on rank 0: No space left on device \(.*trainer.pt\): "
                                      r"disk full or file size limit") as e:
        save_checkpoint(str(tmp_path), 2, model)
    assert e.value.errno == errno.ENOSPC
    assert resolve_checkpoint("latest", str(tmp_path)).endswith("step-000001")


# ---- two ranks: each checksums its own files; a bad file fails the load on every rank ----------------------

def _two_rank_worker(rank, world, root):
    run = make_run("fsdp", seed=0)
    run_steps(run, torch.Generator().manual_seed(rank), 1)
    path = save_checkpoint(root, 1, *run)
    files = json.loads(open(os.path.join(path, "manifest.json")).read())["files"]
    torch.distributed.barrier()
    if rank == 0:
        truncate(os.path.join(path, "__1_0.distcp"))
    torch.distributed.barrier()
    try:
        load_checkpoint(path, *make_run("fsdp", seed=1))
        error = None
    except CheckpointCorruptError as e:
        error = str(e)
    return sorted(files), error


@pytest.mark.slow
def test_two_ranks_manifest_and_a_bad_shard_fail_on_every_rank(tmp_path):
    results = run_distributed(_two_rank_worker, 2, str(tmp_path))
    files, _ = results[0]
    assert {"__0_0.distcp", "__1_0.distcp", "ranks/rank-00000.pt", "ranks/rank-00001.pt"} <= set(files)
    for rank, (_, error) in enumerate(results):
        assert error is not None and "__1_0.distcp" in error and "truncated" in error, (rank, error)


def test_resuming_a_checkpoint_of_another_model_names_the_flags_it_was_saved_with(tmp_path):
    from tests.test_train import run_trainer, tiny_cfg

    trainer, _ = run_trainer(tiny_cfg(tmp_path, max_steps=2, ckpt_every=2))
    ckpt = str(trainer.last_checkpoint)
    with pytest.raises(ValueError, match=r"holds another model than this run builds: .*of another shape "
                                         r"\(e\.g\. pos_embed .*--model DiT-debug --image_size 8 --num_classes 10"):
        run_trainer(tiny_cfg(tmp_path, max_steps=4, image_size=16, load=ckpt))
    with pytest.raises(ValueError, match=r"holds another model than this run builds: 100 weights it lacks \(e\.g\. "
                                         r"blocks\.10\..*--vae none\), or start"):
        run_trainer(tiny_cfg(tmp_path, max_steps=4, model="DiT-Ti/4", load=ckpt))
