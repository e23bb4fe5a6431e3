"""Preview grids while training (opendit.training.preview): the grid's layout (one class or prompt per row),
fixed noise (the same weights give the same PNG), the global RNGs untouched (a run with previews has the same
losses as one without), TensorBoard's image, and the video (GIF / MP4) and FLUX (prompts) variants."""
import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from opendit import config as cfglib
from opendit.families import family_of
from opendit.training.preview import MIN_TILE, Previewer
from tests.test_train import run_trainer, tiny_cfg


class FakeTB:
    def __init__(self):
        self.images = []

    def add_image(self, tag, image, step, dataformats="CHW"):
        self.images.append((tag, np.asarray(image).copy(), step, dataformats))

    def flush(self):
        pass


def pieces(cfg, seed=0):
    """(family, resolved cfg, encoders, dataset, a model's state dict) as the Trainer builds them."""
    family = family_of(cfg.model)
    cfg = family.resolve_config(cfg)
    encoders = family.load_encoders(cfg, torch.device("cpu"), training=True)
    dataset, cfg = family.load_data(cfg, encoders)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = family.build_model(cfg, family.latent_shape(cfg, encoders, dataset))
    return family, cfg, encoders, dataset, model.state_dict()


def rng_states():
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def assert_same_rng(a, b):
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def grid_shape(rows, cols, h, w):
    return rows * (h + 2) + 2, cols * (w + 2) + 2, 3


