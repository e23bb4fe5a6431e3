"""The quality benchmarks' smoke runs: train a few steps, sample, classify, print the JSON result."""
import json

import pytest

from tests.run_each import cli


def result_of(out) -> dict:
    text = out.stdout
    return json.loads(text[text.index("{"):text.rindex("}") + 1])


@pytest.mark.slow
def test_video_quality_smoke(tmp_path):
    out = cli("benchmarks/video_quality.py", "--max_steps", "3", "--batch_size", "4", "--samples_per_class", "1",
              "--sampling_steps", "2", "--outputs", tmp_path)
    result = result_of(out)
    assert 0 <= result["generated_frame_accuracy"] <= 1 and result["clips"] == 10
    assert result["motion_generated"]["mean_velocity_change_px"] is not None  # 3 frames: defined


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["wan_digits", "wan22_i2v_digits"])
def test_wan_video_quality_smoke(tmp_path, recipe):
    """Prompts of a digit and a direction (wan22_i2v_digits: with each held-out clip's first frame); the real clips
    move as their captions say."""
    out = cli("benchmarks/video_quality.py", "--recipe", recipe, "--max_steps", "3", "--batch_size", "4",
              "--samples_per_class", "1", "--sampling_steps", "2", "--outputs", tmp_path)
    result = result_of(out)
    assert result["direction_real"] == 1.0 and 0 <= result["direction_generated"] <= 1
    assert 0 <= result["generated_frame_accuracy"] <= 1 and result["clips"] == 10
    if recipe == "wan22_i2v_digits":
        assert 0 <= result["first_frame_mean_abs_error"] <= 1 and len(list((tmp_path / "first_frames").iterdir())) == 10


@pytest.mark.slow
@pytest.mark.parametrize("model", ["flux-debug", "flux2-klein-debug"])
def test_flux_quality_smoke(tmp_path, model):
    out = cli("benchmarks/flux_quality.py", "--model", model, "--max_steps", "3", "--batch_size", "8",
              "--samples_per_digit", "1", "--sampling_steps", "2", "--outputs", tmp_path)
    result = result_of(out)
    assert 0 <= result["prompted_digit_accuracy"] <= 1 and result["samples"] == 10 and result["model"] == model


@pytest.mark.slow
def test_digits_quality_curve_smoke(tmp_path):
    """--eval_every scores each saved checkpoint: the quality-vs-steps curve the demo recipe was chosen by."""
    out = cli("benchmarks/digits_quality.py", "--max_steps", "4", "--eval_every", "2", "--batch_size", "8",
              "--samples_per_class", "1", "--sampling_steps", "2", "--outputs", tmp_path)
    result = result_of(out)
    assert [c["steps"] for c in result["checkpoints"]] == [2, 4] and result["samples"] == 10
    assert all(0 <= c["generated_class_accuracy"] <= 1 for c in result["checkpoints"])
    assert "| 4 |" in out.stdout


@pytest.mark.slow
def test_edit_quality_smoke(tmp_path):
    out = cli("benchmarks/edit_quality.py", "--max_steps", "2", "--batch_size", "8", "--samples_per_edit", "2",
              "--sampling_steps", "2", "--outputs", tmp_path)
    result = result_of(out)
    assert result["edits_each"] == 2 and set(result["edits"]) == {
        f"cfg {s}: {e}" for s in (1, 4) for e in ("the next digit", "mirror it", "rotate it a quarter turn",
                                                  "make the strokes thicker")}
    assert all(0 <= v <= 1 for row in result["edits"].values() for v in row.values())


def test_edit_scores_take_an_exact_edit_as_within_and_kept_and_an_unedited_input_as_neither():
    import numpy as np

    from benchmarks.edit_quality import edit_scores
    from opendit.data.edit_pairs import EditDigitsDataset
    data = EditDigitsDataset(16, split="held_out")
    inputs = np.stack([np.asarray(data._pixels(i, -1)) for i in range(8)])
    mirrored = np.stack([np.asarray(data._pixels(i, 1)) for i in range(8)])
    assert edit_scores(mirrored, inputs, mirrored) == dict(within=1.0, unedited_within=edit_scores(
        inputs, inputs, mirrored)["within"], kept=1.0)
    assert edit_scores(inputs, inputs, mirrored)["within"] < 0.5
    assert edit_scores(np.full_like(inputs, 255), inputs, mirrored) == dict(within=0.0, unedited_within=edit_scores(
        inputs, inputs, mirrored)["within"], kept=0.0)
