"""Wan2.1 text-to-video transformer (opendit.families.wan.model), its weights files and its diffusers conversion.

- the state_dict equals the official Wan2.1-T2V-1.3B / -14B releases key by key, in order (tests/data/*.tsv, from
  the released safetensors headers), built on the meta device;
- the list forward equals tests/wan_reference.py (an independent transcription of the official forward) on random
  weights, for samples of different sizes and captions of different lengths; the tensor forward equals the list
  forward; attention backends and the Triton kernels (CPU interpreter) give the same math;
- single and sharded safetensors (+ index) load strictly into a meta-built model;
- diffusers' WanTransformer3DModel computes the same forward on converted weights; conversions round-trip.
"""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from opendit import kernels
from opendit.checkpoint import load_into_meta_model
from opendit.families.base import DiffusionModel, check_model_contract
from opendit.checkpoint.folders import read_safetensors
from opendit.families.wan.model import WAN22_CONFIGS, WAN_CONFIGS, WanModel
from opendit.families.wan.weights import WAN_WEIGHTS
from opendit.kernels import set_kernels
from tests.wan_reference import reference_forward

DATA = os.path.join(os.path.dirname(__file__), "data")
# Dh = 12: RoPE pairs (2, 2, 2) over frames, rows, columns; 4 heads split over P = 2 and 4; out_dim != in_dim
TINY = dict(WAN_CONFIGS["Wan-debug"], patch_size=(1, 2, 2), dim=48, num_heads=4, ffn_dim=64, freq_dim=16, text_len=8,
            text_dim=12, in_dim=4, out_dim=3)
ATOL = 1e-5  # fp32 on both sides; outputs are O(1)


def tiny_wan(seed=0, **kw):
    """Random weights everywhere (the zero head of the init would hide everything before it)."""
    torch.manual_seed(seed)
    model = WanModel(**{**TINY, **kw})
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


def wan_inputs(seed=1, cfg=TINY):
    """Two samples of different grids ((3, 2, 3) = 18 and (2, 3, 2) = 12 tokens), captions of 5 and 3 tokens."""
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(cfg["in_dim"], 3, 4, 6, generator=g), torch.randn(cfg["in_dim"], 2, 6, 4, generator=g)]
    context = [torch.randn(5, cfg["text_dim"], generator=g), torch.randn(3, cfg["text_dim"], generator=g)]
    return x, torch.tensor([3.0, 800.0]), context


def padded(context, text_len):
    return torch.stack([torch.cat([c, c.new_zeros(text_len - len(c), c.shape[1])]) for c in context])


# ------------------------------------------------------------------------------------- official layout
def _read_tsv(name):
    rows = []
    with open(os.path.join(DATA, name)) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                key, shape = line.rstrip("\n").split("\t")
                rows.append((key, tuple(int(s) for s in shape.strip("[]").split(",") if s.strip())))
    return rows


@pytest.mark.parametrize("name, tsv, params", [
    ("Wan2.1-T2V-1.3B", "wan21_t2v-1_3B_state_dict.tsv", 1_418_996_800),
    ("Wan2.1-T2V-14B", "wan21_t2v-14B_state_dict.tsv", 14_288_491_584),
    ("Wan2.2-TI2V-5B", "wan22_ti2v-5B_state_dict.tsv", 4_999_787_712),
    ("Wan2.2-T2V-A14B", "wan22_t2v-A14B_expert_state_dict.tsv", 14_288_491_584),  # each of its two experts
    ("Wan2.2-I2V-A14B", "wan22_i2v-A14B_expert_state_dict.tsv", 14_288_901_184),
])
def test_state_dict_equals_official_release(name, tsv, params):
    expected = _read_tsv(tsv)
    with torch.device("meta"):
        model = WanModel(**{**WAN_CONFIGS, **WAN22_CONFIGS}[name])
    assert [(k, tuple(v.shape)) for k, v in model.state_dict().items()] == expected
    assert sum(p.numel() for p in model.parameters()) == params
    model.load_state_dict({k: torch.empty(s, device="meta") for k, s in expected}, strict=True, assign=True)
    check_model_contract(model, name)
    assert isinstance(model, DiffusionModel)


def test_unsupported_settings_and_bad_inputs_are_named():
    with pytest.raises(ValueError, match="'s2v' is not supported; valid: t2v, i2v, ti2v"):
        WanModel(**{**TINY, "model_type": "s2v"})
    with pytest.raises(ValueError, match="global attention"):
        WanModel(**{**TINY, "window_size": (4, 4)})
    model = tiny_wan()
    x, t, context = wan_inputs()
    with pytest.raises(ValueError, match="seq_len >= 18"):
        model(x, t, context, seq_len=12)
    with pytest.raises(ValueError, match="text_len=8"):
        model(x, t, [torch.randn(9, 12), context[1]], seq_len=18)
    with pytest.raises(ValueError, match="zero-pad"):
        model(torch.randn(2, 4, 2, 4, 4), t, torch.randn(2, 5, 12))
    with pytest.raises(ValueError, match="multiples of patch_size"):
        model(torch.randn(2, 4, 2, 5, 4), t, torch.randn(2, 8, 12))