def test_dit_grid_has_a_row_per_class_fixed_noise_and_leaves_the_rng_alone(tmp_path, one_thread):
    family, cfg, encoders, dataset, state = pieces(tiny_cfg(tmp_path, sample_every=2))
    previewer = Previewer(family, cfg, encoders, "cpu", tmp_path / "run", dataset=dataset)
    # every class of the digits, one row each (a data set with up to MAX_ROWS classes shows them all)
    assert previewer.conditions == list(range(10)) and (previewer.rows, previewer.cols) == (10, 2)
    assert (previewer.sample_cfg.sampler, previewer.sample_cfg.num_sampling_steps) == ("ddim", 50)
    assert previewer.sample_cfg.cfg_scale == family.default_cfg_scale
    assert [s for s in range(1, 7) if previewer.due(s)] == [2, 4, 6]

    torch.manual_seed(123)
    before, tb = rng_states(), FakeTB()
    first = previewer(2, state, tb=tb)
    second = previewer(4, state, tb=tb)
    assert_same_rng(before, rng_states())  # training's random stream is untouched

    assert first == tmp_path / "run" / "previews" / "step-000002.png" and second.name == "step-000004.png"
    image = np.asarray(Image.open(first))
    tile = 8 * (MIN_TILE // 8)  # 8x8 digits upscaled to 64 px
    assert image.shape == grid_shape(10, 2, tile, tile)  # 10 classes (rows) x 2 samples
    assert np.array_equal(image, np.asarray(Image.open(second)))  # same weights, same noise: same grid
    assert [(t, s, f) for t, _, s, f in tb.images] == [("preview", 2, "HWC"), ("preview", 4, "HWC")]
    assert np.array_equal(tb.images[0][1], image)

    # sample i sits at row i % rows, column i // rows: row r is class r
    samples = previewer.render(state)
    assert samples.shape == (20, 8, 8, 1)
    r, c = 5, 1
    cell = image[2 + r * (tile + 2): 2 + r * (tile + 2) + tile, 2 + c * (tile + 2): 2 + c * (tile + 2) + tile]
    assert np.array_equal(cell[::8, ::8, 0], samples[c * 10 + r][..., 0])

    gen = torch.Generator().manual_seed(1)  # (a fresh DiT's final layer is zero: any seed samples the same)
    other = {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    assert not np.array_equal(previewer.render(other), samples)  # the weights do matter


def test_training_with_previews_has_the_losses_of_training_without(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def run(outputs, previews: bool, **kw):
        return run_trainer(tiny_cfg(outputs, max_steps=4, sample_every=2 if previews else 0, preview_steps=4, **kw))

    for ema_decay in (0.9, 0.0):  # the EMA's weights, or the model's own
        _, plain = run(tmp_path / f"plain{ema_decay}", False, ema_decay=ema_decay)
        trainer, previewed = run(tmp_path / f"preview{ema_decay}", True, ema_decay=ema_decay)
        assert previewed == plain  # exact: the previews drew nothing from training's RNG
        previews = trainer.run_dir / "previews"
        assert sorted(p.name for p in previews.iterdir()) == ["step-000002.png", "step-000004.png"]
        events = EventAccumulator(str(trainer.run_dir / "tensorboard"), size_guidance={"images": 0})
        events.Reload()
        assert [e.step for e in events.Images("preview")] == [2, 4]


def _sharded_run_with_previews(rank, world_size, outputs):
    from opendit.training.loop import Trainer

    trainer = Trainer(tiny_cfg(outputs, plugin="zero3", max_steps=2, ckpt_every=2, sample_every=2, preview_steps=3))
    trainer.train()
    return str(trainer.run_dir)


@pytest.mark.slow
def test_a_sharded_run_previews_its_full_ema_on_rank_0(tmp_path):
    """Under ZeRO-3 each rank holds half of every weight: the preview gathers them and equals a preview of the
    checkpoint's EMA sampled in one process."""
    from safetensors.torch import load_file

    from tests.distributed import run_distributed

    run_dir = Path(run_distributed(_sharded_run_with_previews, 2, str(tmp_path / "two"))[0])
    ema = load_file(run_dir / "checkpoints" / "step-000002" / "ema.safetensors")
    family, cfg, encoders, dataset, _ = pieces(tiny_cfg(tmp_path / "one", preview_steps=3))
    previewer = Previewer(family, cfg, encoders, "cpu", tmp_path / "one", dataset=dataset)
    expected = np.asarray(Image.open(previewer(2, ema)))
    assert np.array_equal(np.asarray(Image.open(run_dir / "previews" / "step-000002.png")), expected)


def test_video_preview_writes_strips_a_gif_and_an_mp4(tmp_path, one_thread):
    cfg = cfglib.TrainConfig(model="Latte-debug", dataset="moving_digits", image_size=8, num_frames=4,
                             num_workers=0, preview_steps=3, outputs=str(tmp_path))
    family, cfg, encoders, dataset, state = pieces(cfg)
    previewer = Previewer(family, cfg, encoders, "cpu", tmp_path / "run", dataset=dataset, rows=3)
    assert previewer.conditions == [0, 1, 2]
    before, tb = rng_states(), FakeTB()
    path = previewer(7, state, tb=tb)
    assert_same_rng(before, rng_states())
    tile = 8 * (MIN_TILE // 8)
    strip = 4 * (tile + 2) - 2  # a clip: its 4 frames side by side
    assert np.asarray(Image.open(path)).shape == grid_shape(3, 2, tile, strip)
    with Image.open(path.with_suffix(".gif")) as gif:
        assert gif.n_frames == 4 and gif.size == grid_shape(3, 2, tile, tile)[1::-1]
    if importlib.util.find_spec("av") is not None:
        assert path.with_suffix(".mp4").stat().st_size > 0
    assert len(tb.images) == 1


@pytest.fixture(scope="module")
def text_encoders(tmp_path_factory):
    from tests.families.test_flux import tiny_text_encoders

    return tiny_text_encoders(tmp_path_factory.mktemp("preview_encoders"), words="all")


def test_flux_preview_samples_the_demo_prompts(tmp_path, text_encoders, one_thread):
    t5, clip = text_encoders
    cfg = cfglib.TrainConfig(model="flux-debug", dataset="captioned_digits", image_size=8, t5=t5, clip=clip,
                             num_workers=0, outputs=str(tmp_path))
    family, cfg, encoders, dataset, state = pieces(cfg)
    previewer = Previewer(family, cfg, encoders, "cpu", tmp_path / "run", dataset=dataset, rows=3)
    assert previewer.conditions == ["a handwritten zero", "a handwritten one", "a handwritten two"]
    assert (previewer.sample_cfg.sampler, previewer.sample_cfg.num_sampling_steps) == ("euler", 20)
    before = rng_states()
    path = previewer(3, state)
    assert_same_rng(before, rng_states())
    tile = 8 * (MIN_TILE // 8)
    image = np.asarray(Image.open(path))
    assert image.shape == grid_shape(3, 2, tile, tile)
    assert np.array_equal(image, np.asarray(Image.open(previewer(6, state))))


def test_video_prompts_come_from_the_training_captions(tmp_path, text_encoders, one_thread):
    _, clip = text_encoders
    cfg = cfglib.TrainConfig(model="VDiT-debug", dataset="moving_digits", image_size=8, num_frames=2, clip=clip,
                             num_workers=0, preview_steps=2, outputs=str(tmp_path))
    family, cfg, encoders, dataset, state = pieces(cfg)
    previewer = Previewer(family, cfg, encoders, "cpu", tmp_path / "run", dataset=dataset, rows=2, per_row=1)
    assert previewer.conditions == [dataset.caption(0), dataset.caption(1)]
    assert previewer(1, state).is_file()
