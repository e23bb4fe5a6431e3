"""Video data: PyAV clip reading and writing, the video CSV dataset, the moving-digits demo.

The test videos are real MP4s written with PyAV. Each frame's grey level encodes its index (10 * index), so a
decoded clip tells which source frames it holds: lossy coding moves a level by a few units (measured: <= 3
after libx264 and mpeg4 at 40x32), far less than the 10 between frames, and the median over a frame ignores
the small moving square drawn on it.
"""
import importlib.util
import logging
import shutil

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from opendit.data import (MOVING_DIGITS, VIDEO_CSV, MovingDigitsDataset, VideoCSVDataset, VideoReadError,
                          digits_split, read_clip, read_video_csv, video_frame_count, write_gif, write_mp4)
from opendit.data.digits import _load_raw

needs_av = pytest.mark.skipif(importlib.util.find_spec("av") is None, reason="needs PyAV (pip install av)")

FRAMES, HEIGHT, WIDTH = 24, 32, 40


def coded_frames(count=FRAMES, height=HEIGHT, width=WIDTH):
    """uint8 [count, H, W, 3]: frame t is grey 10 * t with a red 6x6 square at x = t."""
    frames = np.empty((count, height, width, 3), np.uint8)
    for t in range(count):
        frames[t] = 10 * t
        frames[t, 2:8, t:t + 6] = (255, 0, 0)
    return frames


def frame_codes(clip) -> list:
    """Source frame indices of a decoded clip: uint8 [T, H, W, 3] or float [C, T, S, S] in [-1, 1]."""
    clip = torch.as_tensor(np.asarray(clip))
    if clip.dtype == torch.uint8:
        levels = clip.float().flatten(1)  # [T, H*W*3]
    else:
        levels = ((clip + 1) * 127.5).transpose(0, 1).flatten(1)  # [T, C*S*S]
    return [round(v / 10) for v in levels.median(dim=1).values.tolist()]


def write_video(path, count=FRAMES, gop=None):
    """A coded video written with PyAV directly (MP4, or Matroska for .mkv: a header without a frame count);
    gop sets the key-frame spacing (to make seeking matter)."""
    import av

    frames = coded_frames(count)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        if gop:
            stream.codec_context.gop_size = gop
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return str(path)


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """A folder with good videos a.mp4, b.mp4 (gop 4), c.mkv (gop 4), short.mp4 (5 frames) and corrupt.mp4
    (random bytes)."""
    root = tmp_path_factory.mktemp("videos")
    write_video(root / "a.mp4")
    write_video(root / "b.mp4", gop=4)
    write_video(root / "short.mp4", count=5)
    write_video(root / "c.mkv", gop=4)
    (root / "corrupt.mp4").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, np.uint8).tobytes())
    return root


def write_csv(path, text):
    path.write_text(text)
    return str(path)


# ---- video_io ------------------------------------------------------------------------------------------
@needs_av
def test_read_clip_interval_and_start(videos):
    a, b = str(videos / "a.mp4"), str(videos / "b.mp4")
    clip = read_clip(a, 5, frame_interval=3, start=4)
    assert clip.shape == (5, HEIGHT, WIDTH, 3) and clip.dtype == np.uint8
    assert frame_codes(clip) == [4, 7, 10, 13, 16]
    # b has a key frame every 4 frames, so most starts seek past frame 0: every start must give its frames
    for start in range(FRAMES - 6):
        assert frame_codes(read_clip(b, 4, frame_interval=2, start=start)) == [start, start + 2, start + 4, start + 6]
    assert frame_codes(read_clip(a, 6, start=18)) == list(range(18, 24))  # the last frames
    assert video_frame_count(a) == FRAMES and video_frame_count(videos / "short.mp4") == 5
    # seeded starts: deterministic, spread over the valid starts 0..17 of a 7-frame span
    starts = [frame_codes(read_clip(a, 4, 2, seed=s))[0] for s in range(8)]
    assert starts == [frame_codes(read_clip(a, 4, 2, seed=s))[0] for s in range(8)]
    assert len(set(starts)) > 3 and all(0 <= s <= 17 for s in starts)
    # colour order: the square is red (RGB, not BGR)
    r, g, bl = read_clip(a, 1, start=0)[0, 3:7, 1:5].reshape(-1, 3).mean(0)
    assert r > 200 and g < 60 and bl < 60


