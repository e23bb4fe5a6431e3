"""The LoRA demo (RECIPE=lora_digits bash train_flux.sh): --digits trains on a subset of the built-in digits, and
benchmarks/lora_quality.py's plumbing runs the recipe's two stages, samples with and without the adapter and
classifies."""
import dataclasses

import numpy as np
import pytest

from opendit import config as cfglib
from opendit.data import CaptionedDigitsDataset, DigitsDataset
from opendit.data.captions import DIGIT_WORDS
from opendit.data.digits import parse_digits
from tests.families.test_flux import encoders, flux_cfg  # noqa: F401  (encoders: a module fixture)
from tests.test_quality_benchmarks import result_of
from tests.test_train import run_trainer
from tests.run_each import cli


def test_parse_digits():
    assert parse_digits("0-4") == (0, 1, 2, 3, 4)
    assert parse_digits("9,5, 7-8") == (5, 7, 8, 9)
    assert parse_digits("3") == (3,)
    for bad in ("", "4-0", "10", "0-10", "five", "1,,2", "-3"):
        with pytest.raises(ValueError, match="--digits"):
            parse_digits(bad)


def test_a_digit_subset_keeps_those_digits_and_their_captions():
    old = CaptionedDigitsDataset(8, digits=(0, 1, 2, 3, 4))
    labels = CaptionedDigitsDataset(8).labels
    assert len(old) == int(np.isin(labels, range(5)).sum()) and set(old.labels) == {0, 1, 2, 3, 4}
    words = {w for c in old.captions for w in c.split()}
    assert words & set(DIGIT_WORDS) == set(DIGIT_WORDS[:5])
    assert old.preview_prompts(8) == [f"a handwritten {w}" for w in DIGIT_WORDS[:5]]
    assert all(old.caption(i).endswith(DIGIT_WORDS[old.labels[i]]) for i in range(0, len(old), 37))
    held = DigitsDataset(8, split="held_out", digits=(9, 5))
    assert set(held._labels) == {5, 9} and held.num_classes == 10  # labels stay the digits
    with pytest.raises(ValueError, match="subset of 0..9"):
        DigitsDataset(8, digits=(3, 12))


def test_digits_flag_is_checked_before_anything_runs():
    cfg = cfglib.TrainConfig(model="flux-debug", dataset="captioned_digits", digits="4-0")
    with pytest.raises(ValueError, match="--digits 4-0"):
        cfglib.check_config(cfg)
    cfglib.check_config(dataclasses.replace(cfg, digits="5-9"))


def test_training_on_a_digit_subset(tmp_path, encoders):  # noqa: F811
    """The run's data (and the validation items held out of it, and the preview prompts) are the subset's."""
    trainer, losses = run_trainer(flux_cfg(tmp_path, encoders, digits="5-9", max_steps=2, val_every=2,
                                           val_samples=8))
    assert set(trainer.dataset.labels) == {5, 6, 7, 8, 9} and np.isfinite(losses).all()
    with pytest.raises(ValueError, match="--digits 0-4: only the built-in digits"):
        run_trainer(flux_cfg(tmp_path, encoders, digits="0-4", dataset="captions", data_path=str(tmp_path)))


@pytest.mark.slow
def test_lora_quality_smoke(tmp_path):
    """The recipe's stages (a few steps each; one prior image per 0-4 caption), sampling with and without the
    adapter, the table."""
    out = cli("benchmarks/lora_quality.py", "--base_steps", "2", "--lora_steps", "2", "--batch_size", "4",
              "--samples_per_digit", "1", "--sampling_steps", "2", "--prior", "1", "--outputs", tmp_path)
    result = result_of(out)
    assert {"stage_1", "stage_1b", "stage_2"} <= set(result["seconds"])
    assert len(list((tmp_path / "prior").glob("*.txt"))) == 20  # the 20 captions of 0-4, one image each
    assert [(r["samples"], r["digits"]) for r in result["rows"]] == [
        ("base + adapter", "5-9"), ("base + adapter", "0-4"), ("base alone", "5-9"), ("base alone", "0-4")]
    assert all(0 <= r["accuracy"] <= 1 for r in result["rows"])
    assert result["lora"].endswith("step-000002") and result["base"].endswith("step-000002/ema.safetensors")
    assert "| base + adapter | 5-9 |" in out.stdout
