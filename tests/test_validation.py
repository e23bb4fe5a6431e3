"""Validation loss: fixed samples at fixed noise levels with fixed noise, so it depends on the weights only (not on
the batch size, the world size or how often it runs); held out of training or from --val_data_path; the training
RNG is untouched; every family reports it. Training loss by noise level rides along in the log."""
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from opendit.training.validation import BUCKETS, Validator, holdout
from tests.test_train import run_trainer, tiny_cfg


def _records(run_dir, kind=None):
    rows = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == kind]


def _validator(trainer, micro_batch, dp_rank=0, dp_size=1):
    booster = SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size, autocast=trainer.booster.autocast)
    v = trainer.validator
    return Validator(v.dataset, v.indices, v.objective, booster, micro_batch, v.seed, v.device, v.timesteps)


def test_validation_is_logged_held_out_and_independent_of_batching(tmp_path):
    trainer, _ = run_trainer(tiny_cfg(tmp_path, max_steps=4, val_every=2, val_samples=40))
    val = _records(trainer.run_dir, "val")
    assert [r["step"] for r in val] == [2, 4]
    assert all(set(r) >= {"val_loss", *(f"val_loss_t{k}" for k in range(BUCKETS))} for r in val)
    train = _records(trainer.run_dir)
    assert all(f"loss_t{k}" in r for r in train for k in range(BUCKETS))  # the training loss by noise level
    held_out = set(trainer.validator.indices)
    assert len(held_out) == 40 and not held_out & set(trainer.loader.dataset.indices)
    assert len(trainer.loader.dataset) == len(trainer.dataset) - 40

    rng = torch.get_rng_state()
    again = trainer.validator(trainer.model)
    assert torch.equal(torch.get_rng_state(), rng)  # validation leaves the training RNG alone
    assert again["val_loss"] == pytest.approx(val[-1]["val_loss"], rel=1e-6)  # same weights, same number
    for micro_batch in (3, 40):
        other = _validator(trainer, micro_batch)(trainer.model)
        assert other == pytest.approx(again, rel=1e-5)


def test_val_timesteps_averages_every_sample_over_n_equidistant_levels(tmp_path):
    """--val_timesteps N (the MLPerf FLUX.1 validation loss): each sample at k/N, k = 0..N-1, with its one fixed
    noise; recomputed here by hand from the objective."""
    from torch.utils.data import default_collate

    from opendit.seeding import mix_seed

    trainer, _ = run_trainer(tiny_cfg(tmp_path, max_steps=2, val_every=2, val_samples=6, val_timesteps=4))
    v, model = trainer.validator, trainer.model
    logged = _records(trainer.run_dir, "val")[-1]
    model.eval()
    with torch.no_grad():
        batch = default_collate([v.dataset[i] for i in v.indices])
        x, cond = v.objective.prepare(batch, v.device, train=False)
        noise = torch.stack([torch.randn(x.shape[1:], generator=torch.Generator().manual_seed(mix_seed(v.seed, p)))
                             for p in range(len(v.indices))])
        levels = [v.objective.losses(model, x, cond, t_frac=torch.full((len(x),), k / 4), noise=noise)[0]
                  for k in range(4)]
    assert logged["val_loss"] == pytest.approx(torch.stack(levels).mean().item(), rel=1e-5)
    assert logged["val_loss_t0"] == pytest.approx(levels[0].mean().item(), rel=1e-5)  # one level per bucket here
    assert _validator(trainer, 5)(model) == pytest.approx(v(model), rel=1e-5)  # micro-batches cut across levels


def test_holdout_draws_across_the_data_and_refuses_taking_it_all():
    train, val = holdout(100, 10, seed=0)
    assert len(val) == 10 and sorted(train + val) == list(range(100)) and max(val) - min(val) > 50
    with pytest.raises(ValueError, match="--val_samples 100: the data has only 100 items"):
        holdout(100, 100, seed=0)


def test_val_data_path_leaves_training_as_without_validation(tmp_path):
    from tests.test_data import folder as make_folder

    (tmp_path / "data").mkdir()
    root, _ = make_folder.__wrapped__(tmp_path / "data")
    common = dict(dataset="folder", data_path=str(root), image_size=8, batch_size=4, max_steps=4)
    _, plain = run_trainer(tiny_cfg(tmp_path / "plain", **common))
    trainer, losses = run_trainer(tiny_cfg(tmp_path / "val", val_every=2, val_data_path=str(root), val_samples=4,
                                           **common))
    assert losses == plain  # validation draws nothing from the training RNG
    assert [r["step"] for r in _records(trainer.run_dir, "val")] == [2, 4]


def test_val_data_path_with_built_in_data_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--val_data_path with --dataset digits"):
        run_trainer(tiny_cfg(tmp_path, val_every=2, val_data_path=str(tmp_path)))


def _initial_validation(cfg):
    """The validation loss of the initial weights (the same at any world size), by two micro-batch sizes."""
    from opendit.training.loop import Trainer

    trainer = Trainer(cfg)
    return trainer.validator(trainer.model)["val_loss"], _validator(trainer, 4)(trainer.model)["val_loss"]


def _two_rank_validation(rank, world_size, outputs):
    return _initial_validation(tiny_cfg(outputs, val_every=1, val_samples=15))


@pytest.mark.slow
def test_two_ranks_score_the_same_validation_loss_as_one(tmp_path):
    import torch.distributed as dist
    from tests.distributed import run_distributed

    (two, two_small), _ = run_distributed(_two_rank_validation, 2, str(tmp_path / "two"))
    try:
        one, _ = _initial_validation(tiny_cfg(tmp_path / "one", val_every=1, val_samples=15))
    finally:
        dist.destroy_process_group()
    assert two == pytest.approx(one, rel=1e-6) and two_small == pytest.approx(one, rel=1e-6)


@pytest.mark.parametrize("family", ["video", "flux"])
def test_video_and_flux_report_a_fixed_validation_loss(tmp_path, family):
    """The other families' objectives take fixed noise levels and noise too: the number depends on the weights
    only, and FLUX scores the captions without text dropout."""
    from tests.families.test_flux import flux_cfg, tiny_text_encoders
    from tests.families.test_video import video_cfg

    common = dict(max_steps=2, val_every=1, val_samples=8)
    if family == "video":
        cfg = video_cfg(tmp_path, **common)
    else:  # every caption dropped in training: validation must still score the captions as given
        cfg = flux_cfg(tmp_path, tiny_text_encoders(tmp_path / "encoders"), text_dropout_prob=1.0, **common)
    trainer, _ = run_trainer(cfg)
    val = _records(trainer.run_dir, "val")
    assert [r["step"] for r in val] == [1, 2] and all(torch.isfinite(torch.tensor(r["val_loss"])) for r in val)
    assert val[0]["val_loss"] != val[1]["val_loss"]  # the weights changed between the two
    again = trainer.validator(trainer.model)
    assert again["val_loss"] == pytest.approx(val[-1]["val_loss"], rel=1e-6)
    assert _validator(trainer, 3)(trainer.model) == pytest.approx(again, rel=1e-5)
    if family == "flux":  # validation ignores the training dropout: it gives the same number without it
        objective = trainer.validator.objective
        objective.cfg = dataclasses.replace(objective.cfg, text_dropout_prob=0.0)
        assert trainer.validator(trainer.model)["val_loss"] == pytest.approx(again["val_loss"], rel=1e-6)
