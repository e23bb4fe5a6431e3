"""FLUX.1 (native) beyond the conformance table (which trains flux-debug on the captioned digits through tiny local T5
and CLIP encoders from the command line, resumes it exactly and samples it): its loss falls and caption dropout uses
the empty caption; a cache from preprocess.py --family flux (tiny 16-channel VAE, T5 embeddings, CLIP vectors) trains
like encoding on the fly and loads no encoder; the plugins, sequence parallelism and the lean optimizer options run
flux-debug like the plain path; an official single file samples once its encoders are named."""
import json
import numpy as np
import pytest
import torch

from opendit import config as cfglib
from tests.distributed import run_distributed, train_each
from tests.run_each import cli, losses_of, run_here, sample_here
from tests.test_train import run_trainer, save_tiny_vae


def tiny_text_encoders(root, words="digits"):
    """(T5 folder, CLIP folder) under root: tiny random encoders with word-level tokenizers over `words` (the
    captioned digits' words, or "all")."""
    from opendit.encoders.tiny_clip import save_tiny_clip
    from opendit.families.flux.tiny_t5 import save_tiny_t5

    return save_tiny_t5(root / "t5", max_length=16), save_tiny_clip(root / "clip", words=words)


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    return tiny_text_encoders(tmp_path_factory.mktemp("flux_encoders"))


def flux_cfg(outputs, encoders, **kw):
    t5, clip = encoders
    base = dict(model="flux-debug", dataset="captioned_digits", image_size=8, t5=t5, clip=clip, batch_size=4,
                max_steps=3, log_every=1, ckpt_every=100, num_workers=0, outputs=str(outputs), lr=1e-3,
                ema_decay=0.9)
    return cfglib.TrainConfig(**{**base, **kw})


def test_loss_falls_and_text_dropout_uses_the_empty_caption(tmp_path, encoders):
    trainer, losses = run_trainer(flux_cfg(tmp_path, encoders, max_steps=30, log_every=10, lr=2e-3, batch_size=8))
    assert losses[-1] < 0.8 * losses[0], losses
    enc = trainer.encoders
    torch.manual_seed(0)
    _, cond = trainer.objective.prepare((torch.zeros(64, 1, 8, 8), ["a handwritten seven"] * 64), torch.device("cpu"))
    empty_txt, empty_vec = enc.empty_embeddings("cpu")
    full_txt, full_vec = enc.encode(["a handwritten seven"], "cpu")
    dropped_txt = torch.tensor([torch.equal(t, empty_txt) for t in cond["txt"]])
    dropped_vec = torch.tensor([torch.equal(v, empty_vec) for v in cond["y"]])
    assert all(torch.equal(t, full_txt[0]) for t, d in zip(cond["txt"], dropped_txt) if not d)
    assert all(torch.equal(v, full_vec[0]) for v, d in zip(cond["y"], dropped_vec) if not d)
    # p = 0.447 each, independently: both dropped ~20%, and the two draws differ
    assert 0.2 < dropped_txt.float().mean() < 0.7 and 0.2 < dropped_vec.float().mean() < 0.7
    assert not torch.equal(dropped_txt, dropped_vec)


def test_a_missing_text_encoder_is_a_clear_error(tmp_path, encoders):
    with pytest.raises(ValueError, match="--t5"):
        run_trainer(flux_cfg(tmp_path, encoders, t5="none"))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere")):
        run_trainer(flux_cfg(tmp_path, encoders, clip=str(tmp_path / "nowhere")))


def test_cached_latents_and_embeddings_train_like_on_the_fly(tmp_path, encoders):
    t5, clip = encoders
    vae = save_tiny_vae(tmp_path / "vae", latent_channels=16)  # FLUX's 16 latent channels
    run_here("preprocess.py", "--family", "flux", "--model", "flux-debug", "--dataset", "captioned_digits",
        "--image_size", "32", "--vae", vae, "--t5", t5, "--clip", clip, "--out", tmp_path / "cache",
        "--batch_size", "256", "--num_workers", "0")
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert manifest["latent_shape"] == [16, 4, 4] and manifest["embeddings"] == ["t5", "clip"]
    assert manifest["t5_max_length"] == 16 and manifest["extras"] == ["empty_clip", "empty_t5"]
    common = dict(image_size=32, max_steps=3)
    cached, fly = tmp_path / "c", tmp_path / "f"
    trainer, _ = run_trainer(flux_cfg(cached, ("none", "none"), dataset="latents", data_path=str(tmp_path / "cache"),
                                      **common))
    enc = trainer.encoders
    assert enc.vae is None and enc.t5 is None and enc.clip is None  # training on the cache loads no encoder
    assert trainer.cfg.t5 == t5 and trainer.cfg.clip == clip and trainer.cfg.vae == vae  # for sampling later
    run_trainer(flux_cfg(fly, encoders, vae=vae, **common))
    np.testing.assert_allclose(losses_of(cached / "000-flux-debug"), losses_of(fly / "000-flux-debug"), rtol=1e-5)


