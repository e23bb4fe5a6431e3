"""LyCORIS LoKr and LoHa files (opendit.lora.lycoris): their updates follow the documented formulas (LoKr's scale only
with a decomposed factor), are merged into the base weights by sample.py --lora, python -m opendit.lora merge and
--init_lora, and a FLUX.2 LoKr file, under LyCORIS' own names (the diffusers modules) or ai-toolkit's (BFL's, fused
qkv), samples what diffusers' Flux2KleinPipeline.load_lora_weights samples with it. A factor opendit does not know
refuses the file."""
import types

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from opendit import config as cfglib
from opendit.lora.lycoris import load_lycoris, merge_deltas
from tests.run_each import run_here
from tests.test_train import run_trainer
from tests.test_wrapped_lora import diffusers_pipeline, qwen  # noqa: F401  (qwen: the tiny Qwen3 fixture)


def test_updates_follow_the_lokr_and_loha_formulas(tmp_path):
    torch.manual_seed(0)
    w1, w2a, w2b = torch.randn(2, 2), torch.randn(3, 4), torch.randn(4, 5)
    h1a, h1b, h2a, h2b = torch.randn(6, 4), torch.randn(4, 10), torch.randn(6, 4), torch.randn(4, 10)
    full1, full2 = torch.randn(3, 2), torch.randn(2, 5)
    state = {"lycoris_a_b.lokr_w1": w1, "lycoris_a_b.lokr_w2_a": w2a, "lycoris_a_b.lokr_w2_b": w2b,
             "lycoris_a_b.alpha": torch.tensor(2.0),
             "diffusion_model.c.hada_w1_a": h1a, "diffusion_model.c.hada_w1_b": h1b,
             "diffusion_model.c.hada_w2_a": h2a, "diffusion_model.c.hada_w2_b": h2b,
             "diffusion_model.c.alpha": torch.tensor(8.0),
             "lora_unet_d.lokr_w1": full1, "lora_unet_d.lokr_w2": full2, "lora_unet_d.alpha": torch.tensor(1.0),
             "lora_te1_x.lokr_w1": torch.zeros(1, 1), "lora_te1_x.lokr_w2": torch.zeros(1, 1)}
    path = str(tmp_path / "lyco.safetensors")
    save_file(state, path)
    deltas = load_lycoris(path, ["a.b", "c", "d"])
    torch.testing.assert_close(deltas["a.b"], torch.kron(w1, w2a @ w2b) * 2.0 / 4)
    torch.testing.assert_close(deltas["c"], (h1a @ h1b) * (h2a @ h2b) * 8.0 / 4)
    torch.testing.assert_close(deltas["d"], torch.kron(full1, full2))  # both factors full: alpha is not applied
    assert set(deltas) == {"a.b", "c", "d"}  # the text encoder's module left out

    model = torch.nn.Sequential(torch.nn.Linear(10, 6))
    before = model[0].weight.detach().clone()
    assert merge_deltas(model, {"0": deltas["c"]}, 0.5, path) == 1
    torch.testing.assert_close(model[0].weight.detach(), before + 0.5 * deltas["c"])
    with pytest.raises(ValueError, match="is \\[6, 10\\] here, the update makes \\[6, 20\\]"):
        merge_deltas(model, {"0": torch.zeros(6, 20)}, 1.0, path)

    save_file({**state, "lycoris_a_b.lokr_t2": torch.zeros(1)}, path)
    with pytest.raises(ValueError, match="lycoris_a_b holds lokr_t2, which is no LoKr / LoHa factor"):
        load_lycoris(path, ["a.b", "c", "d"])
    save_file({"lycoris_zz.lokr_w1": w1, "lycoris_zz.lokr_w2": full2}, path)
    with pytest.raises(ValueError, match="adapts lycoris_zz, which is no Linear layer of this model"):
        load_lycoris(path, ["a.b"])


