"""Datasets mixed by a --dataset_config file: repeats, per-dataset settings and caption options; global batches
from one dataset bucket each; the mixture a pure function of seed and epoch, so runs resume exactly (also at
another world size); every mistake in the file one line before any model is built."""
import re

import numpy as np
import pytest
import torch

from opendit.data.captions import CaptionedDigitsDataset
from opendit.data.mixture import CaptionOptions, DatasetEntry, MixedDataset
from tests.test_train import ROOT, _run, run_trainer, tiny_cfg

MIX = """
[[datasets]]
kind = "digits"
name = "old digits"
digits = "0-4"

[[datasets]]
kind = "digits"
name = "new digits"
digits = "5-9"
repeats = 3
"""


def _mixed(tmp_path, text=MIX, **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "data.toml").write_text(text)
    return tiny_cfg(tmp_path / "out", dataset_config=str(tmp_path / "data.toml"), **kw)


def _parts_of_batches(trainer):
    """The (dataset, bucket) group of every item of each global batch of the current epoch."""
    sampler = trainer.loader.sampler
    return sampler.groups[sampler.permutation().view(-1, sampler.global_batch_size).numpy()]


def test_an_epoch_repeats_each_dataset_and_every_batch_comes_from_one(tmp_path, capfd):
    trainer, losses = run_trainer(_mixed(tmp_path, max_steps=2))
    old, new = trainer.dataset.parts
    assert set(old._labels.tolist()) == {0, 1, 2, 3, 4} and set(new._labels.tolist()) == {5, 6, 7, 8, 9}
    assert len(trainer.dataset) == len(old) + 3 * len(new)
    groups = _parts_of_batches(trainer)
    assert (groups == groups[:, :1]).all()  # one dataset bucket per global batch
    batches_of = np.bincount(groups[:, 0])
    assert list(batches_of) == [len(old) // 16, 3 * len(new) // 16]
    logged = capfd.readouterr().err
    share = 3 * len(new) / (len(old) + 3 * len(new))
    assert "datasets (--dataset_config" in logged and "new digits" in logged and f"{share:.1%}" in logged
    # an item of the repeated dataset is the same digit in each of its copies
    k, j = trainer.dataset.locate(len(old) + len(new) + 5)
    assert (k, j) == (1, 5) and torch.equal(trainer.dataset[len(old) + 5][0], trainer.dataset[len(old) + len(new)
                                                                                             + 5][0])
    assert all(np.isfinite(losses))


def test_a_mixed_run_resumes_exactly(tmp_path):
    _, full = run_trainer(_mixed(tmp_path / "a", max_steps=6, ckpt_every=3))
    run_trainer(_mixed(tmp_path / "b", max_steps=3, ckpt_every=3))
    _, resumed = run_trainer(_mixed(tmp_path / "b", max_steps=6, ckpt_every=3, load="latest"))
    assert resumed == full[3:]  # exact in fp32
    with pytest.raises(ValueError, match="data position is for a dataset of"):  # other repeats: refused
        run_trainer(_mixed(tmp_path / "b", text=MIX.replace("repeats = 3", "repeats = 2"), max_steps=9,
                           ckpt_every=3, load="latest"))


def test_each_dataset_keeps_its_own_image_size(tmp_path):
    text = MIX + "image_size = 16\n"  # the second dataset only
    trainer, losses = run_trainer(_mixed(tmp_path, text=text, max_steps=3))
    sizes = {tuple(trainer.dataset[i][0].shape[-2:]) for i in (0, len(trainer.dataset) - 1)}
    assert sizes == {(8, 8), (16, 16)} and all(np.isfinite(losses))
    assert [str(b) for b in trainer.dataset.buckets.buckets] == ["8x8", "16x16"]


def test_caption_options_are_drawn_per_seed_epoch_and_item():
    options = CaptionOptions(trigger="sks", shuffle_tags=True, keep_tags=1, caption_dropout=0.25)
    caption = "a dog, red, small, running, grass"
    seen = [options.apply(caption, seed) for seed in range(400)]
    assert seen == [options.apply(caption, seed) for seed in range(400)]  # a pure function of the seed
    dropped = sum(s == "" for s in seen)
    assert 60 < dropped < 140  # about 25% empty captions (unconditional samples)
    kept = [s for s in seen if s]
    assert all(s.startswith("sks, a dog, ") for s in kept)
    assert all(sorted(s.split(", ")[2:]) == ["grass", "red", "running", "small"] for s in kept)
    assert len({s for s in kept}) > 10  # the tags after the first are shuffled

    parts = [CaptionedDigitsDataset(8, digits=(1,)), CaptionedDigitsDataset(8, digits=(2,))]
    entries = [DatasetEntry("one", {"dataset": "captioned_digits"}, 2, CaptionOptions(trigger="ones")),
               DatasetEntry("two", {"dataset": "captioned_digits"}, 1, CaptionOptions())]
    mixed = MixedDataset(parts, entries, [8, 8], seed=0)
    assert mixed[0][1].startswith("ones, ") and mixed[0][1][6:] == parts[0].caption(0)
    assert mixed[len(mixed) - 1][1] == parts[1].caption(len(parts[1]) - 1)
    assert mixed.num_classes == 0 and mixed.caption(len(parts[0])) == "ones, " + parts[0].caption(0)


@pytest.mark.parametrize("text, match", [
    ('[[datasets]]\nkind = "digits"\nrepeats = 0\n', r"dataset 1: repeats = 0; must be an integer >= 1"),
    ('[[datasets]]\nkind = "digits"\nrepeat = 2\n', r"dataset 1: unknown key 'repeat'; did you mean 'repeats'"),
    ('[[datasets]]\nkind = "captions"\n', r"dataset 1: kind = 'captions'; DiT-debug trains on: digits, folder"),
    ('[[datasets]]\nkind = "folder"\npath = "/no/such/folder"\n', r"path '/no/such/folder' does not exist"),
    ('[[datasets]]\nkind = "folder"\n', r"kind 'folder' needs a path"),
    ('[[datasets]]\nkind = "digits"\nrepeats = "2"\n', r"repeats = '2' must be of type int"),
    ('[[datasets]]\nkind = "digits"\ncaption_dropout = 2\n', r"caption_dropout must be in \[0, 1\]"),
    ('[[datasets]]\nkind = "digits"\nimage_size = 0\n', r"--image_size 0: must be an integer > 0"),
    ('[[datasets]]\nkind = "digits"\nimage_size = "16"\n', r"image_size = '16' must be of type int \| None"),
    ('[[datasets]]\nkind = "digits"\n[other]\n', r"unknown top-level key 'other'"),
    ('[[datasets]]\nkind = "digits"\nrepeats = = 1\n', r"data.toml: not valid TOML: .*line 3"),
    ("datasets = []\n", r"a dataset config is a list of \[\[datasets\]\] tables"),
])
def test_a_bad_dataset_config_fails_before_any_model_or_folder(tmp_path, text, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        run_trainer(_mixed(tmp_path, text=text))
    assert not (tmp_path / "out").exists()  # nothing written
    assert (tmp_path / "data.toml").read_text() == text


def test_the_docs_dataset_config_trains_through_train_py(tmp_path):
    """docs/training.md's dataset config example, as a user copies it."""
    doc = (ROOT / "docs" / "training.md").read_text()
    example = re.search(r"```toml\n(# data.toml.*?)```", doc, re.S).group(1)
    (tmp_path / "data.toml").write_text(example)
    out = _run(["train.py", "--model", "DiT-debug", "--dataset_config", str(tmp_path / "data.toml"), "--image_size",
                "8", "--batch_size", "16", "--max_steps", "2", "--num_workers", "0", "--outputs", str(tmp_path / "o")])
    assert "old digits" in out.stderr and "new digits" in out.stderr


@pytest.mark.slow
def test_a_mixed_run_resumes_at_another_world_size(tmp_path):
    """Two processes train 3 steps; one process resumes: the global batches that follow are those two processes
    would have trained."""
    import torch.distributed as dist

    from opendit.training.loop import Trainer
    from tests.test_buckets import _global_batches

    cfg = _mixed(tmp_path, max_steps=6, ckpt_every=3, load="latest")
    _run(["train.py", "--model", "DiT-debug", "--dataset_config", cfg.dataset_config, "--image_size", "8",
          "--batch_size", "16", "--log_every", "1", "--num_workers", "0", "--ckpt_every", "3", "--lr", "1e-3",
          "--ema_decay", "0.9", "--max_steps", "3", "--outputs", cfg.outputs], nproc=2)
    try:
        trainer = Trainer(cfg)
        sampler = trainer.loader.sampler
        assert (sampler.num_replicas, sampler.consumed) == (1, 48)
        two_ranks, _ = _global_batches(sampler.groups, dp=2, seed=0, batch=16)
        assert torch.equal(torch.tensor(list(sampler)).view(-1, 16), two_ranks[3:])
        losses = trainer.train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert len(losses) == 3 and all(np.isfinite(losses))


def test_prior_batches_weigh_by_prior_loss_weight(tmp_path):
    """Every global batch comes from one dataset: a prior dataset's batches have their loss (and gradients)
    scaled by --prior_loss_weight, the others not."""
    text = MIX.replace('name = "old digits"', 'name = "old digits"\nprior = true')
    a, plain = run_trainer(_mixed(tmp_path / "a", text=text, max_steps=12))
    _, weighted = run_trainer(_mixed(tmp_path / "b", text=text, max_steps=12, prior_loss_weight=0.5))
    prior = (_parts_of_batches(a)[:12, 0] == 0).tolist()  # part 0's one bucket is group 0
    first = prior.index(True)  # (this seed's order has one among the first 12)
    assert weighted[:first] == plain[:first]  # the same model until the first prior batch
    assert weighted[first] == pytest.approx(0.5 * plain[first], rel=1e-6)
    assert a.dataset.loss_weight(0) == 1.0 and a.dataset.entries[0].loss_weight == 1.0  # the default weight


def test_prior_images_from_the_base_train_as_a_prior_dataset(tmp_path):
    """python -m opendit.prior writes a captioned folder sampled from a text model; a dataset config marks it prior
    beside the new data."""
    from opendit.prior import main as prior_main
    from tests.families.test_flux import flux_cfg, tiny_text_encoders

    encoders = tiny_text_encoders(tmp_path / "enc")
    base, _ = run_trainer(flux_cfg(tmp_path / "base", encoders, max_steps=2, digits="0-4"))
    ckpt = next((tmp_path / "base").glob("*/checkpoints/step-000002"))
    prompts = ["a handwritten zero", "the digit one"]
    prior_main(["--ckpt", str(ckpt), "--prompts", *prompts, "--num", "3", "--out", str(tmp_path / "prior"),
                "--num_sampling_steps", "2", "--batch_size", "4"])
    images = sorted((tmp_path / "prior").glob("*.png"))
    assert len(images) == 6 and sorted(p.name for p in (tmp_path / "prior").iterdir()) == sorted(
        [p.name for p in images] + [p.with_suffix(".txt").name for p in images])
    assert [p.with_suffix(".txt").read_text().strip() for p in images] == prompts * 3
    with pytest.raises(SystemExit):  # a folder that holds files is never written into
        prior_main(["--ckpt", str(ckpt), "--prompts", "x", "--num", "1", "--out", str(tmp_path / "prior")])
    assert len(list((tmp_path / "prior").iterdir())) == 12
    (tmp_path / "data.toml").write_text(f'[[datasets]]\nkind = "captioned_digits"\ndigits = "5-9"\n\n'
                                        f'[[datasets]]\nkind = "captions"\npath = "{tmp_path / "prior"}"\n'
                                        f'prior = true\nrepeats = 4\n')
    trainer, losses = run_trainer(flux_cfg(tmp_path / "lora", encoders, init_weights=str(ckpt / "ema.safetensors"),
                                           lora_rank=4, dataset_config=str(tmp_path / "data.toml"),
                                           prior_loss_weight=0.5, max_steps=2))
    assert [e.loss_weight for e in trainer.dataset.entries] == [1.0, 0.5] and all(np.isfinite(losses))
    mixed = trainer.dataset  # the RGB prior images in the grey digits' one channel (luma)
    assert trainer.dataset.parts[1].channels == 3 and mixed[len(mixed) - 1][0].shape == mixed[0][0].shape == (1, 8, 8)


def test_a_captioned_folder_with_its_own_caption_extension(tmp_path):
    """kohya's .caption files: a dataset's caption_extension (also --caption_extension) picks them, beside .txt
    files the run ignores; the trigger goes first."""
    from PIL import Image

    from tests.families.test_flux import flux_cfg, tiny_text_encoders

    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(4):
        Image.new("RGB", (8, 8), (60 * i, 0, 0)).save(folder / f"{i}.png")
        (folder / f"{i}.caption").write_text(f"a handwritten {['one', 'two', 'three', 'four'][i]}\n")
        (folder / f"{i}.txt").write_text("not this one\n")
    (tmp_path / "data.toml").write_text(f'[[datasets]]\nkind = "captions"\npath = "{folder}"\n'
                                        f'caption_extension = ".caption"\ntrigger = "sks"\n')
    trainer, losses = run_trainer(flux_cfg(tmp_path / "out", tiny_text_encoders(tmp_path / "enc"),
                                           dataset_config=str(tmp_path / "data.toml"), max_steps=1))
    assert [trainer.dataset.caption(i) for i in range(4)] == [
        "sks, a handwritten one", "sks, a handwritten two", "sks, a handwritten three", "sks, a handwritten four"]
    assert trainer.dataset[0][1] == "sks, a handwritten one" and all(np.isfinite(losses))