@pytest.mark.parametrize("kw", [
    dict(grad_checkpoint=1),
    dict(optimizer_offload=True, optimizer_state_dtype="u16", master_weights="bf16_exact", mixed_precision="bf16",
         fused_backward=True),
    dict(optimizer="adan", optimizer_state_dtype="f24", fused_backward=True),
    dict(optimizer_offload=True, fused_backward=True, blocks_to_swap=3),  # both single blocks and a double one
], ids=["grad_checkpoint", "u16-offload-bf16_exact-fused", "adan-f24-fused", "fused-block_swap"])
def test_lean_options_run_flux_and_resume_exactly(tmp_path, encoders, kw):
    _, plain = run_trainer(flux_cfg(tmp_path / "p", encoders, max_steps=4))
    _, full = run_trainer(flux_cfg(tmp_path / "a", encoders, max_steps=4, ckpt_every=2, **kw))
    run_trainer(flux_cfg(tmp_path / "b", encoders, max_steps=2, ckpt_every=2, **kw))
    _, resumed = run_trainer(flux_cfg(tmp_path / "b", encoders, max_steps=4, ckpt_every=2, load="latest", **kw))
    assert resumed == full[2:]
    if {"mixed_precision", "optimizer", "optimizer_state_dtype"} & kw.keys():
        # bf16 weights, compressed states or another optimizer: close to plain AdamW in fp32, not equal
        assert full == pytest.approx(plain, rel=0.05)
    else:  # the same arithmetic, rearranged (checkpointed, offloaded, fused, swapped)
        assert full == pytest.approx(plain, rel=1e-5)


def test_flux_dev_flops_per_sample_from_its_layers():
    from opendit.families.flux.model import FLUX_CONFIGS, Flux
    from opendit.families.flux.family import flux_forward_macs

    with torch.device("meta"):
        model = Flux(**FLUX_CONFIGS["flux-dev"])
    txt, img = 512, 4096  # a 1024^2 image: 128x128 latents in 2x2 patches
    D, L = 3072, txt + img
    double = 12 * D * D * (img + txt) + 2 * 6 * D * D  # per stream: qkv 3D^2, proj D^2, MLP 8D^2; two modulations
    single = 12 * D * D * L + 3 * D * D  # linear1 (3D + 4D) x D and linear2 (D + 4D) x D per token; modulation
    root = img * 64 * D + txt * 4096 * D + (256 + 768 + 256) * D + 3 * D * D + 2 * D * D + img * D * 64
    expected = 19 * double + 38 * single + root + 57 * 2 * L * L * D  # + QK^T and AV of every joint attention
    assert flux_forward_macs(model, txt, img) == expected


@pytest.mark.slow
def test_two_process_runs_equal_ddp(tmp_path, encoders):
    """zero2, fsdp, hsdp and gemini at 2 ranks equal 2-rank ddp; sequence parallelism at 2 ranks (both ranks see the
    same 4 samples) equals one process. The whole matrix runs in one spawned group."""
    names = ["ddp", "zero2", "fsdp", "hsdp", "gemini", "sp2"]
    flags = [{}, dict(plugin="zero2"), dict(plugin="fsdp"), dict(plugin="hsdp", dp_replicate=2), dict(plugin="gemini"),
             dict(sequence_parallel_size=2)]
    cases = [flux_cfg(tmp_path / n, encoders, **kw) for n, kw in zip(names, flags)]
    losses = dict(zip(names, run_distributed(train_each, 2, cases)[0]))
    _, one = run_trainer(flux_cfg(tmp_path / "one", encoders))
    for name in names[1:-1]:
        np.testing.assert_allclose(losses[name], losses["ddp"], rtol=1e-4, err_msg=name)
    np.testing.assert_allclose(losses["sp2"], one, rtol=1e-4)


