"""opendit.eval: FID / IS / precision-recall / CLIP score math on synthetic sets, the CLI end to end with a small
injected feature extractor, the real Inception architecture with random weights (no download), and one-line
errors (a missing weights file: exit status 2)."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import torch
from PIL import Image

from opendit.eval import cli, data, features, metrics

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- the math
def closed_form_fid(mu1, s1, mu2, s2):
    """||mu1-mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^1/2) with scipy's sqrtm: independent of opendit's eigen form."""
    covmean = scipy.linalg.sqrtm(s1 @ s2)
    return float(np.sum((mu1 - mu2) ** 2) + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean.real))


def test_fid_of_identical_sets_is_zero():
    feats = np.random.default_rng(0).normal(size=(300, 24))
    mu, sigma = metrics.feature_stats(feats)
    assert abs(metrics.frechet_distance(mu, sigma, mu, sigma)) < 1e-8
    few = feats[:10]  # fewer samples than dimensions: a singular covariance (sqrtm would need an eps offset)
    assert abs(metrics.frechet_distance(*metrics.feature_stats(few), *metrics.feature_stats(few))) < 1e-6


def test_fid_equals_the_closed_form_for_known_gaussians():
    rng = np.random.default_rng(1)
    d = 16
    a, b = rng.normal(size=(d, d)), rng.normal(size=(d, d))
    s1, s2 = a @ a.T / d + 0.1 * np.eye(d), b @ b.T / d + 0.2 * np.eye(d)
    mu1, mu2 = rng.normal(size=d), rng.normal(size=d) + 0.5
    assert metrics.frechet_distance(mu1, s1, mu2, s2) == pytest.approx(closed_form_fid(mu1, s1, mu2, s2), rel=1e-9)
    # diagonal covariances commute: FID = ||dmu||^2 + sum (sqrt(a_i) - sqrt(b_i))^2 exactly
    va, vb = rng.uniform(0.5, 2, d), rng.uniform(0.5, 2, d)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(va) - np.sqrt(vb)) ** 2)
    assert metrics.frechet_distance(mu1, np.diag(va), mu2, np.diag(vb)) == pytest.approx(expected, rel=1e-10)
    # from features drawn from the two Gaussians: the empirical statistics' FID, against scipy on the same statistics
    x = rng.multivariate_normal(mu1, s1, size=4000)
    y = rng.multivariate_normal(mu2, s2, size=4000)
    (m1, c1), (m2, c2) = metrics.feature_stats(x), metrics.feature_stats(y)
    assert metrics.frechet_distance(m1, c1, m2, c2) == pytest.approx(closed_form_fid(m1, c1, m2, c2), rel=1e-8)
    assert metrics.frechet_distance(m1, c1, m2, c2) == pytest.approx(closed_form_fid(mu1, s1, mu2, s2), rel=0.1)
    with pytest.raises(ValueError, match="different shapes"):
        metrics.frechet_distance(mu1, s1, mu2[:4], s2[:4, :4])


def test_inception_score():
    mean, std = metrics.inception_score(np.zeros((100, 1008)), splits=10)  # uniform p(y|x) = p(y): KL 0
    assert mean == pytest.approx(1.0, abs=1e-12) and std == pytest.approx(0.0, abs=1e-12)
    logits = 50.0 * np.eye(10)[np.arange(200) % 10]  # confident and evenly spread over 10 classes in each split
    mean, _ = metrics.inception_score(logits, splits=10)
    assert mean == pytest.approx(10.0, rel=1e-6)
    with pytest.raises(ValueError, match="splits"):
        metrics.inception_score(np.zeros((5, 10)), splits=10)


def test_precision_recall():
    rng = np.random.default_rng(2)
    real = rng.normal(size=(200, 8))
    assert metrics.precision_recall(real, real.copy(), k=3) == (1.0, 1.0)
    far = rng.normal(size=(150, 8)) + 1000.0
    assert metrics.precision_recall(real, far, k=3) == (0.0, 0.0)
    half = np.concatenate([real[:100], far[:100]])  # half the fakes on the real manifold, half of it covered
    precision, recall = metrics.precision_recall(real, half, k=3)
    assert precision == 0.5 and 0.4 < recall < 1.0


# ------------------------------------------------------------------------------------ data and the CLI
class TinyExtractor(torch.nn.Module):
    """A small random network standing in for Inception: uint8 [B, 3, H, W] -> (pool [B, 32], logits [B, 10])."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.fc = torch.nn.Linear(48, 32), torch.nn.Linear(32, 10)

    def forward(self, x):
        pool = torch.tanh(self.proj(torch.nn.functional.adaptive_avg_pool2d(x.float() / 255, 4).flatten(1)))
        return pool, self.fc(pool)