@needs_av
def test_read_clip_without_header_count_or_precise_seek(videos, monkeypatch):
    import av

    from opendit.data import video_io

    mkv = str(videos / "c.mkv")
    with av.open(mkv) as container:
        assert container.streams.video[0].frames == 0  # Matroska: counted by one demux pass
    assert video_frame_count(mkv) == FRAMES
    assert frame_codes(read_clip(mkv, 3, frame_interval=4, start=9)) == [9, 13, 17]  # rewound after counting

    # a demuxer whose seek lands after the wanted frame: the reader decodes from frame 0 instead
    calls = []

    def overshooting(container, stream, wanted, seek):
        calls.append(seek)
        return None if seek else decode_from(container, stream, wanted, seek)

    decode_from = video_io._decode_from
    monkeypatch.setattr(video_io, "_decode_from", overshooting)
    assert frame_codes(read_clip(str(videos / "b.mp4"), 3, frame_interval=2, start=13)) == [13, 15, 17]
    assert calls == [True, False]


@needs_av
def test_read_clip_errors_name_the_file(videos):
    with pytest.raises(FileNotFoundError, match="missing.mp4"):
        read_clip(str(videos / "missing.mp4"), 4)
    with pytest.raises(VideoReadError, match="corrupt.mp4"):
        read_clip(str(videos / "corrupt.mp4"), 4)
    with pytest.raises(VideoReadError, match=r"short.mp4' has 5 frames; 4 frames every 2 need 7"):
        read_clip(str(videos / "short.mp4"), 4, frame_interval=2)
    with pytest.raises(ValueError, match=r"start 20 is outside 0..17"):
        read_clip(str(videos / "a.mp4"), 4, frame_interval=2, start=20)
    with pytest.raises(ValueError, match="frame_interval must be a positive int"):
        read_clip(str(videos / "a.mp4"), 4, frame_interval=0)


@needs_av
@pytest.mark.parametrize("codec", [None, "mpeg4"])
def test_write_mp4_round_trip(tmp_path, codec):
    frames = coded_frames()
    path = write_mp4(tmp_path / "out.mp4", frames, fps=8, codec=codec)
    assert not (tmp_path / "out.mp4.partial").exists()
    decoded = read_clip(path, FRAMES, start=0)
    assert decoded.shape == frames.shape and frame_codes(decoded) == list(range(FRAMES))
    assert np.abs(decoded.astype(int) - frames).mean() < 6  # measured 1.1 (libx264 crf 18), 2.6 (mpeg4)
    # odd sizes are padded by one repeated row / column (yuv420p needs even sizes); grey input is repeated to RGB
    odd = write_mp4(tmp_path / "odd.mp4", frames[:3, :9, :15, 0])
    decoded = read_clip(odd, 3, start=0)
    assert decoded.shape == (3, 10, 16, 3) and frame_codes(decoded) == [0, 1, 2]
    with pytest.raises(ValueError, match="must be uint8"):
        write_mp4(tmp_path / "f.mp4", frames.astype(np.float32))


def test_write_gif_round_trip(tmp_path):
    from PIL import Image, ImageSequence

    path = write_gif(tmp_path / "out.gif", coded_frames(6)[..., :1], fps=4)  # grey [T, H, W, 1]
    with Image.open(path) as gif:
        decoded = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(gif)]
        assert gif.info["duration"] == 250 and gif.info["loop"] == 0
    assert len(decoded) == 6 and decoded[0].shape == (HEIGHT, WIDTH, 3)
    assert frame_codes(np.stack(decoded)) == list(range(6))


