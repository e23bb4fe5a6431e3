"""benchmarks/wan_memory.py (the memory plan of a Wan2.1 full fine-tune at 81 x 480 x 832, from the meta device) and
benchmarks/wan_lean_step.py (a lean training step through the Trainer) run on a CPU: the plan's tables add up, zero3
divides the weights and states by the GPU count, the lean 14B plan fits one 80 GB GPU, and the measured per-token
activation bytes equal the docstring's formula; the lean step runs Wan-debug with block swap."""
import re

import numpy as np
import pytest

from tests.run_each import cli

PARTS = 8  # weights, in flight, grads, states, master, activations, text encoder, VAE


def plan_tables(text: str) -> dict[str, list[tuple[str, list[float], float]]]:
    """{model: [(setting, GPU parts, GPU total)]} from the script's Markdown."""
    tables, model = {}, None
    for line in text.splitlines():
        if line.startswith("### "):
            model = line[4:].split(":")[0]
            tables[model] = []
        elif line.startswith("| ") and not line.startswith("| setting"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert len(cells) == 1 + PARTS + 2, line
            tables[model].append((cells[0], [float(c) for c in cells[1:1 + PARTS]], float(cells[-2].strip("*"))))
    return tables


def test_memory_plan_adds_up_shards_by_eight_and_fits_the_lean_14b_on_one_80_gb_gpu(tmp_path):
    out = tmp_path / "wan_memory.md"
    cli("benchmarks/wan_memory.py", "--out", out)
    text = out.read_text()
    tables = plan_tables(text)
    assert set(tables) == {"Wan2.1-T2V-14B", "Wan2.1-T2V-1.3B"}
    for model, rows in tables.items():
        for setting, parts, total in rows:
            assert total == pytest.approx(sum(parts), abs=PARTS * 0.005), (model, setting)  # cells round to 0.01
        (ref_name, ref, _), (a_name, a, a_total) = rows[:2]
        assert ref_name.startswith("unsharded") and a_name.startswith("(a) 8 GPUs")
        assert a[0] == pytest.approx(ref[0] / 8, abs=0.01)  # zero3: the weights, 1/8 per GPU
        assert a[3] == pytest.approx(ref[3] / 8, abs=0.01)  # and the AdamW states
        assert a_total <= 80
    lean = [(name, total) for name, _, total in tables["Wan2.1-T2V-14B"] if name.startswith("(b)")]
    assert lean[0][1] <= 80  # the lean 14B at 81 frames fits 80 GB (tightly: 76 GB, estimated)
    swap = [total for name, total in lean if "--blocks_to_swap" in name]
    assert swap and swap[0] <= 80 - 8  # block swap leaves the default 8 GB margin free
    measured = re.findall(r"measured (\d+), formula 66 D \+ 4 F \+ 8 H \+ 36 = (\d+)", text)
    assert len(measured) == 2 and all(m == f for m, f in measured)  # the docstring's formula is what autograd saves


def test_wan22_rows_one_a14b_expert_and_ti2v_5b_with_its_16x_vae(tmp_path):
    """One I2V-A14B expert is the 14B plan's network with 36 input channels; TI2V-5B at 121 x 704 x 1280 has
    31 x 22 x 40 = 27,280 video tokens (the 16x VAE) and its 48-channel VAE's bytes."""
    out = tmp_path / "wan22.md"
    cli("benchmarks/wan_memory.py", "--model", "Wan2.2-I2V-A14B", "Wan2.2-TI2V-5B", "--num_frames", "121", "--height",
        "704", "--width", "1280", "--out", out)
    text = out.read_text()
    tables = plan_tables(text)
    assert set(tables) == {"Wan2.2-I2V-A14B", "Wan2.2-TI2V-5B"}
    for model, rows in tables.items():
        for setting, parts, total in rows:
            assert total == pytest.approx(sum(parts), abs=PARTS * 0.005), (model, setting)
    assert "Wan2.2-TI2V-5B: 5.00B parameters, 121 x 704 x 1280 (27280 video" in text
    assert "Wan VAE 704.7M" in text and "14.29B parameters" in text  # I2V-A14B's expert: 14,288,901,184
    measured = re.findall(r"measured (\d+), formula 66 D \+ 4 F \+ 8 H \+ 36 = (\d+)", text)
    assert len(measured) == 2 and all(m == f for m, f in measured)


@pytest.mark.parametrize("model, size, grid, extra", [("Wan-debug", "64", "(2, 2, 2)", ()),
                                                    ("Wan2.2-debug", "128", "(2, 4, 4)", ("--base",))])
def test_lean_step_runs_wan_debug_on_cpu(tmp_path, model, size, grid, extra):
    """Wan2.1's VAE geometry (16 channels, 8x) from random weights; Wan2.2's (48, 16x) from a zero base file."""
    cli("benchmarks/wan_lean_step.py", "--model", model, "--num_frames", "5", "--height", size, "--width", size,
        "--device", "cpu", "--steps", "2", "--blocks_to_swap", "1", "--work", tmp_path / "lean",
        "--out", tmp_path / "lean.md", *[x for e in extra for x in (e, tmp_path / "base.safetensors")])
    text = (tmp_path / "lean.md").read_text()
    last = text.splitlines()[-1].split("|")
    assert float(last[6]) > 0  # wan_memory.py's plan for the same run
    assert np.isfinite(float(last[8]))  # the step ran and its loss is a number
    assert f"patch grid {grid}" in text
