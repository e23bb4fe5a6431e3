"""Editing pairs streamed (--dataset edit_webdataset | edit_parquet | edit_hf): the same pairs as files give the same
items in each format (one control, and a list or numbered members of two), a sample without a control or with another
count is skipped and counted, and a CLI run on a stream resumes exactly."""
import logging
import os
import shutil

import pytest
import torch

from opendit import config as cfglib
from opendit.data import EditPairsDataset, EditStreamDataset, count_skipped
from tests.families.test_editing import MODEL, options, write_pairs
from tests.run_each import trains_and_resumes_exactly

COUNT = 6  # pairs


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    from opendit.families.wrapped.tiny_text import write_text_encoder
    return write_text_encoder(MODEL, tmp_path_factory.mktemp("text") / "clip_t5", "edit_digits")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """COUNT edit-digit pairs at 16 px as files -> (targets, {1: one control each, 2: two controls each})."""
    root = tmp_path_factory.mktemp("pairs")
    targets, two = write_pairs(root, count=COUNT)
    one = root / "c1"
    one.mkdir()
    for i in range(COUNT):
        shutil.copy(os.path.join(two, f"{i}_0.png"), one / f"{i}.png")
    return targets, {1: str(one), 2: two}


def records(targets: str, controls: str, k: int):
    """The pairs as (key, target bytes, instruction, [control bytes]), in the folder's order."""
    def read(path):
        with open(path, "rb") as f:
            return f.read()
    names = [f"{i}_{j}.png" for i in range(COUNT) for j in range(k)] if k > 1 else [f"{i}.png" for i in range(COUNT)]
    for i in range(COUNT):
        caption = open(os.path.join(targets, f"{i}.txt"), encoding="utf-8").read()
        yield (f"{i:03d}", read(os.path.join(targets, f"{i}.png")), caption,
               [read(os.path.join(controls, name)) for name in names[i * k:(i + 1) * k]])


def write_stream(kind: str, root, rows: list) -> str:
    """rows as WebDataset shards (webdataset's TarWriter: KEY.control.png, or KEY.control_0.png, ... for several), a
    Parquet file (datasets' {"bytes", "path"} image structs: one column when every row has one control, else a list
    column) or a save_to_disk folder (an Image column, else a list-of-Image column) -> the --data_path."""
    if kind == "webdataset":
        import webdataset as wds
        with wds.TarWriter(str(root / "pairs.tar")) as writer:
            for key, target, caption, controls in rows:
                named = {"control.png": controls[0]} if len(controls) == 1 else \
                    {f"control_{j}.png": c for j, c in reversed(list(enumerate(controls)))}  # numbers, not order
                writer.write({"__key__": key, "png": target, "txt": caption, **named})
        return str(root / "pairs.tar")
    image = [{"bytes": target, "path": f"{key}.png"} for key, target, _, _ in rows]
    control = [[{"bytes": c, "path": f"{key}_{j}.png"} for j, c in enumerate(controls)] for key, _, _, controls in rows]
    single = all(len(c) == 1 for c in control)
    columns = {"image": image, "caption": [caption for _, _, caption, _ in rows],
               "control_image" if single else "control_images": [c[0] for c in control] if single else control}
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table(columns), root / "pairs.parquet", row_group_size=4)
        return str(root / "pairs.parquet")
    import datasets
    features = datasets.Features({"image": datasets.Image(), "caption": datasets.Value("string"),
                                  **({"control_image": datasets.Image()} if single else
                                     {"control_images": datasets.List(datasets.Image())})})
    datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(root / "hf"))
    return str(root / "hf")


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("kind", ["webdataset", "parquet", "hf"])
def test_each_format_gives_the_items_of_the_pairs_as_files(tmp_path, pairs, kind, k):
    targets, controls = pairs
    path = write_stream(kind, tmp_path, list(records(targets, controls[k], k)))
    for size in (16, 8):  # as they are, and resized
        files = EditPairsDataset(targets, size, control_directory=controls[k], channels=1, random_flip=True, seed=3)
        stream = EditStreamDataset(kind, path, size, channels=1, random_flip=True, seed=3)
        assert len(stream) == len(files) == COUNT and stream.controls_per_target == files.controls_per_target == k
        for epoch in (0, 1):
            files.set_epoch(epoch)
            stream.set_epoch(epoch)
            for i in range(COUNT):
                (target, control, caption), (theirs, their_controls, their_caption) = stream[i], files[i]
                assert caption == their_caption and control.shape == (k, 1, size, size)
                assert torch.equal(target, theirs) and torch.equal(control, their_controls)


@pytest.mark.parametrize("kind", ["webdataset", "parquet"])
def test_a_sample_without_a_control_or_with_another_count_is_skipped_and_counted(tmp_path, pairs, kind, caplog):
    targets, controls = pairs
    rows = list(records(targets, controls[2], 2))  # the first keeps two controls: the commonest count still wins
    rows = rows[:1] + [(key, target, caption, c[:1]) for key, target, caption, c in rows[1:]]
    rows.insert(3, ("100", rows[1][1], "mirror it", []))  # no control
    with caplog.at_level(logging.WARNING):
        stream = EditStreamDataset(kind, write_stream(kind, tmp_path, rows), 16, channels=1)
        assert stream.controls_per_target == 1
        items = [stream[i] for i in range(len(stream))]
    assert all(control.shape == (1, 1, 16, 16) for _, control, _ in items)
    assert count_skipped(stream) == 2
    assert "no control" in caplog.text and "2 controls where this run's samples have 1" in caplog.text


def test_a_stream_without_controls_is_one_error_naming_control_key(tmp_path, pairs, text):
    from opendit.data.mixture import read_dataset_config
    from opendit.families import FAMILIES
    targets, controls = pairs
    path = write_stream("parquet", tmp_path, list(records(targets, controls[1], 1)))
    with pytest.raises(ValueError, match="none of its first 6 samples holds a control.*--control_key"):
        EditStreamDataset("parquet", path, 16, control_key="input_image")
    renamed = EditStreamDataset("parquet", path, 16, control_key="input_image,control_image", image_key="image")
    assert renamed.controls_per_target == 1
    config = tmp_path / "data.toml"
    config.write_text(f'[[datasets]]\nkind = "edit_parquet"\npath = "{path}"\ncontrol_key = "control_image"\n')
    cfg = cfglib.TrainConfig(**options(text, dataset_config=str(config)), outputs="unused")
    assert read_dataset_config(config, cfg, FAMILIES["flux1"].datasets)[0].settings["control_key"] == "control_image"


def test_a_run_on_streamed_pairs_trains_and_resumes_exactly(tmp_path, pairs, text, one_thread):
    targets, controls = pairs
    path = write_stream("webdataset", tmp_path, list(records(targets, controls[1], 1)))
    run = options(text, dataset="edit_webdataset", data_path=path, batch_size=2, shuffle_buffer=4)
    trains_and_resumes_exactly(run, tmp_path)