# ---- the CSV --------------------------------------------------------------------------------------------
@needs_av
def test_csv_forms_labels_and_captions(videos):
    forms = {  # a quoted caption may hold commas
        "path,caption\na.mp4,a red square\nb.mp4,\"moving, right\"\n": ("caption", [-1, -1],
                                                                     ["a red square", "moving, right"]),
        "path,label\na.mp4,2\nb.mp4,0\n": ("label", [2, 0], ["", ""]),
        "a.mp4,2\nb.mp4,5\n": ("label", [2, 5], ["", ""]),  # OpenDiT's headerless form, all integers: labels
        "a.mp4,2\nb.mp4,a cat\n": ("caption", [-1, -1], ["2", "a cat"]),  # one non-integer: captions
    }
    for i, (text, (kind, labels, captions)) in enumerate(forms.items()):
        csv_path = write_csv(videos / f"form{i}.csv", text)
        ds = VideoCSVDataset(csv_path, image_size=16, num_frames=4)
        assert ds.kind == kind and len(ds) == 2
        assert [ds[i][1] for i in range(2)] == labels and [ds[i][2] for i in range(2)] == captions
        assert ds.num_classes == (max(labels) + 1 if kind == "label" else 0)
        assert ds.classes == [str(c) for c in range(ds.num_classes)]


@needs_av
def test_item_shape_range_channels_and_collate(videos):
    csv_path = write_csv(videos / "items.csv", "path,label\na.mp4,1\nb.mp4,0\n")
    ds = VideoCSVDataset(csv_path, image_size=16, num_frames=8, frame_interval=2)
    x, label, caption = ds[0]
    assert x.shape == (3, 8, 16, 16) and x.dtype == torch.float32 and x.min() >= -1 and x.max() <= 1
    assert (label, caption) == (1, "")
    assert ds.channels == 3 and ds.num_frames == 8 and ds.image_size == 16 and ds.num_skipped == 0
    grey = VideoCSVDataset(csv_path, image_size=12, num_frames=3, channels=1)[1][0]
    assert grey.shape == (1, 3, 12, 12)
    videos_b, labels_b, captions_b = next(iter(DataLoader(ds, batch_size=2)))
    assert videos_b.shape == (2, 3, 8, 16, 16) and labels_b.tolist() == [1, 0]
    assert captions_b == ("", "")  # default_collate keeps a batch of str as a tuple


@needs_av
def test_start_deterministic_per_seed_epoch_index_and_interval(videos):
    csv_path = write_csv(videos / "det.csv", "path,caption\na.mp4,x\nb.mp4,y\n")

    def codes(seed, epoch, index, interval=3):
        ds = VideoCSVDataset(csv_path, image_size=16, num_frames=4, frame_interval=interval, seed=seed)
        ds.set_epoch(epoch)
        return frame_codes(ds[index][0])

    first = codes(0, 0, 0)
    assert first == codes(0, 0, 0)  # a fresh dataset gives the same clip
    assert [b - a for a, b in zip(first, first[1:])] == [3, 3, 3]
    assert len({codes(0, epoch, 0)[0] for epoch in range(6)}) > 1  # other epochs, other starts
    assert len({codes(seed, 0, 0)[0] for seed in range(6)}) > 1
    spread = codes(0, 1, 1, interval=5)
    assert [b - a for a, b in zip(spread, spread[1:])] == [5, 5, 5] and spread[-1] <= FRAMES - 1


@needs_av
def test_bad_videos_skipped_counted_warned_once(videos, caplog):
    csv_path = write_csv(videos / "mixed.csv",
                         "path,label\nmissing.mp4,0\na.mp4,1\ncorrupt.mp4,2\nshort.mp4,3\nb.mp4,4\n")
    ds = VideoCSVDataset(csv_path, image_size=16, num_frames=4, frame_interval=2)
    with caplog.at_level(logging.WARNING, logger="opendit.data.video_csv"):
        labels = [ds[i][1] for i in range(len(ds))] + [ds[i][1] for i in range(len(ds))]
    # a bad slot is filled by the next readable index: 0 -> a (1), 2 and 3 -> b (4)
    assert labels == [1, 1, 4, 4, 4] * 2
    assert ds.num_skipped == 3 and ds._bad == {0, 2, 3}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3
    for name, error in (("missing.mp4", "FileNotFoundError"), ("corrupt.mp4", "VideoReadError"),
                        ("short.mp4", "has 5 frames")):
        assert sum(name in w and error in w for w in warnings) == 1