def images(n, seed, size=16, shift=0):
    return np.random.default_rng(seed).integers(shift, 256 - 64 + shift, size=(n, size, size, 3), dtype=np.uint8)


def run_cli(*argv, extractor=None):
    return cli.main([str(a) for a in argv], extractor=extractor or TinyExtractor(), label="tiny")


def test_npz_streamed_in_batches(tmp_path):
    video = np.random.default_rng(3).integers(0, 256, size=(5, 3, 8, 8, 1), dtype=np.uint8)
    for save in (np.savez, np.savez_compressed):
        save(tmp_path / "v.npz", video)
        found = data.open_images(tmp_path / "v.npz")
        assert (found.count, found.frames, found.num_samples) == (15, 3, 5)
        frames = np.concatenate(list(found.batches(4)))  # 4 frames a batch -> 1 clip at a time
        np.testing.assert_array_equal(frames, np.repeat(video.reshape(15, 8, 8, 1), 3, axis=-1))
    np.savez(tmp_path / "bad.npz", arr_0=np.zeros((2, 8, 8, 3), np.float32))
    with pytest.raises(data.UserError, match="expected uint8"):
        data.open_images(tmp_path / "bad.npz")


def test_cli_all_metrics_end_to_end(tmp_path, capsys):
    samples, ref = images(40, 0), images(40, 1, shift=64)
    np.savez(tmp_path / "samples.npz", samples)  # arr_0, as sample.py --npz writes it
    np.savez(tmp_path / "ref.npz", arr_0=ref)
    (tmp_path / "ref_folder").mkdir()
    for i, im in enumerate(ref):
        Image.fromarray(im).save(tmp_path / "ref_folder" / f"{i:03d}.png")
    results = run_cli("all", "--samples", tmp_path / "samples.npz", "--ref", tmp_path / "ref.npz",
                      "--inception_weights", "unused.pth", "--batch_size", 7, "--splits", 4)
    line = capsys.readouterr().out.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("FID ") and "precision" in line[0]
    written = json.loads((tmp_path / "samples.eval.json").read_text())
    assert written == json.loads(json.dumps(results))
    assert written["num_samples"] == 40 and written["fid"]["value"] > 0
    assert 0 <= written["precision_recall"]["precision"] <= 1 and written["inception_score"]["value"] >= 1

    # the same reference as a folder of PNGs: the same FID; against itself: 0, precision = recall = 1
    # (the same batch size: on several threads a convolution's float32 rounding depends on the batch)
    folder = run_cli("fid", "--samples", tmp_path / "samples.npz", "--ref", tmp_path / "ref_folder",
                     "--inception_weights", "unused.pth", "--batch_size", 7, "--out", tmp_path / "f.json")
    assert folder["fid"]["value"] == pytest.approx(results["fid"]["value"], rel=1e-9)
    same = run_cli("all", "--samples", tmp_path / "samples.npz", "--ref", tmp_path / "samples.npz",
                   "--inception_weights", "unused.pth", "--out", tmp_path / "same.json")
    assert abs(same["fid"]["value"]) < 1e-6
    assert (same["precision_recall"]["precision"], same["precision_recall"]["recall"]) == (1.0, 1.0)

    # the JSON next to the samples accumulates: a later metric keeps the earlier ones
    run_cli("is", "--samples", tmp_path / "samples.npz", "--inception_weights", "unused.pth", "--splits", 2)
    merged = json.loads((tmp_path / "samples.eval.json").read_text())
    assert merged["inception_score"]["splits"] == 2 and "fid" in merged and "precision_recall" in merged


