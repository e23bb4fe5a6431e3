"""Sharded streams (--dataset webdataset | parquet | hf): the same samples from each format, an order that is a pure
function of (seed, epoch) and independent of the world size, exact resume (bitwise at the same world size with
loader workers, exactly once at another), remote shards over http, and bad input skipped and counted or refused in
one line."""
import functools
import http.server
import io
import json
import os
import tarfile
import threading

import numpy as np
import pytest
import torch

from opendit.data import CaptionedDigitsDataset, ResumableDistributedSampler, build_dataloader
from opendit.data.shards import write
from opendit.data.stream_order import stream_order
from opendit.data.streaming import StreamDataset
from tests.families.test_flux import flux_cfg, tiny_text_encoders
from tests.test_train import run_trainer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The first 240 captioned digits at 8 px as tar shards (4 of 60), Parquet (4 files) and a datasets table."""
    root = tmp_path_factory.mktemp("digit_shards")
    return write(str(root), "captioned_digits", ("webdataset", "parquet", "hf"), image_size=8, shard_size=60,
                 limit=240)


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    return tiny_text_encoders(tmp_path_factory.mktemp("stream_encoders"))


@pytest.mark.parametrize("kind", ["webdataset", "parquet", "hf"])
def test_each_format_gives_the_built_in_items(shards, kind):
    stream = StreamDataset(kind, shards[kind], 8, channels=1)
    digits = CaptionedDigitsDataset(8, channels=1)
    assert len(stream) == 240
    for i in (0, 59, 60, 239):
        image, caption = stream[i]
        assert caption == digits[i][1]
        torch.testing.assert_close(image, digits[i][0], atol=0, rtol=0)
    labelled = StreamDataset(kind, shards[kind], 8, item="label", num_classes=10)
    assert labelled[7][1] == int(digits.labels[7]) and labelled[7][0].shape == (3, 8, 8)


def test_the_wids_shard_list_spares_counting_and_gives_the_same_stream(shards, tmp_path):
    from opendit.data.shards import main

    folder = os.path.dirname(shards["webdataset"])
    main(["--list", shards["webdataset"], "--out", os.path.join(folder, "listed.json")])
    assert json.load(open(os.path.join(folder, "listed.json"))) == json.load(open(os.path.join(folder, "dataset.json")))
    listed = StreamDataset("webdataset", os.path.join(folder, "dataset.json"), 8)
    pattern = StreamDataset("webdataset", shards["webdataset"], 8)
    assert listed.source.sizes == pattern.source.sizes == [60] * 4
    assert listed[100][1] == pattern[100][1]


def test_stream_order_is_a_pure_function_of_seed_and_epoch_and_reads_few_shards_at_a_time():
    sizes = [50, 70, 30, 90, 60]
    a = stream_order(sizes, seed=3, epoch=1, global_batch=10, buffer=40)
    assert torch.equal(a, stream_order(sizes, seed=3, epoch=1, global_batch=10, buffer=40))
    assert not torch.equal(a, stream_order(sizes, seed=3, epoch=2, global_batch=10, buffer=40))
    assert sorted(a.tolist()) == list(range(300))  # one partition: every sample once
    starts = np.cumsum([0] + sizes)

    def shards_of(indices):
        return set((np.searchsorted(starts, indices.reshape(-1).numpy(), side="right") - 1).tolist())

    for window in range(0, 300, 40):  # a 40-sample window touches at most the shards it straddles
        assert len(shards_of(a[window:window + 40])) <= 3
    parted = stream_order(sizes, seed=3, epoch=1, global_batch=8, partitions=4, buffer=40)
    batches = parted.view(-1, 4, 2)  # each global batch: 2 samples from each of the 4 partitions
    owned = [shards_of(batches[:, p]) for p in range(4)]
    assert sorted(len(o) for o in owned) == [1, 1, 1, 2]  # 5 shards dealt to 4 partitions
    assert set().union(*owned) == {0, 1, 2, 3, 4} and sum(map(len, owned)) == 5  # no shard read by two


@pytest.mark.parametrize("partitions", [1, 4])
def test_resumed_at_another_world_size_each_sample_of_the_epoch_is_seen_once(shards, partitions):
    stream = StreamDataset("webdataset", shards["webdataset"], 8, shuffle_buffer=50, stream_partitions=partitions)

    def ranks(dp, state=None):
        samplers = []
        for rank in range(dp):
            sampler = build_dataloader(stream, 8, dp, rank, seed=5).sampler
            if state is not None:
                sampler.load_state_dict(state)
            samplers.append(sampler)
        return samplers

    first = ranks(2)
    batches = [list(s) for s in first]
    seen = [i for k in range(5) for r in range(2) for i in batches[r][4 * k:4 * k + 4]]  # 5 steps at 2 ranks
    for s in first:
        s.advance(5)
    state = first[0].state_dict()
    for dp in (1, 4):
        rest = [i for s in ranks(dp, state) for i in s]
        epoch = seen + rest
        assert len(epoch) == len(set(epoch)) == first[0].epoch_samples(0)
        assert set(epoch) <= set(range(240))
        if partitions == 1:
            assert len(epoch) == 240


def test_a_stream_refuses_a_position_saved_for_other_shards(shards, tmp_path):
    stream = StreamDataset("webdataset", shards["webdataset"], 8)
    state = build_dataloader(stream, 8, 1, 0, seed=0).sampler.state_dict()
    other = StreamDataset("parquet", shards["parquet"], 8, shuffle_buffer=7)
    with pytest.raises(ValueError, match="sharded stream of another layout"):
        build_dataloader(other, 8, 1, 0, seed=0).sampler.load_state_dict(state)
    with pytest.raises(ValueError, match="not a multiple of the data-parallel size 2"):
        ResumableDistributedSampler(240, 2, 0, global_batch_size=6, order=StreamDataset(
            "webdataset", shards["webdataset"], 8, stream_partitions=3).order)


@pytest.mark.parametrize("kind", ["webdataset", "parquet"])
def test_training_from_a_stream_resumes_bitwise_with_loader_workers(tmp_path, shards, encoders, kind):
    cfg = functools.partial(flux_cfg, encoders=encoders, dataset=kind, data_path=shards[kind], num_workers=2,
                            shuffle_buffer=50, crop="random")
    _, full = run_trainer(cfg(tmp_path / "a", max_steps=4, ckpt_every=2))
    run_trainer(cfg(tmp_path / "b", max_steps=2, ckpt_every=2))
    _, resumed = run_trainer(cfg(tmp_path / "b", max_steps=4, ckpt_every=2, load="latest"))
    assert resumed == full[2:] and all(np.isfinite(full))


# ---- remote shards --------------------------------------------------------------------------------------------
class _Server:
    """Files of `root` over http on 127.0.0.1; `fail_first` requests answer 503 first."""

    def __init__(self, root, fail_first=0):
        state = {"fail": fail_first, "requests": 0}

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kw):
                super().__init__(*args, directory=str(root), **kw)

            def do_GET(self):  # noqa: N802 - http.server's name
                state["requests"] += 1
                if state["fail"] > 0:
                    state["fail"] -= 1
                    self.send_error(503, "busy")
                    return
                super().do_GET()

            def log_message(self, *args):
                pass

        self.state = state
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_http_shards_are_fetched_once_with_retries_and_a_dead_url_stops_with_its_name(shards, tmp_path, monkeypatch):
    from opendit.data import fetch

    monkeypatch.setattr(fetch, "BACKOFF_S", 0.01)
    folder = os.path.dirname(shards["webdataset"])
    server = _Server(folder, fail_first=2)
    try:
        url = server.url + "/{00000..00003}.tar"
        stream = StreamDataset("webdataset", url, 8, channels=1, shard_cache=str(tmp_path / "cache"))
        local = StreamDataset("webdataset", shards["webdataset"], 8, channels=1)
        assert stream.source.sizes == local.source.sizes
        torch.testing.assert_close(stream[130][0], local[130][0], atol=0, rtol=0)
        fetched = server.state["requests"]
        assert fetched == 4 + 2  # each shard once; the two 503s retried
        StreamDataset("webdataset", url, 8, shard_cache=str(tmp_path / "cache"))
        assert server.state["requests"] == fetched  # the machine's copies are reused
        assert not [f for f in os.listdir(tmp_path / "cache") if ".part" in f]
        with pytest.raises(fetch.ShardUnavailable, match=r"shard http://127\.0\.0\.1:\d+/00009\.tar .*HTTP 404"):
            StreamDataset("webdataset", server.url + "/00009.tar", 8, shard_cache=str(tmp_path / "cache"))
    finally:
        server.close()
    monkeypatch.setattr(fetch, "RETRIES", 2)
    with pytest.raises(fetch.ShardUnavailable, match=r"00000\.tar is unreachable after 3 tries"):
        StreamDataset("webdataset", server.url + "/00000.tar", 8, shard_cache=str(tmp_path / "other"))


def test_parquet_files_stream_from_http_like_local_ones(shards, tmp_path):
    server = _Server(shards["parquet"])
    try:
        url = server.url + "/{00000..00003}.parquet"
        remote = StreamDataset("parquet", url, 8, channels=1, shard_cache=str(tmp_path / "cache"))
        local = StreamDataset("parquet", shards["parquet"], 8, channels=1)
        assert remote.source.sizes == local.source.sizes == [60] * 4
        for i in (0, 130, 239):
            assert remote[i][1] == local[i][1]
            torch.testing.assert_close(remote[i][0], local[i][0], atol=0, rtol=0)
    finally:
        server.close()


# ---- bad input ------------------------------------------------------------------------------------------------
def _tar(path, samples):
    with tarfile.open(path, "w") as archive:
        for name, data in samples:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def _png(seed, size=(12, 12)):
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size[::-1], 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def test_bad_samples_are_skipped_and_counted_and_the_run_goes_on(tmp_path, caplog):
    from opendit.data import count_skipped

    good = [(f"{i:03d}.png", _png(i)) for i in range(6)]
    samples = []
    for i, (name, data) in enumerate(good):
        samples += [(name, data), (f"{i:03d}.txt", f"caption {i}".encode())]
    samples += [("100.png", b"not an image"), ("100.txt", b"broken")]  # undecodable
    samples += [("101.png", _png(9))]  # no caption
    samples += [("102.png", _png(10, (40, 10))), ("102.txt", b"too wide")]  # filtered by --max_aspect
    samples += [("103.png", _png(11)), ("103.txt", b"x")]  # filtered by --min_caption_chars
    _tar(tmp_path / "a.tar", samples)
    data = (tmp_path / "a.tar").read_bytes()
    (tmp_path / "b.tar").write_bytes(data[: len(data) // 2])  # truncated inside a member
    stream = StreamDataset("webdataset", str(tmp_path / "{a,b}.tar"), 8, max_aspect=2.0, min_caption_chars=3)
    assert "truncated or corrupt" in caplog.text
    assert len(stream) > 10
    items = [stream[i] for i in range(10)]
    assert all(caption.startswith("caption") for _, caption in items)
    assert count_skipped(stream) == 4
    assert "no caption" in caplog.text and "--max_aspect" in caplog.text and "--min_caption_chars" in caplog.text


def test_a_corrupt_header_is_skipped_to_the_next_member(tmp_path):
    samples = []
    for i in range(4):
        samples += [(f"{i:03d}.png", _png(i)), (f"{i:03d}.txt", f"caption {i}".encode())]
    _tar(tmp_path / "a.tar", samples)
    data = bytearray((tmp_path / "a.tar").read_bytes())
    start = data.index(b"001.png")
    data[start:start + 100] = b"\xff" * 100  # the header of sample 1's image
    (tmp_path / "a.tar").write_bytes(bytes(data))
    stream = StreamDataset("webdataset", str(tmp_path / "a.tar"), 8)
    keys = [stream.source.where(i).split("#")[1] for i in range(len(stream))]
    assert "003" in keys and "000" in keys


@pytest.mark.parametrize("spec, message", [
    ("missing/{00000..00003}.tar", "4 of the 4 shards of 'missing/{00000..00003}.tar' do not exist"),
    ("", "names no shards"),
])
def test_a_missing_shard_is_one_error_line_before_any_model(tmp_path, spec, message, encoders):
    from opendit.families import flux  # noqa: F401 - registered

    cfg = flux_cfg(tmp_path, encoders, dataset="webdataset", data_path=spec)
    with pytest.raises((FileNotFoundError, ValueError), match=message.replace("{", r"\{").replace("}", r"\}")):
        run_trainer(cfg)
    assert not list(tmp_path.glob("*/checkpoints"))


def test_the_digits_writer_is_read_by_webdataset_and_datasets(shards):
    import datasets
    import webdataset as wds

    folder = os.path.dirname(shards["webdataset"])
    first = next(iter(wds.WebDataset(os.path.join(folder, "00000.tar"), shardshuffle=False)))
    assert set(first) >= {"__key__", "png", "txt", "cls", "json"}
    assert json.loads(first["json"])["caption"] == first["txt"].decode()
    table = datasets.load_dataset("parquet", data_files=os.path.join(shards["parquet"], "*.parquet"), split="train")
    assert len(table) == 240 and table[0]["caption"] == first["txt"].decode()


@pytest.mark.slow
def test_two_ranks_with_workers_resume_bitwise_and_one_rank_continues_their_epoch(tmp_path, shards, encoders):
    """2 ranks x 2 loader workers, each rank reading its own partition of the shards: stopped at step 2 and resumed,
    the same losses as without the stop; the 2-rank checkpoint resumed by one process trains on exactly the rest of
    the epoch's order (what the two ranks had not consumed)."""
    import torch.distributed as dist

    from opendit.training.loop import Trainer
    from tests.distributed import run_distributed, train_each

    cfg = functools.partial(flux_cfg, encoders=encoders, dataset="webdataset", data_path=shards["webdataset"],
                            num_workers=2, shuffle_buffer=50, stream_partitions=2, batch_size=8)
    runs = [cfg(tmp_path / "a", max_steps=4, ckpt_every=2), cfg(tmp_path / "b", max_steps=2, ckpt_every=2),
            cfg(tmp_path / "b", max_steps=4, ckpt_every=2, load="latest")]
    full, _, resumed = run_distributed(train_each, 2, runs)[0]
    assert resumed == full[2:] and all(np.isfinite(full))
    try:
        trainer = Trainer(cfg(tmp_path / "a", max_steps=6, num_workers=0, load="latest"))
        sampler = trainer.loader.sampler
        assert (sampler.num_replicas, sampler.consumed) == (1, 32)
        order = trainer.dataset.order.epoch_order(0, 0, 8)
        assert list(sampler) == order[32:sampler.epoch_samples()].tolist()  # the rest of the epoch, once each
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_aspect_ratio_buckets_on_a_stream_give_batches_of_one_shape_and_resume_exactly(tmp_path, encoders):
    """Landscape, portrait and square photos in tar shards, their sizes in each sample's .json (img2dataset's): every
    global batch is of one bucket, in the stream's window order, and a resumed run equals the uninterrupted one."""
    import webdataset as wds

    from tests.test_buckets_train import SHAPES

    for shard in range(2):
        with wds.TarWriter(str(tmp_path / f"{shard}.tar")) as writer:
            for k in range(12):
                w, h = SHAPES[k % len(SHAPES)]
                writer.write({"__key__": f"{shard}{k:03d}", "png": _png(100 * shard + k, (w, h)), "txt": f"photo {k}",
                              "json": {"width": w, "height": h}})
    cfg = functools.partial(flux_cfg, encoders=encoders, dataset="webdataset", data_path=str(tmp_path / "{0,1}.tar"),
                            image_size=16, buckets="auto", batch_size=4, shuffle_buffer=10)
    trainer, full = run_trainer(cfg(tmp_path / "a", max_steps=4, ckpt_every=2))
    order = trainer.loader.sampler.permutation()
    shapes = [{tuple(trainer.dataset[int(i)][0].shape) for i in batch} for batch in order.view(-1, 4)]
    assert all(len(s) == 1 for s in shapes) and len(set().union(*shapes)) >= 3
    run_trainer(cfg(tmp_path / "b", max_steps=2, ckpt_every=2))
    _, resumed = run_trainer(cfg(tmp_path / "b", max_steps=4, ckpt_every=2, load="latest"))
    assert resumed == full[2:] and all(np.isfinite(full))


