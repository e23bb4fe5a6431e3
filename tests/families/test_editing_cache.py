"""Latent caches of editing pairs: preprocess.py stores each pair's target posterior, its controls' posterior means
and its instruction's conditions; training on the cache gives the loss of training on the pairs for the same batch
(FLUX.1 Kontext in pixel space on the edit-digits demo; FLUX.2 [klein] through a tiny VAE on a folder of pairs with two
controls each), runs and resumes from the command line; a cache is refused with another control folder or text encoder
(training, and preprocess.py --skip_existing), and pairs with --flip_both."""
import json

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from opendit import config as cfglib
from opendit.data import EditDigitsDataset
from opendit.data.latent_shards import open_cache
from opendit.families import FAMILIES
from tests.families.test_editing import MODEL, options, qwen3, text_encoder, write_pairs  # noqa: F401  (qwen3, text_encoder: module fixtures)
from tests.run_each import losses_of, run_here
from tests.test_train import run_trainer

CPU = torch.device("cpu")


def _prepared(family: str, run: dict, rows: list[int]):
    """(x, cond, per-sample losses) of the batch of items `rows` of the run's data, the model's weights and the RNG
    seeded alike (caption dropout at p = 0.5 drawn from it), t and the noise given."""
    fam = FAMILIES[family]
    cfg = fam.resolve_config(cfglib.TrainConfig(**run, caption_dropout_prob=0.5, outputs="unused"))
    enc = fam.load_encoders(cfg, CPU, training=True)
    data, cfg = fam.load_data(cfg, enc)
    torch.manual_seed(0)
    model = fam.build_model(cfg, fam.latent_shape(cfg, enc, data)).eval()
    objective = fam.objective(cfg, enc)
    batch = default_collate([data[i] for i in rows])
    torch.manual_seed(1)
    with torch.no_grad():
        x, cond = objective.prepare(batch, CPU, train=True)
        t = torch.linspace(0.1, 0.9, len(rows))
        losses, _ = objective.losses(model, x, cond, t_frac=t, noise=torch.randn(x.shape, generator=torch.Generator()
                                                                                .manual_seed(2)))
    return x, cond, losses


