"""Video models (VDiT, Latte): official layouts, equivalence with the official Latte forward, conditioning, FLOPs.

Tolerances: our Latte runs the official forward's ops in the same order on the same shapes, so it is checked
bitwise (torch.equal); everything else compares layouts exactly or integer counts exactly.
"""
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from opendit.families import check_model_contract
from opendit.families.video.family import video_forward_macs, video_train_flops_per_sample
from opendit.families.video.latte import Latte
from opendit.families.video.vdit import VDiT
from opendit.kernels import set_kernels
from opendit.models.pos_embed import sincos_1d, sincos_2d
from opendit.parallel import enable_sequence_parallel

TINY = dict(hidden_size=32, num_heads=4, depth=4)


def _randomize(model):
    """Break adaLN-Zero's identity init so every path carries signal (the sin-cos tables stay)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    return model


# ------------------------------------------------------------------------------------ Latte: official layout
def test_latte_xl2_state_dict_equals_the_official_checkpoint():
    ref = []
    for line in (Path(__file__).parent / "data" / "latte_xl2_ucf101_state_dict.tsv").read_text().splitlines():
        if line and not line.startswith("#"):
            key, shape = line.split("\t")
            ref.append((key, tuple(int(v) for v in shape.strip(" ()").split(",") if v.strip())))
    with torch.device("meta"):
        model = Latte(input_size=(16, 32, 32), patch_size=2, num_classes=101)  # XL/2 defaults
    sd = model.state_dict()
    assert [(k, tuple(v.shape)) for k, v in sd.items()] == ref  # same keys, shapes and order
    assert sum(p.numel() for p in model.parameters()) == 674_112_416
    assert not model.pos_embed.requires_grad and not model.temp_embed.requires_grad
    model.load_state_dict({k: torch.empty(s, device="meta") for k, s in ref}, strict=True, assign=True)
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict({k: torch.empty(s, device="meta") for k, s in ref[1:]}, strict=True, assign=True)


def _official_latte_forward(m, x, t, y=None):
    """Vchitect/Latte models/latte.py Latte.forward (extras=2 with y, extras=1 without) on our modules, its
    einops rearranges written as reshape/permute. x [B, F, C, H, W] -> [B, F, C_out, H, W]."""
    batches, frames, channels, high, width = x.shape
    x = x.reshape(batches * frames, channels, high, width)  # 'b f c h w -> (b f) c h w'
    x = m.x_embedder(x) + m.pos_embed
    t = m.t_embedder(t)
    timestep_spatial = t.repeat_interleave(m.temp_embed.shape[1], dim=0)  # repeat 'n d -> (n c) d'
    timestep_temp = t.repeat_interleave(m.pos_embed.shape[1], dim=0)
    if y is not None:
        y = m.y_embedder(y, m.training)
        y_spatial = y.repeat_interleave(m.temp_embed.shape[1], dim=0)
        y_temp = y.repeat_interleave(m.pos_embed.shape[1], dim=0)
    for i in range(0, len(m.blocks), 2):
        spatial_block, temp_block = m.blocks[i:i + 2]
        c = timestep_spatial + y_spatial if y is not None else timestep_spatial
        x = spatial_block(x, c)
        bf, tok, d = x.shape  # '(b f) t d -> (b t) f d'
        x = x.reshape(batches, bf // batches, tok, d).permute(0, 2, 1, 3).reshape(batches * tok, bf // batches, d)
        if i == 0:
            x = x + m.temp_embed
        c = timestep_temp + y_temp if y is not None else timestep_temp
        x = temp_block(x, c)
        bt, f, d = x.shape  # '(b t) f d -> (b f) t d'
        x = x.reshape(batches, bt // batches, f, d).permute(0, 2, 1, 3).reshape(batches * f, bt // batches, d)
    c = timestep_spatial + y_spatial if y is not None else timestep_spatial
    x = m.final_layer(x, c)
    c, p = m.out_channels, m.x_embedder.patch_size  # unpatchify
    h = w = int(x.shape[1] ** 0.5)
    x = torch.einsum("nhwpqc->nchpwq", x.reshape(x.shape[0], h, w, p, p, c))
    imgs = x.reshape(x.shape[0], c, h * p, h * p)
    return imgs.reshape(batches, frames, c, h * p, h * p)  # '(b f) c h w -> b f c h w'


@pytest.mark.parametrize("labels", [True, False])
def test_latte_equals_the_official_forward(labels):
    model = _randomize(Latte(input_size=(3, 8, 8), num_classes=10 if labels else 0, **TINY)).eval()
    torch.manual_seed(1)
    x, t = torch.randn(2, 4, 3, 8, 8), torch.tensor([3, 700])
    y = torch.tensor([1, 10]) if labels else None  # 10: the null class
    with torch.no_grad():
        ours = model(x, t, y=y)  # [B, C, T, H, W]
        ref = _official_latte_forward(model, x.transpose(1, 2), t, y)  # [B, F, C, H, W]
    assert ours.shape == (2, 8, 3, 8, 8)
    assert torch.equal(ours, ref.transpose(1, 2))


def test_latte_adds_the_temporal_table_after_the_first_spatial_block_only():
    model = _randomize(Latte(input_size=(3, 8, 8), num_classes=10, **TINY)).eval()
    x, t, y = torch.randn(2, 4, 3, 8, 8), torch.tensor([3, 700]), torch.tensor([1, 2])
    with torch.no_grad():
        before = model(x, t, y=y)
        model.temp_embed.mul_(2)  # a table the forward ignored (or added at the input) would not matter
        assert not torch.equal(model(x, t, y=y), before)
    expected = sincos_1d(32, np.arange(3, dtype=np.float64))
    assert torch.equal(Latte(input_size=(3, 8, 8), **TINY).temp_embed[0], torch.from_numpy(expected).float())


# -------------------------------------------------------------------------------------------------- VDiT
def test_vdit_positions_are_opendits_spatial_plus_temporal():
    model = VDiT(input_size=(3, 4, 6), patch_size=(1, 2, 2), **TINY)
    S, T = 2 * 3, 3
    assert model.pos_embed_spatial.shape == (1, S, 32) and model.pos_embed_temporal.shape == (1, T, 32)
    assert not model.pos_embed_spatial.requires_grad and not model.pos_embed_temporal.requires_grad
    # A 2 x 3 grid: row r, column c has the square table's (r, c) embedding.
    square = sincos_2d(32, 3).view(3, 3, 32)
    assert torch.equal(model.pos_embed_spatial[0].view(2, 3, 32), square[:2, :3])
    x = torch.randn(2, 4, 3, 4, 6)
    patches = model.x_embedder(x)  # [B, T*S, D]
    # OpenDiT: "b (t s) d -> b t s d", + spatial, "b t s d -> b s t d", + temporal, back to "b (t s) d"
    ref = patches.reshape(2, T, S, 32) + model.pos_embed_spatial
    ref = (ref.permute(0, 2, 1, 3) + model.pos_embed_temporal).permute(0, 2, 1, 3).reshape(2, T * S, 32)
    assert torch.equal(model.embed(x), ref)


def test_vdit_unpatchify_puts_each_value_in_its_voxel():
    model = VDiT(input_size=(4, 4, 6), patch_size=(2, 2, 3), in_channels=2, **TINY)  # grid (2, 2, 2), C_out 4
    (gt, gh, gw), (pt, ph, pw), C = model.grid, model.patch_size, model.out_channels
    tokens = torch.randn(2, gt * gh * gw, pt * ph * pw * C)
    out = model.unpatchify(tokens, model.grid)
    assert out.shape == (2, C, 4, 4, 6)
    for it, ih, iw, a, b, cc, c in [(0, 0, 0, 0, 0, 0, 0), (1, 0, 1, 1, 1, 2, 3), (1, 1, 0, 0, 1, 1, 2)]:
        token, value = (it * gh + ih) * gw + iw, ((a * ph + b) * pw + cc) * C + c
        assert out[1, c, it * pt + a, ih * ph + b, iw * pw + cc] == tokens[1, token, value]


def test_vdit_text_conditioning_and_shapes():
    model = _randomize(VDiT(input_size=(2, 4, 4), text_dim=12, in_channels=3, learn_sigma=False, **TINY))
    assert not hasattr(model, "y_embedder") and model.text_embedder.in_features == 12
    x, t = torch.randn(2, 3, 2, 4, 4), torch.tensor([5, 5])
    text = torch.randn(2, 12)
    out = model(x, t, text=text)
    assert out.shape == (2, 3, 2, 4, 4)
    assert not torch.equal(model(x, t, text=text.flip(0)), out)


# ------------------------------------------------------------------------------------------ both models
MODELS = [(VDiT, dict(input_size=(3, 4, 4), patch_size=(1, 2, 2))), (Latte, dict(input_size=(3, 4, 4), patch_size=2))]


@pytest.mark.parametrize("cls, geo", MODELS)
def test_init_is_adaln_zero_and_the_model_meets_the_contract(cls, geo):
    model = cls(**geo, num_classes=10, **TINY)
    check_model_contract(model, cls.__name__)
    out = model(torch.randn(2, 4, 3, 4, 4), torch.tensor([1, 2]), y=torch.tensor([0, 1]))
    assert out.shape == (2, 8, 3, 4, 4) and not out.any()  # the final layer starts at zero
    assert model.input_size == (3, 4, 4) and model.out_channels == 8


@pytest.mark.parametrize("cls, geo", MODELS)
def test_forward_with_cfg_guides_eps_and_keeps_the_conditional_variance(cls, geo):
    model = _randomize(cls(**geo, num_classes=10, **TINY)).eval()
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))  # dtype hooks run through __call__ as well
    x, t, y = torch.randn(2, 4, 3, 4, 4), torch.tensor([9, 9]), torch.tensor([3, 10])
    with torch.no_grad():
        guided = model.forward_with_cfg(x, t, 4.0, y=y)
        out = model(torch.cat([x[:1], x[:1]]), t, y=y)
    assert len(calls) == 2
    eps = out[1:, :4] + 4.0 * (out[:1, :4] - out[1:, :4])
    torch.testing.assert_close(guided[:, :4], torch.cat([eps, eps]), atol=0, rtol=0)
    assert torch.equal(guided[:, 4:], out[:, 4:])


@pytest.mark.parametrize("cls, geo", MODELS)
def test_label_dropout_and_conditioning_errors(cls, geo):
    model = _randomize(cls(**geo, num_classes=10, class_dropout_prob=1.0, **TINY))
    x, t = torch.randn(2, 4, 3, 4, 4), torch.tensor([1, 2])
    with torch.no_grad():  # training: every label dropped to the null class 10
        assert torch.equal(model.train()(x, t, y=torch.tensor([0, 1])), model.eval()(x, t, y=torch.tensor([10, 10])))
    with pytest.raises(ValueError, match="pass y"):
        model(x, t)
    with pytest.raises(ValueError, match="multiples of its patch"):
        model(torch.randn(2, 4, 2, 4, 5), t, y=t)
    with pytest.raises(ValueError, match="text_dim=5: pass text"):
        cls(**geo, text_dim=5, **TINY)(x, t, y=t)
    with pytest.raises(ValueError, match="unconditional"):
        cls(**geo, num_classes=0, **TINY)(x, t, y=t)


def test_geometry_errors_name_the_fix():
    with pytest.raises(ValueError, match="divisible by patch_size"):
        VDiT(input_size=(3, 4, 4), patch_size=(2, 2, 2), **TINY)
    with pytest.raises(ValueError, match="divisible by patch_size"):
        Latte(input_size=(3, 6, 6), patch_size=4, **TINY)
    with pytest.raises(ValueError, match="must be even"):
        Latte(input_size=(3, 4, 4), **{**TINY, "depth": 3})
    with pytest.raises(ValueError, match="use 'dsp' or 'auto'"):
        enable_sequence_parallel(Latte(input_size=(3, 4, 4), **TINY), None, "ulysses")


# ------------------------------------------------------------------------------------------------- FLOPs
def test_video_flops_equal_a_hand_count():
    D, T, S, depth, C, C_out, text = 32, 3, 4, 4, 4, 8, 12  # 3 frames of 2x2 patches, learned sigma
    N, block = T * S, 3 * D * D + D * D + 2 * 4 * D * D  # qkv, proj, fc1, fc2 per token
    per_sample = 256 * D + D * D + text * D + depth * 6 * D * D + 2 * D * D  # t MLP, text, adaLN x blocks + final
    common = N * (C * 4 * D) + per_sample + depth * N * block + N * D * (4 * C_out)  # patch conv, final linear
    vdit = VDiT(input_size=(T, 4, 4), patch_size=(1, 2, 2), text_dim=text, **TINY)
    latte = Latte(input_size=(T, 4, 4), text_dim=text, **TINY)
    assert video_forward_macs(vdit) == common + depth * 2 * N * N * D  # one sequence of T*S
    # spatial blocks: T sequences of S; temporal: S sequences of T
    assert video_forward_macs(latte) == common + depth // 2 * (T * 2 * S * S * D + S * 2 * T * T * D)
    assert video_train_flops_per_sample(latte) == 6 * video_forward_macs(latte)
    with pytest.raises(ValueError, match="dit_forward_macs"):
        video_forward_macs(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("cls, geo", MODELS)
def test_video_flops_equal_torch_flop_counter(cls, geo):
    """FlopCounterMode sees every matmul (math attention). Latte runs the adaLN modulation per frame (spatial
    blocks, final layer) and per position (temporal blocks), which the model-FLOP count takes once per clip."""
    model = cls(**geo, num_classes=10, **TINY)
    set_kernels(model, attn_backend="math")
    B, D, T, S = 2, 32, 3, 4
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randn(B, 4, 3, 4, 4), torch.tensor([1, 2]), y=torch.tensor([0, 1]))
    repeated = 0 if cls is VDiT else 2 * (T - 1) * 6 * D * D + 2 * (S - 1) * 6 * D * D + (T - 1) * 2 * D * D
    assert counter.get_total_flops() == 2 * B * (video_forward_macs(model) + repeated)


def test_xl_models_cost_per_training_clip():
    """16 frames of 32x32 latents (256x256 px): Latte-XL/2 and VDiT-XL/1x2x2, 4,096 tokens each."""
    with torch.device("meta"):
        latte, vdit = Latte(num_classes=101), VDiT(num_classes=101)
    assert round(video_train_flops_per_sample(latte) / 1e12, 2) == 11.18
    assert round(video_train_flops_per_sample(vdit) / 1e12, 2) == 17.46  # full attention over 4,096 tokens
