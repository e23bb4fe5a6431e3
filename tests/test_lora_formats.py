"""LoRA files and the ecosystem (opendit.lora.formats, run, __main__): what we write loads into diffusers and gives
our output, what diffusers / PEFT write loads into our models and gives theirs, the layouts convert into each other
bit for bit, `python -m opendit.lora merge` equals the attached adapters, and bad files are named.

- FLUX: diffusers layout through FluxPipeline.lora_state_dict + load_lora_into_transformer and through the model's
  own load_lora_adapter; kohya layout through diffusers' kohya converter; a PEFT adapter saved by
  FluxPipeline.save_lora_weights loads into ours (fused q/k/v with distinct A's: block-diagonal import);
- Wan: diffusers layout and kohya (musubi-tuner) layout through WanPipeline's loader;
- DiT (no diffusers converter): both layouts round-trip under the official module names.
Tiny fp32 models on the CPU; every forward comparison is against a model with the adapters actually applied.
"""
import json
import re

import pytest
import torch
from safetensors.torch import save_file

from opendit.checkpoint import export_weights
from opendit.families import FAMILIES
from opendit.lora import (Adapter, add_lora, attach_adapters, linear_names, load_adapters, lora_modules,
                          merge_adapters, save_adapters, trained_adapters)
from opendit.lora.__main__ import main as lora_main
from opendit.lora.formats import METADATA_KEY, read_file
from opendit.lora.run import apply_lora_files, family_module_map, parse_lora_spec
from opendit.families.flux.weights import FLUX_WEIGHTS
from opendit.families.dit.model import DiT
from opendit.families.flux.model import Flux
from tests.test_flux_model import TINY as FLUX_TINY
from tests.test_flux_model import _peer as flux_peer
from tests.test_flux_model import flux_inputs, tiny_flux
from tests.test_wan_model import TINY as WAN_TINY
from tests.test_wan_model import _peer as wan_peer
from tests.test_wan_model import padded, tiny_wan, wan_inputs

FLUX, WAN, DIT = FAMILIES["flux"], FAMILIES["wan"], FAMILIES["dit"]
ATOL = 1e-5  # fp32 on both sides