def test_reference_statistics_adm_layout(tmp_path, capsys):
    """--ref with mu/sigma (ADM's reference batches; what `stats` writes) gives FID from them; arr_0 beside them
    serves precision/recall; mu/sigma alone cannot."""
    samples, ref = images(30, 0), images(30, 1, shift=64)
    np.savez(tmp_path / "samples.npz", samples)
    np.savez(tmp_path / "ref.npz", ref)
    run_cli("stats", "--images", tmp_path / "ref.npz", "--inception_weights", "unused.pth", "--out",
            tmp_path / "stats.npz")
    with np.load(tmp_path / "stats.npz") as stats:
        mu, sigma = stats["mu"], stats["sigma"]
    from_images = run_cli("fid", "--samples", tmp_path / "samples.npz", "--ref", tmp_path / "ref.npz",
                          "--inception_weights", "unused.pth")
    from_stats = run_cli("fid", "--samples", tmp_path / "samples.npz", "--ref", tmp_path / "stats.npz",
                         "--inception_weights", "unused.pth")
    assert from_stats["fid"]["value"] == pytest.approx(from_images["fid"]["value"], rel=1e-9)
    assert from_stats["fid"]["ref_statistics"] == "mu/sigma stored in the file"
    # ADM's layout: arr_0 and mu/sigma. FID uses the stored statistics (here deliberately not arr_0's)
    np.savez(tmp_path / "adm.npz", arr_0=samples, mu=mu, sigma=sigma, mu_s=mu[:4], sigma_s=sigma[:4, :4])
    adm = run_cli("all", "--samples", tmp_path / "samples.npz", "--ref", tmp_path / "adm.npz",
                  "--inception_weights", "unused.pth", "--splits", 3)
    assert adm["fid"]["value"] == pytest.approx(from_images["fid"]["value"], rel=1e-9)
    assert adm["precision_recall"]["precision"] == 1.0  # arr_0 == the samples
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        run_cli("pr", "--samples", tmp_path / "samples.npz", "--ref", tmp_path / "stats.npz",
                "--inception_weights", "unused.pth")
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "only mu/sigma" in err[0]


def test_video_samples_are_scored_per_frame(tmp_path):
    clips = np.stack([images(4, seed) for seed in range(10)])  # [10 clips, 4 frames, 16, 16, 3]
    np.savez(tmp_path / "samples.npz", clips)
    result = run_cli("all", "--samples", tmp_path / "samples.npz", "--ref", tmp_path / "samples.npz",
                     "--inception_weights", "unused.pth", "--splits", 4)
    assert (result["num_samples"], result["num_images"], result["frames_per_sample"]) == (10, 40, 4)
    assert abs(result["fid"]["value"]) < 1e-6


def test_missing_weights_is_one_line_and_exit_2(tmp_path):
    np.savez(tmp_path / "samples.npz", images(4, 0))
    proc = subprocess.run([sys.executable, "-m", "opendit.eval", "fid", "--samples", tmp_path / "samples.npz",
                           "--ref", tmp_path / "samples.npz", "--inception_weights", tmp_path / "nope.pth"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: Inception weights not found") and str(tmp_path / "nope.pth") in lines[0]
    assert features.WEIGHTS_URL in lines[0] and features.WEIGHTS_FILE in lines[0]
    assert not (tmp_path / "samples.eval.json").exists()


def test_wrong_weights_files_are_refused(tmp_path):
    torch.save({"conv.weight": torch.zeros(2)}, tmp_path / "other.pth")
    with pytest.raises(data.UserError, match="not the FID Inception"):
        features.read_weights(tmp_path / "other.pth")

    class Payload:  # a pickle that would run code: weights_only=True refuses it
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"fc.weight": Payload()}, tmp_path / "evil.pth")
    with pytest.raises(data.UserError, match="not a readable PyTorch state dict"):
        features.read_weights(tmp_path / "evil.pth")


@pytest.fixture(scope="module")
def inception_weights(tmp_path_factory):
    return features.random_inception_weights(tmp_path_factory.mktemp("inception") / "random_inception.pth")