def test_fresh_model_predicts_zero():
    model = WanModel(**WAN_CONFIGS["Wan-debug"])
    assert model.text_embedding[0].weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.blocks[0].modulation.std().item() == pytest.approx(model.dim ** -0.5, rel=0.2)
    out = model(torch.randn(2, 16, 2, 4, 4), torch.tensor([10, 500]), torch.randn(2, 16, 32))
    assert torch.equal(out, torch.zeros(2, 16, 2, 4, 4))


# --------------------------------------------------------------------------------------------- forward
@torch.no_grad()
def test_list_forward_equals_official_reference():
    model = tiny_wan()
    x, t, context = wan_inputs()
    ref = reference_forward(model.state_dict(), TINY, x, t, context, seq_len=20)
    out = model(x, t, context, seq_len=20)
    for o, r, u in zip(out, ref, x):
        assert o.dtype == torch.float32 and o.shape == (3, *u.shape[1:])
        assert r.abs().mean() > 0.3
        torch.testing.assert_close(o, r, atol=ATOL, rtol=ATOL)
    # the zero padding of a caption is attended (as released): a shorter padding changes the output
    other = model(x, t, [context[0], torch.cat([context[1], torch.zeros(1, 12)])], seq_len=20)
    torch.testing.assert_close(other[1], out[1], atol=ATOL, rtol=ATOL)
    shifted = model(x, t, [context[0], torch.cat([context[1], torch.ones(1, 12)])], seq_len=20)
    assert (shifted[1] - out[1]).abs().max() > 1e-3