def _randomize_B(model, seed=0, std=0.1):
    """Trained-looking adapters: lora_B random (add_lora starts it at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B[0].copy_(std * torch.randn(m.lora_B[0].shape, generator=g))


def _random_adapters(model, targets, seed=0, rank=4, alpha=3.0, odd=()):
    """{name: Adapter} on the Linears matching `targets`; the names in `odd` get rank 2 and alpha 1.5 (the
    diffusers metadata then needs rank_pattern / alpha_pattern)."""
    g = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    out = {}
    for name in [n for n in linear_names(model) if re.fullmatch(targets, n)]:
        m = modules[name]
        r, a = (2, 1.5) if name in odd else (rank, alpha)
        out[name] = Adapter(0.3 * torch.randn(r, m.in_features, generator=g),
                            0.1 * torch.randn(m.out_features, r, generator=g), a)
    return out


def _same_adapters(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].A, b[n].A) and torch.equal(a[n].B, b[n].B) and
                                        a[n].alpha == b[n].alpha and type(a[n].alpha) is type(b[n].alpha) for n in a)


# ------------------------------------------------------------------------------------------------------- FLUX
def _flux_pair():
    """A tiny diffusers FluxTransformer2DModel (random weights) and our Flux with the same weights."""
    peer = flux_peer(True)
    kwargs = FLUX_WEIGHTS.arch_from_diffusers(peer.config)
    ours = Flux(**kwargs).eval()
    ours.load_state_dict(FLUX_WEIGHTS.from_diffusers(peer.state_dict()), strict=True)
    return peer, ours, flux_inputs(seed=3, n_txt=7, latent=8, cfg=kwargs)


def _run_peer(peer, inp):
    return peer(hidden_states=inp["img"], encoder_hidden_states=inp["txt"], pooled_projections=inp["y"],
                timestep=inp["timesteps"], img_ids=inp["img_ids"][0], txt_ids=inp["txt_ids"][0],
                guidance=inp["guidance"], return_dict=False)[0]


@pytest.mark.parametrize("kind", ["add_lora", "mixed_ranks"])
@torch.no_grad()
def test_flux_diffusers_layout_loads_into_diffusers_with_our_output(tmp_path, kind):
    from diffusers import FluxPipeline

    pytest.importorskip("peft")
    torch.manual_seed(0)
    peer, ours, inp = _flux_pair()
    base = ours(**inp)
    if kind == "add_lora":  # a run's adapters: one rank, alpha != rank so the scale matters
        add_lora(ours, 4, 3.0, FLUX.lora_targets)
        _randomize_B(ours)
        adapters = trained_adapters(ours)
    else:  # ranks and alphas that differ per module: the metadata's rank_pattern / alpha_pattern
        adapters = _random_adapters(ours, FLUX.lora_targets, odd={"double_blocks.0.img_attn.qkv",
                                                                  "single_blocks.0.linear2"})
        attach_adapters(ours, adapters)
    expected = ours(**inp)
    assert (expected - base).abs().max() > 1e-2
    path = str(tmp_path / "lora.safetensors")
    save_adapters(path, adapters, "diffusers", family_module_map(FLUX, ours))

    state, alphas, metadata = FluxPipeline.lora_state_dict(path, return_alphas=True, return_lora_metadata=True)
    assert not alphas and metadata["transformer.lora_alpha"] == 3.0  # alpha travels in the LoraConfig metadata
    FluxPipeline.load_lora_into_transformer(state, network_alphas=alphas, transformer=peer, metadata=metadata)
    torch.testing.assert_close(_run_peer(peer, inp), expected, atol=ATOL, rtol=ATOL)

    # the model's own loader. Note: load_lora_adapter reads the safetensors header (our alpha) only with
    # use_safetensors=True; without it diffusers (0.42) loads the file as a state dict with no metadata and uses
    # alpha = r (scale 1), which differs whenever alpha != rank
    direct = flux_peer(True)
    direct.load_lora_adapter(path, prefix="transformer", use_safetensors=True)
    torch.testing.assert_close(_run_peer(direct, inp), expected, atol=ATOL, rtol=ATOL)

    # and the file reads back into the adapters we wrote (fused layers re-fused, shared A)
    assert _same_adapters(load_adapters(path, family_module_map(FLUX, ours), linear_names(ours)), adapters)


@torch.no_grad()
def test_flux_kohya_layout_loads_through_diffusers_kohya_converter(tmp_path):
    from diffusers import FluxPipeline

    pytest.importorskip("peft")
    torch.manual_seed(0)
    peer, ours, inp = _flux_pair()
    base = ours(**inp)
    # diffusers' _convert_kohya_flux_lora_to_diffusers splits single_blocks.N.linear1 at FLUX.1's widths
    # [3072, 3072, 3072, 12288] whatever the model, so on this tiny model linear1 stays out; the kohya <-> diffusers
    # round trip below covers it with our own converter
    targets = r"double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mlp\.[02])|single_blocks\.\d+\.linear2"
    add_lora(ours, 4, 3.0, targets)
    _randomize_B(ours)
    expected = ours(**inp)
    assert (expected - base).abs().max() > 1e-2
    path = str(tmp_path / "lora_kohya.safetensors")
    save_adapters(path, trained_adapters(ours), "kohya")
    state, alphas = FluxPipeline.lora_state_dict(path, return_alphas=True)
    assert alphas is None and all(k.startswith("transformer.") for k in state)  # alpha baked into A and B
    FluxPipeline.load_lora_into_transformer(state, network_alphas=alphas, transformer=peer)
    torch.testing.assert_close(_run_peer(peer, inp), expected, atol=ATOL, rtol=ATOL)


def _flux_base(tmp_path, model=None):
    """A tiny Flux exported as a run would (EMA export + its settings): the --ckpt of merge / convert. merge and
    convert never build the model, so the registry name (flux-debug) only picks the family."""
    model = model if model is not None else tiny_flux()
    path = str(tmp_path / "base.safetensors")
    export_weights(path, model.state_dict(), metadata={"config": {"model": "flux-debug", "lora_rank": 0}})
    return path


def test_kohya_and_diffusers_layouts_convert_into_each_other_bitwise(tmp_path, capsys):
    torch.manual_seed(0)
    model = tiny_flux()
    base = _flux_base(tmp_path, model)
    # every target incl. single_blocks.0.linear1 (q, k, v and the MLP input fused), alpha != rank, mixed ranks
    adapters = _random_adapters(model, FLUX.lora_targets, odd={"single_blocks.0.linear1", "double_blocks.0.txt_mlp.2"})
    kohya, diff = str(tmp_path / "k.safetensors"), str(tmp_path / "d.safetensors")
    save_adapters(kohya, adapters, "kohya")
    save_adapters(diff, adapters, "diffusers", family_module_map(FLUX, model))

    k2d, k2d2k = str(tmp_path / "k2d.safetensors"), str(tmp_path / "k2d2k.safetensors")
    assert lora_main(["convert", "--ckpt", base, "--lora", kohya, "--layout", "diffusers", "--out", k2d]) == 0
    assert lora_main(["convert", "--ckpt", base, "--lora", k2d, "--layout", "kohya", "--out", k2d2k]) == 0
    assert "diffusers layout" in capsys.readouterr().out
    original, back = read_file(kohya)[0], read_file(k2d2k)[0]
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    assert back["lora_unet_single_blocks_0_linear1.alpha"].item() == 1.5
    assert back["lora_unet_double_blocks_0_img_attn_qkv.alpha"].item() == 3.0
    # kohya -> diffusers writes what the diffusers export writes, metadata included
    direct, (via, via_meta) = read_file(diff), read_file(k2d)
    assert direct[0].keys() == via.keys() and all(torch.equal(direct[0][k], via[k]) for k in via)
    config = json.loads(via_meta[METADATA_KEY])
    assert config == json.loads(direct[1][METADATA_KEY])
    assert config["transformer.rank_pattern"] == {n: 2 for n in ("single_transformer_blocks.0.attn.to_q",
                                                                 "single_transformer_blocks.0.attn.to_k",
                                                                 "single_transformer_blocks.0.attn.to_v",
                                                                 "single_transformer_blocks.0.proj_mlp",
                                                                 "transformer_blocks.0.ff_context.net.2")}

    d2k, d2k2d = str(tmp_path / "d2k.safetensors"), str(tmp_path / "d2k2d.safetensors")
    assert lora_main(["convert", "--ckpt", base, "--lora", diff, "--layout", "kohya", "--out", d2k]) == 0
    assert lora_main(["convert", "--ckpt", base, "--lora", d2k, "--layout", "diffusers", "--out", d2k2d]) == 0
    (original, meta), (back, back_meta) = read_file(diff), read_file(d2k2d)
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    assert json.loads(meta[METADATA_KEY]) == json.loads(back_meta[METADATA_KEY])
    # and both read back to the adapters written
    mapping, linears = family_module_map(FLUX, model), linear_names(model)
    for path in (kohya, diff, k2d, k2d2k, d2k, d2k2d):
        assert _same_adapters(load_adapters(path, mapping, linears), adapters), path


def _peft_flux_file(tmp_path, peer, targets, name="peft"):
    """A PEFT adapter (random A and B) on the diffusers model, saved by diffusers' own FluxPipeline.save_lora_weights
    with its LoraConfig as metadata (what diffusers' training scripts write)."""
    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(4)
    peer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():  # init_lora_weights=False: A and B both keep nn.Linear's init (B nonzero); scaled down
        # so that the adapters change the output by about as much as the random base weights make it
        for n, p in peer.named_parameters():
            if "lora_B" in n:
                p.mul_(0.3)
    FluxPipeline.save_lora_weights(tmp_path / name, transformer_lora_layers=get_peft_model_state_dict(peer),
                                   transformer_lora_adapter_metadata=peer.peft_config["default"].to_dict())
    return str(tmp_path / name / "pytorch_lora_weights.safetensors")


@torch.no_grad()
def test_peft_adapter_saved_by_diffusers_loads_into_ours(tmp_path):
    pytest.importorskip("peft")
    torch.manual_seed(0)
    peer, ours, inp = _flux_pair()
    base = _run_peer(peer, inp)
    # every piece of each fused layer (distinct A's: imported as stacked A, block-diagonal B), the output
    # projections, both MLPs, and norm_out.linear (the final adaLN, whose scale and shift halves diffusers swaps)
    targets = ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out",
               "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out",
               "norm_out.linear"]
    path = _peft_flux_file(tmp_path, peer, targets)
    expected = _run_peer(peer, inp)
    assert (expected - base).abs().max() > 1e-2

    apply_lora_files(ours, FLUX, [(path, 1.0)])
    torch.testing.assert_close(ours(**inp), expected, atol=ATOL, rtol=ATOL)
    modules = lora_modules(ours)
    qkv = modules["double_blocks.0.img_attn.qkv"]
    assert qkv.lora_A[0].shape[0] == 12 and qkv.lora_scale == [1.0]  # 3 x rank 4, each piece's scale 2 folded in
    assert modules["single_blocks.0.linear1"].lora_A[0].shape[0] == 16  # q, k, v and the MLP input
    assert modules["double_blocks.0.img_attn.proj"].lora_scale == [2.0]  # one piece: the file's own A, B, alpha
    assert {"final_layer.linear", "final_layer.adaLN_modulation.1"} <= modules.keys()  # top-level proj_out too

    # load_adapters + attach_adapters at a strength = the peer with its adapter scaled the same
    fresh = _flux_pair()[1]
    adapters = load_adapters(path, family_module_map(FLUX, fresh), linear_names(fresh))
    attach_adapters(fresh, adapters, strength=0.5)
    peer.set_adapters(["default"], weights=[0.5])
    torch.testing.assert_close(fresh(**inp), _run_peer(peer, inp), atol=ATOL, rtol=ATOL)