def test_real_inception_architecture_with_random_weights(tmp_path, inception_weights):
    """The FID Inception (torch-fidelity's TF port) built with random weights, saved to a local file and loaded
    through --inception_weights: the code path of real weights, with 2048-d pool features and 1008 logits."""
    net, label = features.load_inception(inception_weights, backend="copy")
    pool, logits = net(torch.from_numpy(images(2, 5, size=32)).permute(0, 3, 1, 2))
    assert pool.shape == (2, 2048) and logits.shape == (2, 1008) and torch.isfinite(pool).all()
    np.savez(tmp_path / "samples.npz", images(6, 0, size=32))
    result = cli.main(["all", "--samples", str(tmp_path / "samples.npz"), "--ref", str(tmp_path / "samples.npz"),
                       "--inception_weights", str(inception_weights), "--splits", "2", "--batch_size", "6"])
    assert abs(result["fid"]["value"]) < 1e-3 and result["precision_recall"]["precision"] == 1.0
    assert "torch-fidelity" in result["fid"]["feature_extractor"]


def test_torch_fidelity_matches_the_copy(inception_weights):
    """Where torch-fidelity is installed, its Inception (loaded without its package __init__, which imports
    torchvision) gives the same features as opendit's copy, and leaves no placeholder package behind."""
    import importlib.util

    if importlib.util.find_spec("torch_fidelity") is None:
        pytest.skip("torch-fidelity is not installed (opendit uses its copy)")
    library, label = features.load_inception(inception_weights, backend="torch-fidelity")
    copy, _ = features.load_inception(inception_weights, backend="copy")
    assert label.startswith("torch-fidelity ") and type(library).__module__.startswith("torch_fidelity.")
    x = torch.from_numpy(images(2, 6, size=40)).permute(0, 3, 1, 2)
    for a, b in zip(library(x), copy(x)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert "torch_fidelity" not in sys.modules or hasattr(sys.modules["torch_fidelity"], "__version__")


# ------------------------------------------------------------------------------------------ CLIP score
def save_tiny_full_clip(folder):
    """A tiny random CLIPModel (image and text towers) with the project's tiny word-level tokenizer."""
    from transformers import AutoTokenizer, CLIPConfig, CLIPModel

    from opendit.encoders.tiny_clip import save_tiny_clip

    save_tiny_clip(folder, words=["a", "red", "blue", "square", "circle"])
    vocab = len(AutoTokenizer.from_pretrained(folder))
    config = CLIPConfig(
        text_config=dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16, pad_token_id=0, bos_token_id=2,
                         eos_token_id=3),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2),
        projection_dim=16)
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(folder)  # replaces the text-only model and config save_tiny_clip wrote
    return folder


def test_clip_score_tiny_random_clip(tmp_path, capsys):
    clip = save_tiny_full_clip(tmp_path / "clip")
    np.savez(tmp_path / "samples.npz", images(6, 0, size=40))
    argv = ["clip_score", "--samples", str(tmp_path / "samples.npz"), "--clip", str(clip), "--prompts",
            "a red square", "a blue circle", "--batch_size", "4"]
    first, second = cli.main(argv), cli.main(argv)
    value = first["clip_score"]["value"]
    assert 0 <= value <= 100 and value == second["clip_score"]["value"]
    assert first["clip_score"]["num_images"] == 6
    assert capsys.readouterr().out.startswith("CLIP score ")

    # the same by hand: prompt i % 2 for sample i, 100 * max(cos, 0) averaged
    from opendit.eval.clip_score import load_clip
    model, tokenizer, processor = load_clip(clip)
    with torch.no_grad():
        pixels = processor(images=list(images(6, 0, size=40)), return_tensors="pt")["pixel_values"]
        tokens = tokenizer(["a red square", "a blue circle"] * 3, padding=True, return_tensors="pt")
        img = model.get_image_features(pixel_values=pixels)
        txt = model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
    img, txt = (t if torch.is_tensor(t) else t.pooler_output for t in (img, txt))
    cos = torch.nn.functional.cosine_similarity(img.double(), txt.double(), dim=-1)
    assert value == pytest.approx(float((100 * cos).clamp(min=0).mean()), rel=1e-6)

    with pytest.raises(SystemExit) as exit_:  # a text encoder alone (what tiny_clip writes) cannot score images
        from opendit.encoders.tiny_clip import save_tiny_clip
        cli.main(["clip_score", "--samples", str(tmp_path / "samples.npz"), "--prompts", "a",
                  "--clip", save_tiny_clip(tmp_path / "text_only")])
    assert exit_.value.code == 2 and "full CLIPModel" in capsys.readouterr().err