def test_the_throughput_benchmark_runs_every_row():
    import subprocess
    import sys

    from tests.test_train import ROOT

    out = subprocess.run([sys.executable, "benchmarks/data_throughput.py", "--samples", "32", "--sizes", "64",
                          "--workers", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "layout" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["folder", "tar shards", "Parquet", "latent cache (.npy)",
                                                      "latent cache (tar, streamed)"]
    assert "loader workers" in out.stdout


def test_a_streamed_cache_of_a_stream_trains_like_the_stream_on_the_fly(tmp_path, shards, encoders):
    """preprocess.py from tar shards into a tar-shard cache (same shard size: the same stream order); FLUX trains on
    the cache as on the raw stream encoded on the fly (same samples per step, equal losses up to the encoders' float
    rounding), without loading an encoder."""
    from tests.run_each import losses_of, run_here
    from tests.test_train import save_tiny_vae

    t5, clip = encoders
    vae = save_tiny_vae(tmp_path / "vae", latent_channels=16)
    run_here("preprocess.py", "--family", "flux", "--model", "flux-debug", "--dataset", "webdataset", "--data_path",
             shards["webdataset"], "--image_size", "32", "--vae", vae, "--t5", t5, "--clip", clip, "--out",
             tmp_path / "cache", "--cache_format", "webdataset", "--shard_size", "60", "--num_workers", "0")
    common = dict(image_size=32, max_steps=3, shuffle_buffer=50, num_workers=2)
    trainer, _ = run_trainer(flux_cfg(tmp_path / "c", ("none", "none"), dataset="latents",
                                      data_path=str(tmp_path / "cache"), **common))
    assert trainer.encoders.vae is None and trainer.loader.sampler.order is not None
    run_trainer(flux_cfg(tmp_path / "f", encoders, vae=vae, dataset="webdataset", data_path=shards["webdataset"],
                         **common))
    cached, fly = (losses_of(tmp_path / run / "000-flux-debug") for run in ("c", "f"))
    np.testing.assert_allclose(cached, fly, rtol=1e-5)


def test_a_run_on_bad_shards_goes_on_and_logs_what_it_skipped(tmp_path, encoders):
    """Training on a shard with an undecodable image and an uncaptioned sample; and a clip stream with a broken
    video: the runs finish and the skipped samples are counted."""
    from opendit.data import count_skipped
    from opendit.data.shards import demo_records, write_tars

    samples = []
    for i in range(8):
        samples += [(f"{i:03d}.png", _png(i)), (f"{i:03d}.txt", f"a handwritten {i}".encode())]
    samples += [("100.png", b"\x89PNG broken"), ("100.txt", b"a broken one"), ("101.png", _png(50))]
    _tar(tmp_path / "bad.tar", samples)
    trainer, losses = run_trainer(flux_cfg(tmp_path / "run", encoders, dataset="webdataset", batch_size=4,
                                           data_path=str(tmp_path / "bad.tar"), max_steps=3, log_every=1))
    logged = [json.loads(line) for line in (trainer.run_dir / "log.jsonl").read_text().splitlines()]
    assert all(np.isfinite(losses)) and len(trainer.dataset) == 10
    assert count_skipped(trainer.dataset) == 2 and logged[-1]["skipped_images"] == 2

    records = list(demo_records("moving_digits", 16, "all", num_frames=6, limit=4))
    records[1]["media"] = records[1]["media"][: len(records[1]["media"]) // 3]  # a truncated mp4
    write_tars(records, str(tmp_path / "clips"), shard_size=4)
    clips = StreamDataset("webdataset", str(tmp_path / "clips" / "00000.tar"), 16, item="clip", num_frames=3)
    items = [clips[i] for i in range(4)]
    assert all(clip.shape == (3, 3, 16, 16) for clip, _, _ in items) and count_skipped(clips) == 1


def test_validation_items_held_out_of_a_stream_keep_its_order_and_resume(tmp_path, shards, encoders):
    """--val_samples holds items out of a stream: training reads the rest in the stream's own order (no held-out
    item), the validation loss is logged, and a resumed run equals the uninterrupted one."""
    cfg = functools.partial(flux_cfg, encoders=encoders, dataset="webdataset", data_path=shards["webdataset"],
                            val_every=2, val_samples=16, shuffle_buffer=50)
    trainer, full = run_trainer(cfg(tmp_path / "a", max_steps=4, ckpt_every=2))
    held_out = set(trainer.validator.indices)
    order = trainer.loader.sampler.permutation()
    trained = set(trainer.loader.dataset.indices[int(i)] for i in order)
    assert len(held_out) == 16 and not held_out & trained and len(trained) == 240 - 16
    expected = [i for i in trainer.dataset.order.epoch_order(0, 0, 4).tolist() if i not in held_out]
    assert [trainer.loader.dataset.indices[int(i)] for i in order] == expected  # the stream's order, less held out
    logged = [json.loads(line) for line in (trainer.run_dir / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r.get("kind") == "val"] == [2, 4]
    run_trainer(cfg(tmp_path / "b", max_steps=2, ckpt_every=2))
    _, resumed = run_trainer(cfg(tmp_path / "b", max_steps=4, ckpt_every=2, load="latest"))
    assert resumed == full[2:]


def test_frame_buckets_on_a_clip_stream(tmp_path):
    """Clips of 6 and of 4 frames in tar shards: with --bucket_frames 6 4 each goes to the longest bucket it has
    frames for (read from the mp4 header), and every global batch of the stream's order holds one frame count."""
    from opendit.data.buckets import parse_buckets
    from opendit.data.shards import demo_records, write_tars

    long = list(demo_records("moving_digits", 16, "all", num_frames=6, limit=8))
    short = [dict(r, key=f"s{r['key']}") for r in demo_records("moving_digits", 16, "all", num_frames=4, limit=8)]
    write_tars(long + short, str(tmp_path), shard_size=4)
    clips = StreamDataset("webdataset", str(tmp_path / "{00000..00003}.tar"), 16, item="clip", num_frames=4,
                          shuffle_buffer=8)
    assignment = clips.use_buckets(parse_buckets("16x16", 256, 8, (6, 4)))
    assert sorted(np.bincount(assignment.ids).tolist()) == [8, 8]
    order = build_dataloader(clips, 4, 1, 0, seed=0).sampler.permutation()
    for batch in order.view(-1, 4):
        assert len({clips[int(i)][0].shape[1] for i in batch}) == 1
    assert {clips[int(i)][0].shape for i in order} == {(3, 6, 16, 16), (3, 4, 16, 16)}