@torch.no_grad()
@torch.no_grad()
def test_attention_only_lora_of_diffusers_loads_exactly(tmp_path):
    """diffusers' FLUX LoRA script adapts attn.to_q/k/v/to_out.0 by default: the single blocks' fused linear1 then
    has adapters on its q, k, v rows and none on its MLP rows (proj_mlp), which get zero rows of B."""
    pytest.importorskip("peft")
    peer, ours, inp = _flux_pair()
    path = _peft_flux_file(tmp_path, peer, ["to_q", "to_k", "to_v", "to_out.0"])
    expected = _run_peer(peer, inp)
    apply_lora_files(ours, FLUX, [(path, 1.0)])
    torch.testing.assert_close(ours(**inp), expected, atol=ATOL, rtol=ATOL)
    linear1 = lora_modules(ours)["single_blocks.0.linear1"]
    mlp_rows = linear1.lora_B[0][3 * 32:]
    assert linear1.lora_A[0].shape[0] == 12 and mlp_rows.numel() and not mlp_rows.any()
    assert "double_blocks.0.txt_attn.qkv" not in lora_modules(ours)  # add_q_proj etc. were not adapted
    partial = _peft_flux_file(tmp_path, _flux_pair()[0], ["to_q"], name="q_only")  # one piece of a fused layer
    fresh = _flux_pair()[1]
    apply_lora_files(fresh, FLUX, [(partial, 1.0)])
    assert lora_modules(fresh)["double_blocks.0.img_attn.qkv"].lora_B[0][32:].abs().sum() == 0


