"""FLUX.1 through diffusers' own FluxTransformer2DModel (the diffusers kind, opendit.families.wrapped.flux1) beside
opendit's native FLUX family: the same weights (converted by FLUX_WEIGHTS) and the same batch give the same prompt
conditions (the pipeline's encode_prompt against opendit's T5 / CLIP encoders) and equal losses;
benchmarks/vs_diffusers.py (opendit against diffusers) runs."""
import os

import pytest
import torch

from opendit import config as cfglib
from tests.families.test_flux import flux_cfg, tiny_text_encoders


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """(T5, CLIP, a FLUX.1 pipeline folder holding both: text_encoder/ + tokenizer/ CLIP, text_encoder_2/ +
    tokenizer_2/ T5)."""
    root = tmp_path_factory.mktemp("flux1_encoders")
    t5, clip = tiny_text_encoders(root)
    pipe = root / "pipe"
    pipe.mkdir()
    for name, target in (("text_encoder", clip), ("tokenizer", clip), ("text_encoder_2", t5), ("tokenizer_2", t5)):
        os.symlink(target, pipe / name)
    return t5, clip, str(pipe)


def wrapped_cfg(outputs, pipe, **kw):
    base = dict(model="flux1-debug-diffusers", dataset="captioned_digits", image_size=8, vae="none",
                text_encoder=pipe, batch_size=4, max_steps=3, log_every=1, ckpt_every=100, num_workers=0,
                outputs=str(outputs), lr=1e-3, ema_decay=0.9)
    return cfglib.TrainConfig(**{**base, **kw})


def test_same_weights_and_batch_give_the_native_familys_conditions_and_losses(encoders):
    from opendit.families import get_family
    from opendit.families.flux.weights import FLUX_WEIGHTS
    from opendit.families.wrapped.flux1 import patchify

    t5, clip, pipe = encoders
    cpu = torch.device("cpu")
    native, wrapped = get_family("flux"), get_family("flux1")
    cfg_n = native.resolve_config(flux_cfg("unused", (t5, clip), image_size=16))
    cfg_w = wrapped.resolve_config(wrapped_cfg("unused", pipe, image_size=16))
    enc_n, enc_w = native.load_encoders(cfg_n, cpu, training=True), wrapped.load_encoders(cfg_w, cpu, training=True)
    torch.manual_seed(0)
    model_n = native.build_model(cfg_n, native.latent_shape(cfg_n, enc_n)).eval()
    model_w = wrapped.build_model(cfg_w, wrapped.latent_shape(cfg_w, enc_w)).eval()
    model_w.load_state_dict(FLUX_WEIGHTS.to_diffusers(model_n.state_dict()))
    images, captions = torch.rand(2, 1, 16, 16) * 2 - 1, ["a handwritten one", "the digit seven"]
    x_n, cond_n = native.objective(cfg_n, enc_n).prepare((images, captions), cpu, train=False)
    x_w, cond_w = wrapped.objective(cfg_w, enc_w).prepare((images, captions), cpu, train=False)
    torch.testing.assert_close(cond_w["embeds"], cond_n["txt"], rtol=0, atol=0)
    torch.testing.assert_close(cond_w["pooled"], cond_n["y"], rtol=0, atol=0)
    assert torch.equal(x_w, patchify(x_n))  # the same pixels, 2x2-patched for diffusers' packing
    t, noise = torch.tensor([0.2, 0.7]), torch.randn_like(x_n)
    losses_n, _ = native.objective(cfg_n, enc_n).losses(model_n, x_n, cond_n, t_frac=t, noise=noise)
    losses_w, _ = wrapped.objective(cfg_w, enc_w).losses(model_w, x_w, cond_w, t_frac=t, noise=patchify(noise))
    torch.testing.assert_close(losses_w, losses_n, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("extra", [[], ["--lora", "4"]], ids=["models", "lora"])
def test_the_vs_diffusers_benchmark_runs_and_every_row_computes_what_diffusers_does(capsys, extra):
    """Tiny DiT, Latte, FLUX.1 and Wan2.1 (LoRA: FLUX.1 and Wan2.1 against PEFT) in fp32 and bf16: every row's
    equality check passes and the table has a row per family, step and dtype."""
    from benchmarks.vs_diffusers import main

    assert main(["--size", "tiny", "--mode", "eager", "--repeats", "1", "--batch", "1", *extra]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "eager" in line]
    assert len(rows) == (4 if extra else 16) and not any("FAIL" in r for r in rows)


def test_the_benchmark_check_fails_another_function_and_a_nan():
    from benchmarks.vs_diffusers import check

    out = torch.randn(256, generator=torch.Generator().manual_seed(0))
    rounded = out * (1 + 1e-6)
    for results, dtype, fp32, passes in (([out, rounded], "fp32", None, True), ([out, out * 1.01], "fp32", None, False),
                                         ([out.bfloat16().float(), out], "bf16", out, True),
                                         ([out, out.roll(1)], "bf16", out, False),
                                         ([out, torch.full_like(out, float("nan"))], "bf16", out, False),
                                         ([out, torch.full_like(out, float("nan"))], "bf16", None, False)):
        distances, tolerance = check(results, dtype, fp32)
        assert all(d <= tolerance for d in distances) == passes, (dtype, distances)


def test_a_folder_without_both_encoders_is_named_with_the_layout_it_needs(encoders):
    from opendit.families import get_family

    glue = get_family("flux1").glue
    with pytest.raises(FileNotFoundError, match="no text_encoder in text_encoder/; this model takes its pipeline "
                                                "folder, holding text_encoder/, tokenizer/, text_encoder_2/, "
                                                "tokenizer_2/"):
        glue.text_encoder(encoders[0], "cpu", torch.float32, "flux1-debug-diffusers")  # a T5 folder alone
