"""FLUX.1 transformer (opendit.families.flux.model) and its diffusers conversion.

- the state_dict equals the official flux1-dev / flux1-schnell releases key by key (tests/data/*.tsv, copied from
  the released safetensors headers), built on the meta device;
- packing, position ids, RoPE and the timestep embedding equal transcriptions of the official code;
- the whole forward equals diffusers' FluxTransformer2DModel (an independent implementation of the official
  math) on converted weights, with and without the guidance embedding; the conversion round-trips;
- Triton kernels (CPU interpreter) and activation-checkpointed blocks give the plain path's output and gradients;
- sequence parallelism (FastSeq, Ulysses; 2 and 4 gloo processes, text and image lengths divisible by neither)
  gives the unsplit output and gradients (tolerances of test_seq_parallel_dist.py).
"""
import copy
import math
import os

import einops
import pytest
import torch
import torch.distributed as dist

from opendit import kernels
from opendit.families.base import DiffusionModel, check_model_contract
from opendit.families.flux.model import (FLUX_CONFIGS, Flux, flux_timestep_embedding, image_ids, pack_latents,
                                         rope_freqs, text_ids, unpack_latents)
from opendit.families.flux.weights import FLUX_WEIGHTS
from opendit.kernels import set_kernels
from opendit.parallel import enable_sequence_parallel
from tests.distributed import run_distributed
from tests.test_seq_parallel_dist import GRAD_TOL, KINDS, OUT_TOL

DATA = os.path.join(os.path.dirname(__file__), "data")
# Dh = 32 / 4 = 8 = 2 + 2 + 4; 4 heads split over P = 2 and 4
TINY = dict(in_channels=8, vec_in_dim=6, context_in_dim=12, hidden_size=32, num_heads=4, depth=1,
            depth_single_blocks=1, axes_dim=(2, 2, 4), mlp_ratio=4.0, theta=10000, qkv_bias=True, guidance_embed=True)
B, N_TXT, LATENT = 2, 5, 6  # 9 image tokens: neither 5 nor 9 divides by 2 or 4


def tiny_flux(seed=0, **kw):
    """Random weights everywhere (the adaLN-Zero init would hide every block and mapping error)."""
    torch.manual_seed(seed)
    model = Flux(**{**TINY, **kw})
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith(".scale") else 0.1 * torch.randn_like(p))
    return model


def flux_inputs(seed=1, batch=B, n_txt=N_TXT, latent=LATENT, cfg=TINY):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, cfg["in_channels"] // 4, latent, latent, generator=g)
    return dict(img=pack_latents(z), img_ids=image_ids(batch, latent, latent),
                txt=torch.randn(batch, n_txt, cfg["context_in_dim"], generator=g), txt_ids=text_ids(batch, n_txt),
                timesteps=torch.rand(batch, generator=g), y=torch.randn(batch, cfg["vec_in_dim"], generator=g),
                guidance=1 + 4 * torch.rand(batch, generator=g))


# ------------------------------------------------------------------------------------- official layout
def _read_tsv(name):
    rows = []
    with open(os.path.join(DATA, name)) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                key, shape = line.rstrip("\n").split("\t")
                rows.append((key, tuple(int(s) for s in shape.strip("()[]").split(",") if s.strip())))
    return rows


@pytest.mark.parametrize("name, tsv, params", [("flux-dev", "flux1-dev_state_dict.tsv", 11_901_408_320),
                                               ("flux-schnell", "flux1-schnell_state_dict.tsv", None)])
def test_state_dict_equals_official_release(name, tsv, params):
    expected = _read_tsv(tsv)
    with torch.device("meta"):
        model = Flux(**FLUX_CONFIGS[name])
    assert [(k, tuple(v.shape)) for k, v in model.state_dict().items()] == expected
    if params is not None:
        assert sum(p.numel() for p in model.parameters()) == params
    model.load_state_dict({k: torch.empty(s, device="meta") for k, s in expected}, strict=True, assign=True)
    check_model_contract(model, name)
    assert isinstance(model, DiffusionModel)


def test_pack_unpack_and_ids_follow_official_prepare():
    z = torch.randn(2, 3, 4, 6)
    packed = pack_latents(z)
    assert torch.equal(packed, einops.rearrange(z, "b c (h ph) (w pw) -> b (h w) (c ph pw)", ph=2, pw=2))
    assert torch.equal(unpack_latents(packed, 4, 6), z)
    with pytest.raises(ValueError, match="even"):
        pack_latents(torch.randn(1, 3, 5, 6))
    with pytest.raises(ValueError, match="do not pack"):
        unpack_latents(packed, 4, 8)
    # official prepare(): zeros (h/2, w/2, 3); [..., 1] += row; [..., 2] += col; "h w c -> b (h w) c"
    ref = torch.zeros(2, 3, 3)
    ref[..., 1] += torch.arange(2)[:, None]
    ref[..., 2] += torch.arange(3)[None, :]
    assert torch.equal(image_ids(2, 4, 6), einops.repeat(ref, "h w c -> b (h w) c", b=2))
    assert torch.equal(text_ids(2, 7), torch.zeros(2, 7, 3))