# -------------------------------------------------------------------------------------------------------- Wan
def _wan_case():
    model = tiny_wan()
    peer = wan_peer(model)
    x, t, context = wan_inputs()
    x = torch.stack([x[0], x[0].flip(1)])  # one size: diffusers takes a batch tensor
    return model, peer, (x, t, padded(context, WAN_TINY["text_len"]))


def _run_wan_peer(peer, inp):
    x, t, context = inp
    return peer(hidden_states=x, timestep=t, encoder_hidden_states=context, return_dict=False)[0]


@pytest.mark.parametrize("layout", ["diffusers", "kohya"])
@torch.no_grad()
def test_wan_lora_loads_into_diffusers_with_our_output(tmp_path, layout):
    """diffusers' WanPipeline.lora_state_dict converts kohya files named like musubi-tuner's
    (lora_unet_blocks_0_self_attn_q: the official module names, what our kohya layout writes) with
    _convert_musubi_wan_lora_to_diffusers, alpha baked into A and B; it needs q, k, v, o of both attentions and
    ffn.0 / ffn.2 of every block, which is the Wan family's default --lora_targets."""
    from diffusers import WanPipeline

    pytest.importorskip("peft")
    torch.manual_seed(0)
    model, peer, inp = _wan_case()
    base = model(*inp)
    add_lora(model, 4, 3.0, WAN.lora_targets)
    _randomize_B(model, std=0.2)
    expected = model(*inp)
    assert (expected - base).abs().max() > 1e-2
    adapters = trained_adapters(model)
    path = str(tmp_path / f"{layout}.safetensors")
    save_adapters(path, adapters, layout, family_module_map(WAN, model))
    state, metadata = WanPipeline.lora_state_dict(path, return_lora_metadata=True)
    assert (metadata is not None) == (layout == "diffusers")
    WanPipeline.load_lora_into_transformer(state, transformer=peer, metadata=metadata)
    # diffusers' sinusoid and RoPE run in fp32 (ours in float64, as released): the tolerance of test_wan_model
    torch.testing.assert_close(_run_wan_peer(peer, inp), expected, atol=1e-4, rtol=1e-4)
    assert _same_adapters(load_adapters(path, family_module_map(WAN, model), linear_names(model)), adapters)


