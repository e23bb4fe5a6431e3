"""The sampling benchmark's CPU smoke run (benchmarks/sample_throughput.py), in-process.

Tolerances: `ours` samples with bf16 weights (each bf16 op errs by up to 2^-8 relative) while `a` is fp32.
Random weights make DDPM's predicted x0 large (x_t / sqrt(alpha_bar) when eps misses the noise: mean |z| ~ 1e2
after 2 steps of DiT-debug), so the differences are judged against a's own scale: measured mean |diff| 0.3%
of mean |z| and max |diff| 0.3% of max |z| (b, autocast: 0.2%; ours without kernels: 0.4%); we require
nonzero and under 3% for both. A wrong dtype path,
other weights or other noise moves them by ~100%. `a` run twice builds the model and samples again from
scratch: on one CPU thread that is bit-identical, so its difference is exactly 0.
"""
import math

import pytest



def test_sample_benchmark_cpu_smoke(tmp_path, capsys, one_thread):
    from benchmarks import sample_throughput
    out = tmp_path / "sampling.md"
    rows = sample_throughput.main(["--model", "DiT-debug", "--image_size", "64", "--batch_size", "2", "--steps", "2",
                                   "--warmup_steps", "1", "--device", "cpu", "--skip_compile", "--variants", "a",
                                   "ours", "b", "a", "--out", str(out)])
    table = out.read_text()
    assert table.strip() in capsys.readouterr().out
    assert [r["key"] for r in rows] == ["a", "ours", "b", "a"]
    assert [r["status"] for r in rows] == ["ok", "ok", "skipped (--skip_compile)", "ok"]
    for r in (rows[0], rows[1], rows[3]):
        assert r["variant"] in table
        assert r["ms_per_step"] > 0 and math.isfinite(r["ms_per_step"]) and r["warmup_s"] >= 0
        assert r["img_per_s"] == pytest.approx(2 / (r["ms_per_step"] * 250 / 1e3))
        assert math.isfinite(r["max_diff"]) and math.isfinite(r["mean_diff"])
    assert "| variant |" in table and "max abs diff vs a" in table and "| 1.00 |" in table  # a vs itself

    mean_z, max_z = rows[0]["ref_scale"]
    assert mean_z > 0 and max_z >= mean_z
    assert rows[0]["max_diff"] == 0 and rows[3]["max_diff"] == 0 and rows[3]["mean_diff"] == 0
    ours = rows[1]
    assert 0 < ours["mean_diff"] < 0.03 * mean_z and 0 < ours["max_diff"] < 0.03 * max_z
    assert "not compiled (--skip_compile)" in ours["notes"] and "attn=sdpa" in ours["notes"]


def test_sample_benchmark_compiled_variants_on_cpu(tmp_path, one_thread):
    """Every variant with its compile, through aot_eager (no inductor / C++ on the CPU) and Triton's
    interpreter: the compiled paths gpu_check.sh relies on (whole-model compile under autocast, per-block
    compile around the kernels' custom ops) must trace and sample before a GPU lease is spent on them."""
    from benchmarks import sample_throughput
    rows = sample_throughput.main(["--model", "DiT-debug", "--image_size", "64", "--batch_size", "2", "--steps", "2",
                                   "--warmup_steps", "1", "--device", "cpu", "--compile_backend", "aot_eager",
                                   "--out", str(tmp_path / "sampling.md")])
    assert [r["key"] for r in rows] == list(sample_throughput.VARIANTS)
    assert all(r["status"] == "ok" for r in rows), [r["status"] for r in rows]
    mean_z, max_z = rows[0]["ref_scale"]
    for r in rows[1:]:  # bf16 in every other variant
        assert 0 < r["mean_diff"] < 0.03 * mean_z and 0 < r["max_diff"] < 0.03 * max_z, r["variant"]
        assert "not compiled" not in r["notes"]


def test_sample_benchmark_rejects_bad_image_size(capsys):
    from benchmarks import sample_throughput
    with pytest.raises(SystemExit):
        sample_throughput.main(["--model", "DiT-debug", "--image_size", "60", "--device", "cpu"])
    assert "--image_size 60 must be a positive multiple of 8" in capsys.readouterr().err
