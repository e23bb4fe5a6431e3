"""The step-cache benchmark's smoke run (benchmarks/sample_accel.py), in-process: a DiT digits model trained a few
steps, sampled with no cache and with TeaCache from the same noise."""
import json
import math



def test_sample_accel_smoke(tmp_path, capsys, one_thread):
    from benchmarks import sample_accel
    out = tmp_path / "accel"
    [result] = sample_accel.main(["--demos", "digits", "--train_steps", "3", "--train_batch_size", "8",
                                  "--samples_per_class", "1", "--sampling_steps", "6", "--rows", "none",
                                  "teacache:0.1", "--out", str(out)])
    table = (out / "sample_accel.md").read_text()
    assert sample_accel.table(result).strip() in capsys.readouterr().out
    assert "| row | seconds | speed-up | skipped | PSNR vs none (dB) | classifier |" in table
    assert "threads" in table.splitlines()[0]  # the hardware the timings ran on
    none, tea = result["rows"]
    assert [none["row"], tea["row"]] == ["none", "teacache:0.1"]
    assert none["psnr_db"] == math.inf and none["skipped_share"] == 0 and none["speedup"] == 1.0
    assert "| none |" in table and "| 1.00x | 0.0% | inf |" in table
    assert tea["evaluations"] > 0 and 0 <= tea["skipped_share"] <= 1 and tea["counts"] == "block evaluations"
    assert tea["psnr_db"] > 0 and all(r["seconds"] > 0 and 0 <= r["classifier_accuracy"] <= 1 for r in (none, tea))
    saved = json.loads((out / "sample_accel.json").read_text())
    assert saved["demos"][0]["rows"][0]["psnr_db"] == math.inf and saved["hardware"] in table


def test_sample_accel_image_to_video_smoke(tmp_path, one_thread):
    """The Wan2.2 image-to-video demo: each sample gets a held-out clip's first frame (written beside the table) and
    caption, its wanted digit the caption's."""
    from benchmarks import sample_accel
    out = tmp_path / "accel"
    [result] = sample_accel.main(["--demos", "wan_i2v", "--train_steps", "2", "--train_batch_size", "4",
                                  "--samples_per_class", "1", "--sampling_steps", "3", "--rows", "none",
                                  "fbcache:0.2", "--out", str(out)])
    assert result["model"] == "Wan2.2-I2V-debug" and result["samples"] == 10
    assert len(list((out / "wan_i2v" / "first_frames").glob("*.png"))) == 10
    none, fb = result["rows"]
    assert none["psnr_db"] == math.inf and fb["evaluations"] > 0 and 0 <= fb["classifier_accuracy"] <= 1


def test_flux_cache_sampling_smoke(tmp_path):
    """benchmarks/flux_cache_sampling.py (gpu_check.sh's flux-dev row) on flux-debug on the CPU."""
    from tests.run_each import cli
    out = tmp_path / "flux_cache.md"
    cli("benchmarks/flux_cache_sampling.py", "--model", "flux-debug", "--image_size", "64", "--device", "cpu",
        "--steps", "6", "--out", out)
    lines = out.read_text().splitlines()
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| ") and "---" not in line]
    assert [r[0].strip() for r in rows[1:]] == ["none", "teacache", "fbcache"], rows
    assert rows[1][4].strip() == "1.00x" and rows[1][5].strip() == "0.0%"
    assert all(float(r[2]) > 0 and 0 <= float(r[5].strip(" %")) <= 100 for r in rows[1:])