@torch.no_grad()
def test_wan_peft_adapter_loads_into_ours(tmp_path):
    from diffusers import WanPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model, peer, inp = _wan_case()
    torch.manual_seed(4)
    peer.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=["to_q", "to_k", "to_v", "to_out.0", "net.0.proj",
                                                                     "net.2"], init_lora_weights=False))
    expected = _run_wan_peer(peer, inp)
    WanPipeline.save_lora_weights(tmp_path, transformer_lora_layers=get_peft_model_state_dict(peer),
                                  transformer_lora_adapter_metadata=peer.peft_config["default"].to_dict())
    apply_lora_files(model, WAN, [(str(tmp_path / "pytorch_lora_weights.safetensors"), 1.0)])
    # q, k, v, o of both attentions, ffn.0 and ffn.2 of every block
    assert len(lora_modules(model)) == 10 * WAN_TINY["num_layers"]
    torch.testing.assert_close(model(*inp), expected, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------------ merge
@torch.no_grad()
def test_merge_cli_equals_attached_adapters(tmp_path, capsys):
    torch.manual_seed(0)
    model, inp = tiny_flux(), flux_inputs()
    base = _flux_base(tmp_path, model)
    one = _random_adapters(model, FLUX.lora_targets, seed=1)
    two = _random_adapters(model, r"double_blocks\.0\.img_attn\.qkv|single_blocks\.0\.linear[12]|final_layer\.linear",
                           seed=2, rank=2, alpha=8.0)
    f1, f2 = str(tmp_path / "one.safetensors"), str(tmp_path / "two_kohya.safetensors")
    save_adapters(f1, one, "diffusers", family_module_map(FLUX, model))
    save_adapters(f2, two, "kohya")
    out = str(tmp_path / "merged.safetensors")
    assert lora_main(["merge", "--ckpt", base, "--lora", f"{f1}:0.5", f2, "--out", out]) == 0
    assert "official layout" in capsys.readouterr().out

    merged = read_file(out)[0]
    official = Flux(**FLUX_TINY).state_dict()
    assert sorted(merged) == sorted(official)  # exactly the official keys, no lora_* left
    assert all(merged[k].shape == v.shape and merged[k].dtype == v.dtype for k, v in official.items())
    settings = json.loads((tmp_path / "merged.json").read_text())["config"]
    assert settings["model"] == "flux-debug" and settings["lora_rank"] == 0 and settings["init_weights"] == base
    attach_adapters(model, one, strength=0.5)
    attach_adapters(model, two)
    expected = model(**inp)
    fresh = Flux(**FLUX_TINY).eval()
    fresh.load_state_dict(merged, strict=True)
    got = fresh(**inp)
    assert (got - tiny_flux()(**inp)).abs().max() > 1e-2
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)
    merge_adapters(model)  # the in-memory merge gives the CLI's weights
    assert all(torch.allclose(v, merged[k], atol=1e-6, rtol=0) for k, v in model.state_dict().items())


# -------------------------------------------------------------------------------------------------------- DiT
def _tiny_dit(seed=0):
    torch.manual_seed(seed)
    model = DiT(input_size=8, hidden_size=32, depth=2, num_heads=4, num_classes=10).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn_like(p))
    return model


def _dit_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 4, 8, 8, generator=g), torch.tensor([3.0, 700.0]), torch.tensor([1, 7])