@needs_av
def test_all_bad_is_a_clear_error(videos):
    csv_path = write_csv(videos / "allbad.csv", "missing.mp4,a\ncorrupt.mp4,b\n")
    ds = VideoCSVDataset(csv_path, image_size=16, num_frames=4)
    with pytest.raises(RuntimeError, match=r"all 2 videos listed in .*allbad.csv.* are unreadable"):
        ds[0]


@needs_av
def test_relative_paths_resolve_against_the_csv_folder(videos, tmp_path, monkeypatch):
    sub, clips = tmp_path / "lists", tmp_path / "clips"
    sub.mkdir()
    clips.mkdir()
    shutil.copy(videos / "a.mp4", clips / "a.mp4")
    csv_path = write_csv(sub / "rel.csv", f"path,caption\n../clips/a.mp4,rel\n{videos / 'b.mp4'},abs\n")
    monkeypatch.chdir(videos)  # the working folder must not matter
    ds = VideoCSVDataset(csv_path, image_size=16, num_frames=4)
    assert ds.samples[0][0] == str(sub / ".." / "clips" / "a.mp4") and ds.samples[1][0] == str(videos / "b.mp4")
    assert [ds[i][2] for i in range(2)] == ["rel", "abs"] and ds.num_skipped == 0
    assert read_video_csv(csv_path)[1] == ds.samples