@pytest.mark.slow
def test_two_process_sampling_writes_what_one_process_does(tmp_path, encoders):
    run_trainer(flux_cfg(tmp_path, encoders, max_steps=1))
    common = ["--ckpt", "latest", "--outputs", tmp_path, "--prompts", "a one", "a two", "a three", "--num_samples", "5",
              "--batch_size", "2", "--num_sampling_steps", "3", "--npz"]
    sample_here(*common, "--out", tmp_path / "one")
    cli("sample.py", *common, "--out", tmp_path / "two", nproc=2)
    one, two = (np.load(tmp_path / d / "samples.npz")["arr_0"] for d in ("one", "two"))
    np.testing.assert_array_equal(one, two)


def test_sample_defaults_follow_the_model():
    from opendit.families import get_family
    from opendit.inference import complete_sample_config

    family = get_family("flux")
    sample_cfg = cfglib.SampleConfig()
    for model, steps in (("flux-schnell", 4), ("flux-dev", 50)):
        resolved = complete_sample_config(family, sample_cfg, cfglib.TrainConfig(model=model))
        assert (resolved.sampler, resolved.num_sampling_steps, resolved.cfg_scale) == ("euler", steps, 1.0)
    dit = complete_sample_config(get_family("dit"), sample_cfg, cfglib.TrainConfig(model="DiT-XL/2"))
    assert (dit.sampler, dit.num_sampling_steps, dit.cfg_scale) == ("ddpm", 250, 4.0)
    given = complete_sample_config(family, cfglib.SampleConfig(num_sampling_steps=7, cfg_scale=3.0),
                                   cfglib.TrainConfig(model="flux-schnell"))
    assert (given.num_sampling_steps, given.cfg_scale) == (7, 3.0)  # a flag given is kept
    with pytest.raises(ValueError, match="--sampler ddim does not apply to flux-schnell; use one of euler"):
        complete_sample_config(family, cfglib.SampleConfig(sampler="ddim"), cfglib.TrainConfig(model="flux-schnell"))


def test_memory_accounting_and_lean_step_benchmarks_run_on_cpu(tmp_path):
    out = tmp_path / "memory.md"
    cli("benchmarks/flux_memory.py", "--model", "flux-schnell", "--image_size", "512", "--t5_tokens", "256",
        "--out", out)
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "GPU total" not in line]
    gpu = [float(r.split("|")[-3].strip().strip("*")) for r in rows]
    assert len(rows) == 8 and gpu[0] > gpu[1] > gpu[2] == gpu[3] > gpu[4]  # each option set needs less GPU memory
    assert gpu[4] <= 16 * 2 ** 30 / 1e9
    assert gpu[5] > gpu[6] > gpu[7] and gpu[6] < gpu[1]  # LoRA: checkpointing, then an fp8 base, save more
    cli("benchmarks/flux_lean_step.py", "--model", "flux-debug", "--image_size", "64", "--t5_tokens", "16",
        "--device", "cpu", "--steps", "2", "--blocks_to_swap", "1", "--work", tmp_path / "lean",
        "--out", tmp_path / "lean.md")
    last = (tmp_path / "lean.md").read_text().splitlines()[-1].split("|")
    assert np.isfinite(float(last[7]))  # the step ran and its loss is a number


def test_a_bare_official_layout_file_samples_once_its_encoders_are_named(tmp_path, encoders):
    """A .safetensors with FLUX's keys and no opendit config (as flux1-dev.safetensors) names its model from the
    keys; the encoders must come from flags."""
    import sys

    from safetensors.torch import save_file

    from tests.test_train import ROOT

    trainer, _ = run_trainer(flux_cfg(tmp_path, encoders, max_steps=1))
    state = trainer.booster.unwrap(trainer.model).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "flux1-debug.safetensors"))
    sys.path.insert(0, str(ROOT))
    import sample

    t5, clip = encoders
    base = dict(ckpt=str(tmp_path / "flux1-debug.safetensors"), image_size=8, in_channels=1, prompts=["a one"],
                num_sampling_steps=2, npz=True)
    with pytest.raises(ValueError, match="--vae --t5 --clip"):
        sample.main(cfglib.SampleConfig(**base, out=str(tmp_path / "x")))
    sample.main(cfglib.SampleConfig(**base, vae="none", t5=t5, clip=clip, out=str(tmp_path / "s")))
    assert np.load(tmp_path / "s" / "samples.npz")["arr_0"].shape == (1, 8, 8, 3)