@torch.no_grad()
def test_dit_layouts_round_trip_under_official_names(tmp_path):
    model, inp = _tiny_dit(), _dit_inputs()
    base = model(*inp)
    add_lora(model, 4, 6.0, DIT.lora_targets)
    _randomize_B(model)
    trained = model(*inp)
    assert (trained - base).abs().max() > 1e-2
    adapters = trained_adapters(model)
    mapping, linears = family_module_map(DIT, model), linear_names(model)
    assert all(parts == [(name, parts[0][1])] for name, parts in mapping.items())  # no converter: the same names
    diff, kohya = str(tmp_path / "d.safetensors"), str(tmp_path / "k.safetensors")
    save_adapters(diff, adapters, "diffusers", mapping)
    save_adapters(kohya, adapters, "kohya")
    state, meta = read_file(diff)
    assert "transformer.blocks.0.attn.qkv.lora_A.weight" in state
    assert json.loads(meta[METADATA_KEY])["transformer.lora_alpha"] == 6.0
    assert "lora_unet_blocks_1_mlp_fc2.lora_up.weight" in read_file(kohya)[0]
    for path in (diff, kohya):
        loaded = load_adapters(path, mapping, linears)
        assert _same_adapters(loaded, adapters), path
        fresh = _tiny_dit()
        attach_adapters(fresh, loaded)
        torch.testing.assert_close(fresh(*inp), trained, atol=ATOL, rtol=ATOL)
        apply_lora_files(fresh, DIT, [(path, -1.0)])  # the same file at strength -1 undoes it
        torch.testing.assert_close(fresh(*inp), base, atol=ATOL, rtol=ATOL)


# ------------------------------------------------------------------------------------- in full or not at all
def test_a_file_applies_in_full_or_is_refused_naming_what_it_cannot_apply(tmp_path, caplog):
    """Every tensor of a LoRA file is applied, or the file is refused: a LoKr factor or DoRA scale beside plain
    adapters, an up without its down, adapters under another prefix. Text encoders' adapters are left out and
    counted in the log. diffusers' older key names (X.lora.down.weight / X.lora.up.weight, mixed with lora_A /
    lora_B as some exports write them) load in full."""
    import logging

    model = tiny_flux()
    mapping, linears = family_module_map(FLUX, model), linear_names(model)
    adapters = _random_adapters(model, FLUX.lora_targets)
    kohya, diff = str(tmp_path / "k.safetensors"), str(tmp_path / "d.safetensors")
    save_adapters(kohya, adapters, "kohya")
    save_adapters(diff, adapters, "diffusers", mapping)
    (k_state, _), (d_state, d_meta) = read_file(kohya), read_file(diff)
    extras = {"LoKr factor": {"lora_unet_double_blocks_0_img_mlp_0.lokr_w1": torch.zeros(2, 2)},
              "DoRA scale": {"lora_unet_double_blocks_0_img_mlp_0.dora_scale": torch.zeros(1, 32)},
              "orphan up": {"lora_unet_final_layer_linear.lora_up.weight": torch.zeros(8, 4)},
              "other prefix": {"lora_transformer_x.lora_down.weight": torch.zeros(4, 8),
                               "lora_transformer_x.lora_up.weight": torch.zeros(8, 4)}}
    for extra in extras.values():
        path = str(tmp_path / "bad.safetensors")
        save_file({**k_state, **extra}, path)
        with pytest.raises(ValueError, match=rf"{len(extra)} of its {len(k_state) + len(extra)} tensors are nothing "
                                             rf"opendit applies \(e.g. {sorted(extra)[0]}.*in full or not at all"):
            load_adapters(path, mapping, linears)
    with_te = str(tmp_path / "te.safetensors")
    save_file({**k_state, "lora_te1_q.lora_down.weight": torch.zeros(4, 8), "lora_te1_q.lora_up.weight":
               torch.zeros(8, 4)}, with_te)
    with caplog.at_level(logging.INFO, logger="opendit"):
        assert _same_adapters(load_adapters(with_te, mapping, linears), load_adapters(kohya, mapping, linears))
    assert "2 text-encoder tensors left out" in caplog.text

    modules = sorted({k.rsplit(".lora_", 1)[0] for k in d_state})
    renamed = set(modules[::2])  # every other layer under the older names
    older = {k.replace(".lora_A.weight", ".lora.down.weight").replace(".lora_B.weight", ".lora.up.weight")
             if k.rsplit(".lora_", 1)[0] in renamed else k: v for k, v in d_state.items()}
    assert any(".lora.down.weight" in k for k in older) and any(".lora_A.weight" in k for k in older)
    path = str(tmp_path / "older.safetensors")
    save_file(older, path, metadata=d_meta)
    assert _same_adapters(load_adapters(path, mapping, linears), load_adapters(diff, mapping, linears))


