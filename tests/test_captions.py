"""Captioned image data: kohya-style folders (.txt beside each image), CSV / JSONL listings, the captioned digits."""
import json
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from opendit.data import (CAPTIONED_DIGITS, CAPTIONS, DIGIT_CAPTION_WORDS, DIGIT_WORDS, CaptionedDigitsDataset,
                          CaptionedImageDataset, DigitsDataset, build_dataloader, digit_caption)
from opendit.families import all_datasets
from opendit.data.captions import DIGIT_TEMPLATES


def _image(path, width=20, height=12, seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture
def caption_folder(tmp_path):
    """a.png "a red square" (multi-line), d.png corrupt, sub/b.jpg with an empty caption, c.png without a .txt,
    .hidden/e.png ignored."""
    root = tmp_path / "data"
    _image(root / "a.png")
    (root / "a.txt").write_text("a red\n  square\n")
    (root / "d.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    (root / "d.txt").write_text("broken")
    _image(root / "sub" / "b.jpg", 12, 30, seed=1)
    (root / "sub" / "b.txt").write_text("")
    _image(root / "c.png", seed=2)
    _image(root / ".hidden" / "e.png", seed=3)
    (root / ".hidden" / "e.txt").write_text("hidden")
    return root


def test_folder_with_txt_captions(caption_folder, caplog):
    with caplog.at_level(logging.WARNING):
        ds = CaptionedImageDataset(str(caption_folder), 8)
    assert "1 image(s) without a same-stem .txt" in caplog.text
    assert len(ds) == 3 and ds.num_uncaptioned == 1 and ds.num_classes == 0 and ds.channels == 3
    assert ds.captions == ["a red square", "broken", ""]  # sorted by folder, then file name; whitespace collapsed
    x, caption = ds[0]
    assert x.shape == (3, 8, 8) and x.dtype == torch.float32 and caption == "a red square"
    assert -1.0 <= x.min() and x.max() <= 1.0 and x.min() < 0 < x.max()
    # the corrupt d.png is skipped when read: its slot gets the next readable image (the empty caption)
    with caplog.at_level(logging.WARNING):
        x1, caption1 = ds[1]
    assert "skipping unreadable image" in caplog.text and "d.png" in caplog.text
    assert caption1 == "" and ds.num_skipped == 1
    torch.testing.assert_close(x1, ds[2][0])
    grey, _ = CaptionedImageDataset(str(caption_folder), 8, channels=1)[0]
    assert grey.shape == (1, 8, 8)


def test_flip_is_deterministic_per_epoch(caption_folder):
    plain = CaptionedImageDataset(str(caption_folder), 8)[0][0]
    ds = CaptionedImageDataset(str(caption_folder), 8, random_flip=True, seed=0)
    flips = []
    for epoch in range(8):
        ds.set_epoch(epoch)
        x = ds[0][0]
        torch.testing.assert_close(x, ds[0][0])  # the same epoch and index: the same flip
        assert torch.equal(x, plain) or torch.equal(x, plain.flip(-1))
        flips.append(torch.equal(x, plain.flip(-1)))
    assert any(flips) and not all(flips)


def _listed_images(tmp_path):
    folder = tmp_path / "listing"
    _image(folder / "imgs" / "one.png")
    _image(folder / "two.jpg", 10, 10, seed=1)
    return folder


def test_csv_listing(tmp_path, monkeypatch, caplog):
    folder = _listed_images(tmp_path)
    (folder / "data.csv").write_text('path,caption\nimgs/one.png,"a cat, sitting"\ntwo.jpg,\nmissing.png,gone\n\n')
    monkeypatch.chdir(tmp_path)  # relative paths resolve against the CSV's folder, not the working directory
    with caplog.at_level(logging.WARNING):
        ds = CaptionedImageDataset(str(folder / "data.csv"), 8)
    assert "1 listed image(s) that do not exist" in caplog.text
    assert len(ds) == 2 and ds.num_missing == 1 and ds.captions == ["a cat, sitting", ""]
    x, caption = ds[1]
    assert x.shape == (3, 8, 8) and caption == ""


def test_jsonl_listing(tmp_path):
    folder = _listed_images(tmp_path)
    lines = [json.dumps({"file_name": "imgs/one.png", "text": "a dog"}), "",
             json.dumps({"path": "two.jpg", "caption": "a bird", "extra": 1})]
    (folder / "meta.jsonl").write_text("\n".join(lines) + "\n")
    ds = CAPTIONS(str(folder / "meta.jsonl"), 8, channels=1)
    assert isinstance(ds, CaptionedImageDataset) and ds.captions == ["a dog", "a bird"]
    assert ds[0][0].shape == (1, 8, 8)


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'.*nope' does not exist.*--data_path"):
        CaptionedImageDataset(str(tmp_path / "nope"), 8)
    uncaptioned = tmp_path / "uncaptioned"
    _image(uncaptioned / "x.png")
    with pytest.raises(ValueError, match=r"no captioned images in .*uncaptioned.*1 image\(s\) without a \.txt"):
        CaptionedImageDataset(str(uncaptioned), 8)
    bad_header = tmp_path / "bad.csv"
    bad_header.write_text("file,label\nx.png,3\n")
    with pytest.raises(ValueError, match=r"bad\.csv' has the header 'file,label'.*path,caption"):
        CaptionedImageDataset(str(bad_header), 8)
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"path": "x.png", "caption": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl' line 2 is not a JSON object"):
        CaptionedImageDataset(str(bad_json), 8)
    no_caption = tmp_path / "no_caption.jsonl"
    no_caption.write_text('{"path": "x.png"}\n')
    with pytest.raises(ValueError, match=r"line 1 has no 'caption' or 'text' field"):
        CaptionedImageDataset(str(no_caption), 8)
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(ValueError, match=r"notes\.txt' is neither a folder, a \.csv nor a \.jsonl"):
        CaptionedImageDataset(str(other), 8)
    with pytest.raises(ValueError, match="channels"):
        CaptionedImageDataset(str(uncaptioned), 8, channels=2)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "x.png").write_bytes(b"garbage")
    (corrupt / "x.txt").write_text("x")
    with pytest.raises(RuntimeError, match=r"all 1 captioned images of .*corrupt.* are unreadable"):
        CaptionedImageDataset(str(corrupt), 8)[0]
    with pytest.raises(ValueError, match=r"'captions' needs a data path.*--data_path"):
        CAPTIONS(image_size=8)


# ---- the captioned digits demo --------------------------------------------------------------------------------
def test_digit_caption():
    assert DIGIT_WORDS[7] == "seven" and len(DIGIT_WORDS) == 10
    assert digit_caption(7, 0) == "a handwritten seven" and digit_caption(7, 1) == "the digit seven"
    assert digit_caption(8, 2) == "an eight" and digit_caption(1, 2) == "a one"
    assert digit_caption(3, len(DIGIT_TEMPLATES)) == digit_caption(3, 0)  # variants wrap around
    with pytest.raises(ValueError, match="0..9"):
        digit_caption(10)


def test_captioned_digits():
    ds = CAPTIONED_DIGITS(image_size=8)
    assert isinstance(ds, CaptionedDigitsDataset) and len(ds) == 1797 and ds.num_classes == 0 and ds.channels == 1
    plain = DigitsDataset(8)
    assert np.array_equal(ds.labels, plain._labels) and ds.labels.dtype == np.int64
    for i in (0, 5, 1796):
        x, caption = ds[i]
        assert isinstance(caption, str) and DIGIT_WORDS[ds.labels[i]] in caption.split()
        torch.testing.assert_close(x, plain[i][0])
    # deterministic per (seed, index), every template used, all words known to the tiny tokenizers
    assert CaptionedDigitsDataset(8).captions == ds.captions
    assert CaptionedDigitsDataset(8, seed=1).captions != ds.captions
    assert set(ds.variants.tolist()) == set(range(len(DIGIT_TEMPLATES)))
    assert {w for c in ds.captions for w in c.split()} <= set(DIGIT_CAPTION_WORDS)
    held = CaptionedDigitsDataset(8, channels=3, split="held_out")
    assert len(held) == len(held.labels) < 1797 and held[0][0].shape == (3, 8, 8)


def test_registered_and_batched():
    assert {"captioned_digits", "captions", "digits", "folder", "latents", "video_csv", "moving_digits"} <= \
        set(all_datasets())
    loader = build_dataloader(CAPTIONED_DIGITS(image_size=8), 4, 1, 0, seed=0)
    x, captions = next(iter(loader))
    # default collate: the captions of a batch come as a sequence (a tuple) of str
    assert x.shape == (4, 1, 8, 8) and len(captions) == 4 and all(isinstance(c, str) for c in captions)