def test_a_kontext_pixel_cache_of_the_edit_digits_trains_as_the_pairs_bitwise(tmp_path, text_encoder, one_thread):  # noqa: F811
    """Pixel space: the cache holds the targets' and controls' pixels; the same batch gives the pairs' inputs,
    references and losses bitwise, and a run on the cache logs the losses of a run on the pairs (the text encoder
    encodes batches of 4 while caching, as the runs do)."""
    cache = tmp_path / "cache"
    run_here("preprocess.py", "--family", "flux1", "--model", MODEL, "--dataset", "edit_digits", "--image_size", "16",
             "--vae", "none", "--text_encoder", text_encoder, "--out", cache, "--batch_size", "4",
             "--num_workers", "0")
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["embeddings"] == ["cond_embeds", "cond_pooled", "control_mean"]
    n = len(EditDigitsDataset(16, split="train"))
    assert manifest["controls_per_target"] == 1 and manifest["count"] == n
    assert manifest["vae"] == "none" and manifest["latent_shape"] == [1, 16, 16]

    on_cache = cfglib.TrainConfig(**options(text_encoder, dataset="latents", data_path=str(cache)), outputs="unused")
    assert FAMILIES["flux1"].trains_on_pairs(on_cache)  # a model's branch for references trains (FLUX.3's)

    rows = [0, 3, n // 2, n - 1]
    pairs = _prepared("flux1", options(text_encoder), rows)
    cached = _prepared("flux1", options(text_encoder, dataset="latents", data_path=str(cache)), rows)
    assert torch.equal(pairs[0], cached[0]) and pairs[1].keys() == cached[1].keys()
    assert all(torch.equal(pairs[1][k], cached[1][k]) for k in pairs[1])
    assert torch.equal(pairs[2], cached[2])

    run = options(text_encoder, max_steps=3, caption_dropout_prob=0.5)
    run_trainer(cfglib.TrainConfig(**run, outputs=str(tmp_path / "pairs")))
    run_trainer(cfglib.TrainConfig(**{**run, "dataset": "latents", "data_path": str(cache)},
                                   outputs=str(tmp_path / "cached")))
    assert losses_of(next((tmp_path / "cached").glob("000-*"))) == losses_of(next((tmp_path / "pairs").glob("000-*")))


def test_a_flux2_cache_of_pairs_through_a_vae_trains_as_the_pairs_and_resumes(tmp_path, qwen3, one_thread):  # noqa: F811
    """Through a tiny AutoencoderKLFlux2: the same batch gives the pairs' losses to fp32 rounding (the VAE encodes
    other batches while caching); a tar-shard cache holds the same items; train.py on the cache runs (its preview
    too) and resumes exactly; the cache records its control folder and is refused with another one or another text
    encoder."""
    from tests.test_flux2_family import save_tiny_flux2_vae
    targets, controls = write_pairs(tmp_path)
    vae, cache = save_tiny_flux2_vae(tmp_path / "vae"), tmp_path / "cache"
    run_here("preprocess.py", "--family", "flux2", "--model", "flux2-klein-debug", "--dataset", "edit_pairs",
             "--data_path", targets, "--control_directory", controls, "--image_size", "16", "--vae", vae,
             "--text_encoder", qwen3, "--out", cache, "--batch_size", "3", "--num_workers", "0")
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["embeddings"] == ["cond_embeds", "control_mean"] and manifest["controls_per_target"] == 2
    assert manifest["source"]["control_directory"] == controls and manifest["text_encoder"] == qwen3
    run_here("preprocess.py", "--family", "flux2", "--model", "flux2-klein-debug", "--dataset", "edit_pairs",
             "--data_path", targets, "--control_directory", controls, "--image_size", "16", "--vae", vae,
             "--text_encoder", qwen3, "--out", tmp_path / "tars", "--cache_format", "webdataset", "--num_workers", "0")
    npy, tars = open_cache(str(cache)), open_cache(str(tmp_path / "tars"))
    assert type(tars).__name__ == "LatentStream" and tars[5][-1].shape == (2, *manifest["latent_shape"])  # control_mean
    for a, b in zip([*npy[5][0], *npy[5][3:]], [*tars[5][0], *tars[5][3:]]):  # VAE batches of 3 and of 64
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    pair_run = options(qwen3, model="flux2-klein-debug", dataset="edit_pairs", data_path=targets,
                       control_directory=controls, vae=vae)
    cache_run = options(qwen3, model="flux2-klein-debug", dataset="latents", data_path=str(cache))
    rows = [1, 4, 6, 7]
    pairs, cached = _prepared("flux2", pair_run, rows), _prepared("flux2", cache_run, rows)
    assert pairs[1].keys() == cached[1].keys() and pairs[1]["references"].shape[1] == 2
    for a, b in [(pairs[0], cached[0]), *((pairs[1][k], cached[1][k]) for k in pairs[1]), (pairs[2], cached[2])]:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    args = [a for k, v in cache_run.items() for a in (f"--{k}", str(v))]
    run_here("train.py", *args, "--max_steps", "2", "--ckpt_every", "2", "--sample_every", "2", "--outputs",
             tmp_path / "cli")
    _, full = run_trainer(cfglib.TrainConfig(**cache_run, max_steps=4, ckpt_every=2, outputs=str(tmp_path / "a")))
    _, resumed = run_trainer(cfglib.TrainConfig(**cache_run, max_steps=4, ckpt_every=2, load="latest",
                                                outputs=str(tmp_path / "cli")))
    assert resumed == full[2:] and all(np.isfinite(full))
    assert list((tmp_path / "cli").glob("000-*/previews/*"))  # the preview, its prompts from the cache

    fam = FAMILIES["flux2"]
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ValueError, match="--control_directory .* holds the controls of"):
        cfg = fam.resolve_config(cfglib.TrainConfig(**cache_run, control_directory=str(other), outputs="unused"))
        fam.load_data(cfg, fam.load_encoders(cfg, CPU, training=True))
    with pytest.raises(ValueError, match="--text_encoder .* disagrees with the latent cache"):
        fam.resolve_config(cfglib.TrainConfig(**{**cache_run, "text_encoder": str(other)}, outputs="unused"))


def test_an_interrupted_cache_of_pairs_resumes_only_with_its_controls_and_text_encoder(tmp_path):
    """preprocess.py --skip_existing keeps an interrupted cache's finished shards only for the same settings: its
    control folder and the family's cache keys (the text encoder) among them."""
    from preprocess import _resume_partial
    keys = FAMILIES["flux2"].cache_keys

    def config(**changed):
        given = dict(family="flux2", model="flux2-klein-debug", dataset="edit_pairs", data_path="t",
                     control_directory="c", text_encoder="q", out="o")
        return cfglib.for_family(cfglib.PreprocessConfig(**{**given, **changed}))
    _resume_partial(str(tmp_path), config(), keys)
    _resume_partial(str(tmp_path), config(), keys)  # the same settings: kept
    for key in ("control_directory", "text_encoder"):
        with pytest.raises(ValueError, match=f"written with {key}="):
            _resume_partial(str(tmp_path), config(**{key: "other"}), keys)


def test_pairs_are_not_cached_flipped(tmp_path, text_encoder):  # noqa: F811
    from opendit.distributed import cleanup
    from preprocess import main
    try:
        with pytest.raises(ValueError, match="--flip_both: a latent cache of editing pairs"):
            main(["--family", "flux1", "--model", MODEL, "--dataset", "edit_digits", "--image_size", "16", "--vae",
                  "none", "--text_encoder", text_encoder, "--out", str(tmp_path / "c"), "--flip_both", "true"])
    finally:
        cleanup()
