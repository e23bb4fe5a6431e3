from pathlib import Path

import pytest
import torch

from opendit.families import all_models, build_model

SIZES = {"Ti": (12, 192, 3), "S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}


def analytic_params(depth, d, patch, input_size=32, c=4, classes=1000):
    """Parameter count written from the architecture, independent of the model code."""
    block = 18 * d * d + 15 * d  # qkv 3d^2+3d, proj d^2+d, mlp 8d^2+5d, adaLN 6d^2+6d
    embed = (patch * patch * c * d + d) + (256 * d + d + d * d + d) + (classes + 1) * d
    pos = (input_size // patch) ** 2 * d
    final = d * patch * patch * 2 * c + patch * patch * 2 * c + 2 * d * d + 2 * d
    return depth * block + embed + pos + final


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("patch", [2, 4, 8])
def test_parameter_counts_of_the_paper_configs_and_ti(size, patch):
    depth, d, heads = SIZES[size]
    with torch.device("meta"):
        model = build_model(f"DiT-{size}/{patch}", input_size=32)
    assert sum(p.numel() for p in model.parameters()) == analytic_params(depth, d, patch)


def test_xl2_is_675m_and_keys_equal_official_release():
    ref = {}
    for line in (Path(__file__).parent / "data" / "dit_xl2_256_state_dict.tsv").read_text().splitlines():
        if line and not line.startswith("#"):
            key, shape = line.split("\t")
            ref[key] = shape.strip()
    with torch.device("meta"):
        model = build_model("DiT-XL/2", input_size=32)
    sd = model.state_dict()
    assert sum(p.numel() for p in model.parameters()) == 675_129_632
    assert set(sd) == set(ref)
    assert {k: str(tuple(v.shape)) for k, v in sd.items()} == ref


def test_official_512_checkpoint_layout_loads_strict():
    with torch.device("meta"):
        model = build_model("DiT-XL/2", input_size=64)
    fake = {k: torch.empty(v.shape, device="meta") for k, v in model.state_dict().items()}
    assert fake["pos_embed"].shape == (1, 1024, 1152)
    model.load_state_dict(fake, strict=True, assign=True)


def test_forward_shapes_and_learned_sigma():
    model = build_model("DiT-debug", input_size=8, in_channels=3, num_classes=10)
    x, t, y = torch.randn(3, 3, 8, 8), torch.randint(0, 1000, (3,)), torch.tensor([0, 5, 9])
    assert model(x, t, y).shape == (3, 6, 8, 8)
    model = build_model("DiT-debug", input_size=8, in_channels=1, num_classes=10, learn_sigma=False)
    assert model(torch.randn(2, 1, 8, 8), t[:2], y[:2]).shape == (2, 1, 8, 8)


def test_adaln_zero_init_makes_output_zero_and_blocks_identity():
    model = build_model("DiT-debug", input_size=8, in_channels=3, num_classes=10)
    x, t, y = torch.randn(2, 3, 8, 8), torch.tensor([1, 500]), torch.tensor([1, 2])
    assert torch.count_nonzero(model(x, t, y)) == 0
    tokens, c = model.embed(x, t, y)
    assert torch.equal(model.blocks[0](tokens, c), tokens)


def test_label_dropout_uses_null_class_and_cfg_combines_halves():
    model = build_model("DiT-debug", input_size=8, in_channels=3, num_classes=10)
    assert model.y_embedder.embedding_table.num_embeddings == 11
    torch.manual_seed(0)
    dropped = model.y_embedder.token_drop(torch.zeros(10000, dtype=torch.long))
    assert 0.08 < (dropped == 10).float().mean() < 0.12
    for p in model.final_layer.parameters():
        torch.nn.init.normal_(p)
    model.eval()
    x = torch.randn(2, 3, 8, 8).repeat(2, 1, 1, 1)
    t, y = torch.full((4,), 10), torch.tensor([3, 4, 10, 10])
    out = model.forward_with_cfg(x, t, y, cfg_scale=4.0)
    full = model(x, t, y)
    expect = full[2:, :3] + 4.0 * (full[:2, :3] - full[2:, :3])
    torch.testing.assert_close(out[:2, :3], expect)
    torch.testing.assert_close(out[2:, :3], expect)
    torch.testing.assert_close(out[:, 3:], full[:, 3:])


def test_pos_embed_is_fixed_sincos():
    model = build_model("DiT-debug", input_size=8, in_channels=3, num_classes=10)
    pe = model.pos_embed
    assert not pe.requires_grad and pe.shape == (1, 16, 64)
    # column-encoding half: position (row 0, col 1) differs from (0, 0) only through the w half
    assert torch.allclose(pe[0, 0, 32:], pe[0, 1, 32:]) and not torch.allclose(pe[0, 0, :32], pe[0, 1, :32])
    assert torch.allclose(pe[0, 0, :16], torch.zeros(16)) and torch.allclose(pe[0, 0, 16:32], torch.ones(16))


def test_unknown_model_and_bad_sizes_give_clear_errors():
    with pytest.raises(ValueError, match="DiT-XL/2"):
        build_model("DiT-XXL/2")
    with pytest.raises(ValueError, match="not divisible by patch size"):
        build_model("DiT-S/8", input_size=12)
    dit = {name for name, spec in all_models().items() if spec.family == "dit"}  # other families may be registered
    assert len(dit) == 16  # the paper's 12, Ti/{2,4,8} and DiT-debug