def _official_rope(ids, axes_dim, theta):
    """flux/math.py rope + EmbedND: [B, 1, L, Dh/2, 2, 2] rotation matrices."""
    def rope(pos, dim):
        scale = torch.arange(0, dim, 2, dtype=torch.float64) / dim
        out = torch.einsum("...n,d->...nd", pos, 1.0 / theta ** scale)
        out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
        return einops.rearrange(out, "b n d (i j) -> b n d i j", i=2, j=2).float()
    return torch.cat([rope(ids[..., i], d) for i, d in enumerate(axes_dim)], dim=-3).unsqueeze(1)


def test_rope_and_timestep_embedding_equal_official():
    ids = torch.cat([text_ids(2, 3), image_ids(2, 8, 6) * 97.5 + 0.25], dim=1)  # large angles: float64 matters
    axes = (4, 6, 6)
    x = torch.randn(2, 3, ids.shape[1], sum(axes))
    freqs = _official_rope(ids, axes, 10000)
    x_ = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    official = (freqs[..., 0] * x_[..., 0] + freqs[..., 1] * x_[..., 1]).reshape(*x.shape)
    pe = rope_freqs(ids, axes, 10000)
    torch.testing.assert_close(kernels.apply_rope(x, pe.real, pe.imag), official, atol=1e-6, rtol=0)
    # official timestep_embedding(t, 256) with time_factor 1000
    t = torch.tensor([0.0, 0.25, 1.0])
    freqs = torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float32) / 128)
    args = (1000.0 * t)[:, None] * freqs[None]
    torch.testing.assert_close(flux_timestep_embedding(t, 256), torch.cat([args.cos(), args.sin()], -1))


def test_fresh_model_predicts_zero_and_guidance_is_required():
    model = Flux(**TINY)
    inp = flux_inputs()
    assert torch.equal(model(**inp), torch.zeros(B, LATENT * LATENT // 4, 8))
    with pytest.raises(ValueError, match="guidance"):
        model(**{**inp, "guidance": None})
    schnell = Flux(**{**TINY, "guidance_embed": False})
    assert "guidance_in.in_layer.weight" not in schnell.state_dict()
    assert schnell(**{**inp, "guidance": None}).shape == (B, 9, 8)
    with pytest.raises(ValueError, match="img_ids"):
        model(**{**inp, "img_ids": inp["img_ids"][:, :4]})
    debug = Flux(in_channels=8, vec_in_dim=6, context_in_dim=12, **FLUX_CONFIGS["flux-debug"])
    assert debug(**inp).shape == (B, 9, 8)


def _run(model, inp, target):
    inp = {k: (v.clone().requires_grad_() if k in ("img", "txt", "y") else v) for k, v in inp.items()}
    out = model(**inp)
    ((out - target) ** 2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads.update({k: inp[k].grad for k in ("img", "txt", "y")})
    return out.detach(), grads


def _assert_close(a, b, tol, what):
    for n in b:
        torch.testing.assert_close(a[n], b[n], **tol, msg=lambda m: f"{what} {n}: {m}")


def test_kernels_and_checkpointed_blocks_equal_plain_path(one_thread):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    inp, target = flux_inputs(), torch.randn(B, 9, 8)
    ref_out, ref_grads = _run(tiny_flux(), inp, target)
    assert ref_out.abs().mean() > 0.1
    assert kernels._why_not_kernel(ref_out) is None, "the Triton path would not run (TRITON_INTERPRET / triton)"
    for modulate, layernorm in ((True, False), (False, True)):
        model = tiny_flux()
        set_kernels(model, modulate=modulate, layernorm=layernorm, attn_backend="math")
        out, grads = _run(model, inp, target)
        tol = dict(atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(out, ref_out, **tol)
        _assert_close(grads, ref_grads, tol, f"kernels modulate={modulate} layernorm={layernorm}")
    model = tiny_flux()
    for name in model._block_lists:
        blocks = getattr(model, name)
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block)
    out, grads = _run(model, inp, target)
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    _assert_close({n.replace("_checkpoint_wrapped_module.", ""): g for n, g in grads.items()}, ref_grads,
                  dict(atol=0, rtol=0), "checkpointed")


@torch.no_grad()
def test_forward_with_cfg_and_shared_ids():
    model = tiny_flux()
    inp = flux_inputs(batch=4)
    inp["img"] = torch.cat([inp["img"][:2], torch.randn_like(inp["img"][:2])])  # the uncond half's img is ignored
    out = model.forward_with_cfg(**inp, cfg_scale=3.0)
    first = {k: (v if "ids" in k else torch.cat([v[:2], v[:2]])) for k, v in inp.items() if k != "img"}
    both = model(torch.cat([inp["img"][:2]] * 2), **first)
    plain = model(**{**inp, "img": torch.cat([inp["img"][:2]] * 2)})
    cond, uncond = plain.chunk(2)
    torch.testing.assert_close(out, torch.cat([uncond + 3.0 * (cond - uncond)] * 2))
    torch.testing.assert_close(both.chunk(2)[0], cond)
    # ids shared by the batch ([L, 3] or [1, L, 3]) give the per-sample ids' result
    shared = model(**{**inp, "img_ids": inp["img_ids"][0], "txt_ids": inp["txt_ids"][:1]})
    torch.testing.assert_close(shared, model(**inp), atol=0, rtol=0)


# --------------------------------------------------------------------------------------------- diffusers
def _peer(guidance: bool):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(2)
    peer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=24, guidance_embeds=guidance, axes_dims_rope=(4, 6, 6))
    with torch.no_grad():  # random everywhere (q/k RMSNorm weights around 1), as tiny_flux
        for name, p in peer.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if ".attn.norm_" in name else 0.1 * torch.randn_like(p))
    return peer.eval()


@pytest.mark.parametrize("guidance", [True, False])
@torch.no_grad()
def test_converted_diffusers_weights_give_the_same_output(guidance):
    peer = _peer(guidance)
    kwargs = FLUX_WEIGHTS.arch_from_diffusers(peer.config)
    assert kwargs["guidance_embed"] is guidance and kwargs["hidden_size"] == 32 and kwargs["out_channels"] == 16
    ours = Flux(**kwargs).eval()
    theirs = peer.state_dict()
    ours.load_state_dict(FLUX_WEIGHTS.from_diffusers(theirs), strict=True)
    inp = flux_inputs(seed=3, n_txt=7, latent=8, cfg=kwargs)
    if not guidance:
        inp["guidance"] = None
    expected = peer(hidden_states=inp["img"], encoder_hidden_states=inp["txt"], pooled_projections=inp["y"],
                    timestep=inp["timesteps"], img_ids=inp["img_ids"][0], txt_ids=inp["txt_ids"][0],
                    guidance=inp["guidance"], return_dict=False)[0]
    got = ours(**inp)
    assert expected.abs().mean() > 0.1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # round trips are the identity, key by key
    back = FLUX_WEIGHTS.to_diffusers(ours.state_dict())
    assert back.keys() == theirs.keys() and all(torch.equal(back[k], theirs[k]) for k in theirs)
    again = FLUX_WEIGHTS.from_diffusers(back)
    assert again.keys() == ours.state_dict().keys()
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())