def test_init_lora_merges_a_lokr_file_into_the_frozen_base_and_trains_new_adapters_on_top(tmp_path):
    import re

    from opendit.families import FAMILIES
    from opendit.lora import lora_modules
    from opendit.lora.run import adapt_model
    from tests.test_lora_formats import _tiny_dit

    dit = FAMILIES["dit"]
    model = _tiny_dit()
    name = next(n for n, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and re.fullmatch(dit.lora_targets, n))
    before = model.get_submodule(name).weight.detach().clone()
    state = {f"lycoris_{name.replace('.', '_')}.{k}": v for k, v in _lokr(*before.shape, 0).items()}
    path = str(tmp_path / "lokr.safetensors")
    save_file(state, path)
    cfg = types.SimpleNamespace(lora_targets=None, lora_rank=2, lora_alpha=None, lora_dropout=0.0, init_lora=path,
                                master_weights="fp32", base_dtype="auto")
    adapt_model(model, dit, cfg, torch.float32)
    torch.testing.assert_close(model.get_submodule(name).weight.detach(), before + load_lycoris(path, [name])[name])
    assert all(not B.any() for m in lora_modules(model).values() for B in m.lora_B)  # the new adapters start at 0


def _lokr(out: int, inp: int, seed: int) -> dict:
    """A LoKr update of an [out, in] Linear: full w1 [2, 2], w2 decomposed at rank 2, alpha 1."""
    g = torch.Generator().manual_seed(seed)
    return {"lokr_w1": torch.randn(2, 2, generator=g), "lokr_w2_a": torch.randn(out // 2, 2, generator=g) * 0.5,
            "lokr_w2_b": torch.randn(2, inp // 2, generator=g) * 0.5, "alpha": torch.tensor(1.0)}


@pytest.mark.slow
def test_flux2_lokr_files_sample_what_diffusers_samples_with_them(tmp_path, qwen):  # noqa: F811
    model = "flux2-klein-debug"
    common = dict(model=model, dataset="captioned_digits", image_size=8, vae="none", text_encoder=qwen, batch_size=4,
                  log_every=1, num_workers=0)
    run_trainer(cfglib.TrainConfig(**common, max_steps=2, outputs=str(tmp_path / "base"), lr=1e-3, ema_decay=0.9))
    base = next((tmp_path / "base").glob("*/checkpoints/step-000002/ema.safetensors"))
    pipe, transformer, images = diffusers_pipeline(common, base)
    rows = {n: m.weight.shape for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    inner = rows["transformer_blocks.0.attn.to_q"][0]
    files = {  # LyCORIS' own names (the diffusers modules); ai-toolkit's (BFL's, its fused qkv)
        "lycoris": {f"lycoris_{name.replace('.', '_')}.{k}": v for i, name in enumerate(
            ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.ff.linear_in",
             "single_transformer_blocks.0.attn.to_out"]) for k, v in _lokr(*rows[name], i).items()},
        "ai-toolkit": {f"diffusion_model.{name}.{k}": v for i, (name, size) in enumerate(
            [("double_blocks.0.img_attn.qkv", (3 * inner, rows["transformer_blocks.0.attn.to_q"][1])),
             ("single_blocks.0.linear2", tuple(rows["single_transformer_blocks.0.attn.to_out"]))])
            for k, v in _lokr(*size, i).items()}}
    without = images()
    for name, state in files.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(state, str(path))
        run_here("sample.py", "--ckpt", base, "--model", model, "--text_encoder", qwen, "--vae", "none", "--image_size",
            "8", "--lora", path, "--prompts", "a handwritten one", "--num_samples", "2", "--num_sampling_steps", "3",
            "--cfg_scale", "1", "--npz", "--out", tmp_path / name)
        ours = np.load(tmp_path / name / "samples.npz")["arr_0"]
        pipe.load_lora_weights(str(path))
        theirs = images()
        pipe.unload_lora_weights()
        assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1, name
        assert not np.array_equal(ours, without), name  # the update mattered
