"""Every registered family trains from a sharded stream: its debug model, its tiny encoders, the demo digits (or
moving digits) written as WebDataset tar shards, a --dataset_config entry for the image families. A family that
gains no stream datasets fails the coverage test."""
import functools

import numpy as np
import pytest

from opendit import config as cfglib
from opendit.data.shards import write
from opendit.families import FAMILIES
from tests.families.test_conformance import DEBUG, IMAGE_SIZE
from tests.test_train import run_trainer


def _flux(root):
    from tests.families.test_flux import tiny_text_encoders

    t5, clip = tiny_text_encoders(root)
    return {"t5": t5, "clip": clip}


def _tiny_text(model, words, root):
    from opendit.families.wrapped.tiny_text import write_text_encoder
    return {"text_encoder": write_text_encoder(model, root / "text", words)}


def _umt5(flag, root):
    from opendit.families.wan.tiny_umt5 import save_tiny_umt5
    return {flag: save_tiny_umt5(root / "umt5", max_length=16)}


IMAGE = dict(image_size=8)
CLIP = dict(image_size=8, num_frames=3)
# family -> (debug model, its encoders' flags made under a folder, settings, clips?)
TABLE = {
    "dit": ("DiT-debug", lambda root: {}, dict(IMAGE, num_classes=10), False),
    "flux": ("flux-debug", _flux, IMAGE, False),
    "video": ("Latte-debug", lambda root: {}, dict(CLIP, num_classes=10), True),
    "wan": ("Wan-debug", functools.partial(_umt5, "umt5"), CLIP, True),
}
for _family, _model in DEBUG.items():  # the diffusers kind's, in pixel space through their tiny text encoders
    _clips = "moving_digits" in FAMILIES[_family].datasets
    TABLE[_family] = (_model, functools.partial(_tiny_text, _model, "moving_digits" if _clips else "digits"),
                      dict(CLIP if _clips else IMAGE, vae="none", image_size=IMAGE_SIZE.get(_family, 8),
                           **(dict(num_frames=5) if _clips else {})), _clips)


@pytest.fixture(scope="module")
def shard_paths(tmp_path_factory):
    """{False: captioned digit shards, True: moving digit clip shards} (tar patterns)."""
    root = tmp_path_factory.mktemp("family_shards")
    images = write(str(root / "images"), "captioned_digits", ("webdataset",), image_size=8, shard_size=16, limit=48)
    clips = write(str(root / "clips"), "moving_digits", ("webdataset",), image_size=16, shard_size=8, limit=16,
                  num_frames=6)
    return {False: images["webdataset"], True: clips["webdataset"]}


def test_every_registered_family_offers_the_three_streams():
    built_in = {name for name, family in FAMILIES.items() if type(family).__module__.startswith("opendit.")}
    for name in built_in:  # (test families registered by other tests are not opendit's)
        assert {"webdataset", "parquet", "hf"} <= set(FAMILIES[name].datasets), name
    assert set(TABLE) == built_in, "add the new family's debug run to TABLE"


@pytest.mark.parametrize("family", sorted(TABLE))
def test_the_family_trains_from_tar_shards(tmp_path, shard_paths, family):
    model, encoders, settings, clips = TABLE[family]
    cfg = cfglib.TrainConfig(model=model, dataset="webdataset", data_path=shard_paths[clips], batch_size=4,
                             max_steps=2, log_every=1, ckpt_every=100, num_workers=0, outputs=str(tmp_path / "run"),
                             lr=1e-3, ema_decay=0.9, **encoders(tmp_path), **settings)
    trainer, losses = run_trainer(cfg)
    assert len(losses) == 2 and all(np.isfinite(losses)), family
    assert trainer.loader.sampler.order is not None  # the stream's own order, not a map-style permutation


def test_a_stream_mixes_with_a_folder_in_a_dataset_config(tmp_path, shard_paths):
    config = tmp_path / "data.toml"
    config.write_text(f'[[datasets]]\nkind = "webdataset"\npath = "{shard_paths[False]}"\nrepeats = 2\n'
                      f'trigger = "sks"\n\n[[datasets]]\nkind = "captioned_digits"\n')
    cfg = cfglib.TrainConfig(model="flux-debug", dataset_config=str(config), image_size=8, batch_size=4, max_steps=2,
                             log_every=1, num_workers=0, outputs=str(tmp_path / "run"), lr=1e-3, ema_decay=0.9,
                             **_flux(tmp_path))
    trainer, losses = run_trainer(cfg)
    assert all(np.isfinite(losses)) and len(trainer.dataset) == 2 * 48 + 1797
    assert trainer.dataset[0][1].startswith("sks")