def test_conversion_errors_name_the_key():
    sd = tiny_flux().state_dict()
    with pytest.raises(KeyError, match="single_blocks.0.linear1.bias"):
        FLUX_WEIGHTS.to_diffusers({k: v for k, v in sd.items() if k != "single_blocks.0.linear1.bias"})
    with pytest.raises(ValueError, match="lora"):
        FLUX_WEIGHTS.to_diffusers({**sd, "double_blocks.0.img_attn.qkv.lora_A.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match="model.diffusion_model"):
        FLUX_WEIGHTS.to_diffusers({f"model.diffusion_model.{k}": v for k, v in sd.items()})
    with pytest.raises(ValueError, match="FluxTransformer2DModel"):
        FLUX_WEIGHTS.arch_from_diffusers({"_class_name": "SD3Transformer2DModel"})


# ------------------------------------------------------------------------------------ sequence parallelism
def _sp_case(group, kind, checkpoint):
    """Unsplit vs split forward/backward of a whole tiny Flux; the same (replicated) loss on every rank."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model, inp, target = tiny_flux(), flux_inputs(), torch.randn(B, 9, 8)
    ref = _run(copy.deepcopy(model), inp, target)
    enable_sequence_parallel(model, group, kind)
    if checkpoint:  # the recompute re-runs the collectives and reads the shared segment lengths again
        for name in model._block_lists:
            blocks = getattr(model, name)
            for i, block in enumerate(blocks):
                blocks[i] = checkpoint_wrapper(block)
    out, grads = _run(model, inp, target)
    grads = {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in grads.items()}
    for g in grads.values():
        dist.all_reduce(g, group=group)  # the SUM over the group; the test checks SUM / P == unsplit
    return (out, grads), ref


def _sp_worker(rank, world_size):
    return {(kind, ckpt): _sp_case(dist.group.WORLD, kind, ckpt) for kind in KINDS for ckpt in (False, True)}


@pytest.mark.slow
@pytest.mark.parametrize("P", [2, 4])
def test_sequence_parallel_equals_unsplit(P):
    for rank, res in enumerate(run_distributed(_sp_worker, P)):
        for (kind, ckpt), ((out, grads), (ref_out, ref_grads)) in res.items():
            where = f"flux {kind} checkpoint={ckpt} P={P} rank {rank}"
            torch.testing.assert_close(out, ref_out, **OUT_TOL, msg=lambda m: f"{where} output: {m}")
            assert grads.keys() == ref_grads.keys()
            # every rank's loss is the whole loss: the group's SUM is P times the unsplit gradient
            _assert_close({n: g / P for n, g in grads.items()}, ref_grads, GRAD_TOL, where + " grad")