def test_bad_csv_errors_name_the_file_and_the_header(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope.csv.*path,caption.*path,label"):
        read_video_csv(str(tmp_path / "nope.csv"))
    cases = {"empty.csv": ("", "no rows"), "header_only.csv": ("path,caption\n", "no rows"),
             "three.csv": ("path,caption\na.mp4,x,y\n", "line 2 has 3 column"),
             "one.csv": ("a.mp4\n", "line 1 has 1 column"),
             "header.csv": ("path,text\na.mp4,x\n", "has the header 'path,text'"),
             "negative.csv": ("path,label\na.mp4,-1\n", "line 2: label '-1' is not a non-negative integer"),
             "text_label.csv": ("path,label\na.mp4,cat\n", "label 'cat'")}
    for name, (text, message) in cases.items():
        with pytest.raises(ValueError, match=message) as err:
            read_video_csv(write_csv(tmp_path / name, text))
        assert name in str(err.value) and "path,caption" in str(err.value)


# ---- moving digits -------------------------------------------------------------------------------------
def test_moving_digits_items_deterministic_and_labelled():
    ds = MovingDigitsDataset(image_size=16, num_frames=8)
    assert len(ds) == 1797 and ds.num_classes == 10 and ds.channels == 1 and ds.num_skipped == 0
    _, labels = _load_raw()
    other = MovingDigitsDataset(image_size=16, num_frames=8)
    for index in (0, 5, 1796):
        x, label, caption = ds[index]
        assert x.shape == (1, 8, 16, 16) and x.dtype == torch.float32
        assert x.min() == -1 and x.max() <= 1
        assert label == labels[index] and caption.startswith(f"the digit {label} moving ")
        assert caption == f"the digit {label} moving {ds.motion(index)[0]}"
        y, label_y, caption_y = other[index]
        assert torch.equal(x, y) and (label, caption) == (label_y, caption_y)
    reseeded = MovingDigitsDataset(16, 8, seed=1)
    assert [reseeded.motion(i) for i in range(5)] != [ds.motion(i) for i in range(5)]
    ds.set_epoch(3)
    assert torch.equal(ds[0][0], other[0][0])  # fixed clips: the epoch changes nothing
    captions = {ds.caption(i).split(" moving ")[1] for i in range(200)}
    assert captions == {"left", "right", "up", "down", "up and left", "up and right", "down and left",
                        "down and right"}
    rgb = MovingDigitsDataset(image_size=16, num_frames=4, channels=3)[7][0]
    assert rgb.shape == (3, 4, 16, 16) and torch.equal(rgb[0], rgb[2])
    assert len(MovingDigitsDataset(split="held_out")) == len(digits_split()[1][1])


@pytest.mark.parametrize("image_size,num_frames,frame_interval", [(16, 8, 1), (32, 16, 1), (16, 6, 2)])
def test_moving_digits_move_by_the_step_and_bounce_inside(image_size, num_frames, frame_interval):
    ds = MovingDigitsDataset(image_size=image_size, num_frames=num_frames, frame_interval=frame_interval)
    speed = max(1, image_size // 16) * frame_interval
    limit = image_size - 3 * image_size // 4
    ys, xs = torch.meshgrid(torch.arange(image_size, dtype=torch.float32),
                            torch.arange(image_size, dtype=torch.float32), indexing="ij")  # [S, S] each
    bounces = 0
    for index in range(40):
        clip = ds[index][0][0] + 1  # [T, S, S] ink >= 0
        words, _, (vx, vy) = ds.motion(index)
        assert {abs(vx), abs(vy)} <= {0, speed} and (vx, vy) != (0, 0)
        assert ("left" in words) == (vx < 0) and ("up" in words) == (vy < 0)
        mass = clip.sum(dim=(1, 2))
        com = torch.stack([(clip * xs).sum(dim=(1, 2)) / mass, (clip * ys).sum(dim=(1, 2)) / mass], 1)  # [T, 2]
        positions = torch.tensor([ds.digit_position(index, t) for t in range(num_frames)], dtype=torch.float32)
        assert ((positions >= 0) & (positions <= limit)).all()  # the whole digit stays in the frame
        assert torch.allclose(mass, mass[0])  # nothing is cut off
        # the center of mass follows the position exactly: same sprite, shifted by whole pixels
        assert torch.allclose(com[1:] - com[:-1], positions[1:] - positions[:-1], atol=1e-4)
        steps = positions[1:] - positions[:-1]  # [T-1, 2]
        assert (steps.abs() <= speed).all()
        straight = (steps == torch.tensor([vx, vy], dtype=torch.float32)).all(dim=1)
        bounces += int((~straight).sum())
        if straight.all():  # no bounce yet: the digit moved by exactly (vx, vy) per frame
            assert torch.equal(positions[-1] - positions[0], torch.tensor([vx, vy]) * (num_frames - 1.0))
    assert bounces > 0  # some clips bounce


def test_moving_digits_bad_arguments():
    with pytest.raises(ValueError, match="image_size >= 8"):
        MovingDigitsDataset(image_size=6)
    with pytest.raises(ValueError, match="split must be one of"):
        MovingDigitsDataset(split="test")
    with pytest.raises(ValueError, match="num_frames must be a positive int"):
        MovingDigitsDataset(num_frames=0)


# ---- dataset specs and the memory benchmark --------------------------------------------------------------
@needs_av
def test_video_dataset_specs(videos):
    ds = MOVING_DIGITS(None, 16, num_frames=4, frame_interval=2, seed=3, channels=3)
    assert isinstance(ds, MovingDigitsDataset) and ds[0][0].shape == (3, 4, 16, 16) and ds.seed == 3
    csv_path = write_csv(videos / "build.csv", "path,label\na.mp4,0\n")
    ds = VIDEO_CSV(csv_path, 16, num_frames=4, frame_interval=2, seed=3, channels=1)
    assert isinstance(ds, VideoCSVDataset) and ds[0][0].shape == (1, 4, 16, 16) and ds.frame_interval == 2
    with pytest.raises(ValueError, match="'video_csv' needs a data path"):
        VIDEO_CSV(None, 16)


@needs_av
def test_decode_memory_benchmark_smoke(capsys):
    from benchmarks import video_decode_memory

    result = video_decode_memory.main(["--decodes", "20", "--every", "10"])
    out = capsys.readouterr().out
    assert [n for n, _ in result["rss"]] == [0, 10, 20] and "KiB per 100 decodes" in out
    assert result["ms_per_clip"] > 0