@torch.no_grad()
def test_tensor_forward_equals_list_forward_and_backends_agree():
    model = tiny_wan()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 3, 4, 6, generator=g)  # 18 tokens each
    t = torch.tensor([0, 999])
    context = [torch.randn(5, 12, generator=g), torch.randn(8, 12, generator=g)]
    batched = model(x, t, padded(context, 8))
    assert batched.shape == (2, 3, 3, 4, 6) and batched.dtype == torch.float32
    for seq_len in (18, 23):  # no padding, and padding masked out
        listed = model(list(x), t, context, seq_len=seq_len)
        torch.testing.assert_close(torch.stack(listed), batched, atol=ATOL, rtol=ATOL)
    set_kernels(model, attn_backend="math")
    torch.testing.assert_close(model(x, t, padded(context, 8)), batched, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(torch.stack(model(list(x), t, context, seq_len=23)), batched, atol=ATOL, rtol=ATOL)


def _run(model, x, t, context, target):
    x, context = x.clone().requires_grad_(), context.clone().requires_grad_()
    out = model(x, t, context)
    ((out - target) ** 2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.detach(), {**grads, "x": x.grad, "context": context.grad}


def test_kernels_equal_plain_path(one_thread):
    g = torch.Generator().manual_seed(3)
    x, t, context = torch.randn(2, 4, 2, 4, 4, generator=g), torch.tensor([5, 600]), torch.randn(2, 8, 12, generator=g)
    target = torch.randn(2, 3, 2, 4, 4, generator=g)
    ref_out, ref_grads = _run(tiny_wan(), x, t, context, target)
    assert kernels._why_not_kernel(ref_out) is None, "the Triton path would not run (TRITON_INTERPRET / triton)"
    for modulate, layernorm in ((True, False), (False, True)):
        model = tiny_wan()
        set_kernels(model, modulate=modulate, layernorm=layernorm, attn_backend="math")
        out, grads = _run(model, x, t, context, target)
        tol = dict(atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(out, ref_out, **tol)
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], **tol, msg=lambda m: f"{modulate, layernorm} {n}: {m}")


@torch.no_grad()
def test_blocks_compiled_under_bf16_autocast_equal_eager():
    """The tokens leave the patch embedding contiguous: on a transposed residual stream inductor (torch 2.13, CPU)
    fuses the bf16 matmul's residual add into the following LayerNorm wrongly and returns NaN."""
    from opendit.training.fast_step import compile_model
    g = torch.Generator().manual_seed(4)
    x, t, context = torch.randn(2, 4, 2, 8, 8, generator=g), torch.tensor([5, 600]), torch.randn(2, 8, 12, generator=g)
    model = tiny_wan(dim=256, num_heads=2).eval()  # 32 tokens of 256: inductor vectorises both
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model(x, t, context)
        compile_model(model, "blocks")
        compiled = model(x, t, context)
    assert torch.isfinite(compiled).all()
    torch.testing.assert_close(compiled, eager, atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------------------------- weights
@torch.no_grad()
def test_single_and_sharded_safetensors_load_strictly_into_a_meta_model(tmp_path):
    model = tiny_wan()
    state = model.state_dict()
    save_file(state, str(tmp_path / "single.safetensors"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    keys = list(state)
    weight_map = {}
    for i, part in enumerate((keys[:len(keys) // 2], keys[len(keys) // 2:])):
        name = f"diffusion_pytorch_model-0000{i + 1}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, str(sharded / name))
        weight_map.update(dict.fromkeys(part, name))
    index = sharded / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    x, t, context = wan_inputs()
    expected = model(x, t, context, seq_len=18)
    for path in (tmp_path / "single.safetensors", index, sharded):
        with torch.device("meta"):
            loaded = WanModel(**TINY)
        load_into_meta_model(loaded, read_safetensors(path), str(path))
        for a, b in zip(loaded(x, t, context, seq_len=18), expected):
            torch.testing.assert_close(a, b, atol=0, rtol=0)

    (sharded / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="00002-of-00002.safetensors, which is missing"):
        read_safetensors(sharded)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(FileNotFoundError, match="holds 2 candidate weight files.*pass the file itself"):
        read_safetensors(tmp_path)


# --------------------------------------------------------------------------------------------- diffusers
def _peer(model):
    from diffusers import WanTransformer3DModel

    peer = WanTransformer3DModel(**WAN_WEIGHTS.arch_to_diffusers(TINY)).eval()
    peer.load_state_dict(WAN_WEIGHTS.to_diffusers(model.state_dict()), strict=True)
    return peer


@torch.no_grad()
def test_converted_weights_give_diffusers_the_same_output(tmp_path):
    model = tiny_wan()
    peer = _peer(model)
    x, t, context = wan_inputs()
    x = torch.stack([x[0], x[0].flip(1)])  # one size: diffusers takes a batch tensor
    context = padded(context, TINY["text_len"])
    expected = peer(hidden_states=x, timestep=t, encoder_hidden_states=context, return_dict=False)[0]
    got = model(x, t, context)
    assert expected.abs().mean() > 0.3
    # diffusers' sinusoid and RoPE run in fp32 (ours in float64, as released): about 1e-5 apart here
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

    theirs = peer.state_dict()
    ours = WAN_WEIGHTS.from_diffusers(theirs)
    assert ours.keys() == model.state_dict().keys()
    assert all(torch.equal(ours[k], v) for k, v in model.state_dict().items())
    back = WAN_WEIGHTS.to_diffusers(ours)
    assert back.keys() == theirs.keys() and all(torch.equal(back[k], theirs[k]) for k in theirs)
    assert WAN_WEIGHTS.arch_from_diffusers(peer.config) == {**TINY, "text_len": 512}

    peer.save_pretrained(tmp_path / "transformer", max_shard_size="20KB")  # sharded, with an index
    assert len(list((tmp_path / "transformer").glob("*.safetensors"))) > 1
    (tmp_path / "model_index.json").write_text("{}")
    for folder in (tmp_path / "transformer", tmp_path):  # the transformer folder, or its pipeline folder
        config, state = WAN_WEIGHTS.load_diffusers(folder)
        with torch.device("meta"):
            loaded = WanModel(**{**config, "text_len": TINY["text_len"]})
        load_into_meta_model(loaded, state, str(folder))
        torch.testing.assert_close(loaded(x, t, context), got, atol=0, rtol=0)


def test_conversion_errors_name_the_problem():
    state = tiny_wan().state_dict()
    with pytest.raises(ValueError, match="lora"):
        WAN_WEIGHTS.to_diffusers({**state, "blocks.0.self_attn.q.lora_A.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="'model.patch_embedding.weight'"):
        WAN_WEIGHTS.to_diffusers({f"model.{k}": v for k, v in state.items()})
    with pytest.raises(ValueError, match="image-to-video"):
        WAN_WEIGHTS.from_diffusers({"condition_embedder.image_embedder.ff.net.0.proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="image-to-video"):
        WAN_WEIGHTS.arch_from_diffusers({"_class_name": "WanTransformer3DModel", "image_dim": 1280})
    with pytest.raises(ValueError, match="not a WanTransformer3DModel"):
        WAN_WEIGHTS.arch_from_diffusers({"_class_name": "FluxTransformer2DModel"})
    with pytest.raises(ValueError, match="qk_norm"):
        WAN_WEIGHTS.arch_to_diffusers({**TINY, "qk_norm": False})