# ----------------------------------------------------------------------------------------------------- errors
def test_bad_files_and_specs_are_named(tmp_path):
    model = tiny_flux()
    mapping, linears = family_module_map(FLUX, model), linear_names(model)
    weights = str(tmp_path / "weights.safetensors")
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(96, 32)}, weights)
    with pytest.raises(ValueError, match=r"not a LoRA file.*lora_A.weight.*lora_down.weight"):
        load_adapters(weights, mapping, linears)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_adapters(str(tmp_path / "missing.safetensors"), mapping, linears)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable .safetensors"):
        load_adapters(str(garbage), mapping, linears)

    # a LoRA for another model size: fused (qkv: rows split by the converter) and plain layers, both layouts
    big = tiny_flux(hidden_size=64, axes_dim=(4, 4, 8))
    adapters = _random_adapters(big, FLUX.lora_targets)
    for layout in ("diffusers", "kohya"):
        path = str(tmp_path / f"big_{layout}.safetensors")
        save_adapters(path, adapters, layout, family_module_map(FLUX, big))
        with pytest.raises(ValueError, match="another model size"):
            apply_lora_files(tiny_flux(), FLUX, [(path, 1.0)])
    proj = {"double_blocks.0.img_attn.proj": adapters["double_blocks.0.img_attn.proj"]}  # one plain layer
    for layout, message in (("diffusers", "img_attn.proj makes 64 rows where this model's layer has 32"),
                            ("kohya", "img_attn.proj is 32x32 here, the adapter makes 64x64")):
        path = str(tmp_path / f"big_proj_{layout}.safetensors")
        save_adapters(path, proj, layout, family_module_map(FLUX, big))
        with pytest.raises(ValueError, match=f"{message}; it is for another model size"):
            apply_lora_files(tiny_flux(), FLUX, [(path, 1.0)])
    # another model family altogether
    dit_file = str(tmp_path / "dit.safetensors")
    save_adapters(dit_file, _random_adapters(_tiny_dit(), DIT.lora_targets), "kohya")
    with pytest.raises(ValueError, match=r"adapts lora_unet_blocks_\d_\w+, which is no Linear layer.*another model"):
        apply_lora_files(model, FLUX, [(dit_file, 1.0)])

    # a kohya file with only a text encoder's adapters
    te = str(tmp_path / "te.safetensors")
    save_file({"lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight": torch.zeros(4, 8),
               "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight": torch.zeros(8, 4),
               "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.alpha": torch.tensor(4.0)}, te)
    with pytest.raises(ValueError, match=r"holds only text-encoder adapters \(3 tensors, e.g. lora_te1_"):
        load_adapters(te, mapping, linears)
    # a diffusers-layout file for a text encoder
    te_diff = str(tmp_path / "te_diff.safetensors")
    save_file({"text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 8),
               "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 4)}, te_diff)
    with pytest.raises(ValueError, match="text encoder"):
        load_adapters(te_diff, mapping, linears)

    # the CLI reports them as errors (exit status 2), not tracebacks
    base = _flux_base(tmp_path, model)
    assert lora_main(["merge", "--ckpt", base, "--lora", weights, "--out", str(tmp_path / "m.safetensors")]) == 2
    assert lora_main(["merge", "--ckpt", base, "--out", str(tmp_path / "m.safetensors")]) == 2

    # FILE[:STRENGTH]
    assert parse_lora_spec("a.safetensors:0.7") == ("a.safetensors", 0.7)
    assert parse_lora_spec("a.safetensors") == ("a.safetensors", 1.0)
    assert parse_lora_spec("a.safetensors:-1") == ("a.safetensors", -1.0)
    assert parse_lora_spec(r"C:\loras\style.safetensors") == (r"C:\loras\style.safetensors", 1.0)
    assert parse_lora_spec(r"C:\loras\style.safetensors:0.5") == (r"C:\loras\style.safetensors", 0.5)
    odd = tmp_path / "odd:2"  # an existing file whose name ends in :NUMBER is that file
    odd.write_bytes(b"")
    assert parse_lora_spec(str(odd)) == (str(odd), 1.0)
