"""Sequence-parallel planning on one process: flag validation, default method, analytic volumes.

The multi-rank equivalence tests are in test_seq_parallel_dist.py.
"""
import copy

import pytest
import torch

from opendit.families.dit.model import DiT
from opendit.models.layers import Attention
from opendit.parallel import comm_bytes_per_layer, default_sp_kind, enable_sequence_parallel, padded_len, validate_sp


def test_validate_sp_resolves_auto_and_keeps_explicit_kinds():
    assert validate_sp(8, 2, "auto", 16) == "fastseq"
    assert validate_sp(8, 4, "auto", 16) == "ulysses"
    assert validate_sp(8, 8, "fastseq", 16) == "fastseq"
    assert validate_sp(4, 2, "ulysses", 6) == "ulysses"
    assert validate_sp(3, 1, "auto", 5) == "fastseq"  # size 1: SP off, any head count


@pytest.mark.parametrize("world, sp, kind, heads, words", [
    (6, 4, "ulysses", 16, "does not divide the world size 6"),
    (8, 4, "ulysses", 6, "does not divide the model's 6 attention heads"),
    (8, 2, "ring", 16, "'ring' is unknown"),
    (8, 0, "fastseq", 16, "positive integer"),
])
def test_validate_sp_names_the_bad_input(world, sp, kind, heads, words):
    with pytest.raises(ValueError, match=words):
        validate_sp(world, sp, kind, heads)


def test_head_error_lists_the_sizes_that_work():
    with pytest.raises(ValueError) as e:
        validate_sp(8, 4, "fastseq", 6)
    assert "[1, 2]" in str(e.value)


def test_padded_len():
    assert [padded_len(n, 4) for n in (1, 4, 9, 16)] == [4, 4, 12, 16]


@pytest.mark.parametrize("P", [2, 3, 4, 6, 8])
def test_volumes_follow_the_closed_form_and_default_picks_the_smaller(P):
    N, D = 48 * P, 24 * P
    fast = comm_bytes_per_layer("fastseq", P, N, D, backward=False)
    ulys = comm_bytes_per_layer("ulysses", P, N, D, backward=False)
    # FastSeq: (P-1)/P + (P-1)/P^2 of N*D*4 bytes; Ulysses: 4 (P-1)/P^2. Their ratio is (P+1)/4.
    assert fast * 4 == ulys * (P + 1)
    assert fast * P * P == (P - 1) * (P + 1) * N * D * 4
    assert comm_bytes_per_layer("ulysses", P, N, D) == 2 * ulys  # backward mirrors forward
    chosen = {"fastseq": fast, "ulysses": ulys}[default_sp_kind(P)]
    assert chosen == min(fast, ulys)


def test_volume_counts_padding_and_rejects_unknown_kind():
    assert comm_bytes_per_layer("ulysses", 4, 9, 8) == comm_bytes_per_layer("ulysses", 4, 12, 8)
    with pytest.raises(ValueError, match="unknown"):
        comm_bytes_per_layer("ring", 2, 8, 8)


def test_dit_without_sp_is_untouched_and_can_be_turned_off():
    torch.manual_seed(0)
    model = DiT(input_size=8, hidden_size=32, depth=1, num_heads=4, num_classes=10).eval()
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([1, 500]), torch.tensor([0, 9])
    before = model(x, t, y)
    assert enable_sequence_parallel(model, None) is None
    assert all(m.sequence_parallel is None for m in model.modules() if isinstance(m, Attention))
    assert torch.equal(model(x, t, y), before)
    assert torch.equal(copy.deepcopy(model)(x, t, y), before)


def test_docs_plan_table_matches_what_models_declare():
    """docs/sequence_parallel.md's table of plans is the models' own `parallel_plan`; no model codes a switch."""
    from pathlib import Path

    from opendit.families.flux.model import Flux
    from opendit.families.video.latte import Latte
    from opendit.families.video.vdit import VDiT
    from opendit.families.wan.model import WanModel

    text = (Path(__file__).resolve().parents[1] / "docs" / "sequence_parallel.md").read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ") and line.count("|") == 6}
    for name, cls in (("DiT", DiT), ("VDiT", VDiT), ("Latte", Latte), ("FLUX", Flux), ("Wan2.1", WanModel)):
        plan = cls.parallel_plan
        kinds, _, split, replicated = rows[name]
        assert kinds == ", ".join(plan.kinds) and split == ", ".join(plan.split), name
        assert replicated == ", ".join(plan.replicated), name
        assert not {"enable_sequence_parallel", "set_kernels"} & set(vars(cls)), f"{name} hand-writes a switch"
    from opendit.families import FAMILIES
    for glue in (f.glue for f in FAMILIES.values() if hasattr(f, "glue")):  # every diffusers-transformer family
        plan = glue.parallel_plan
        kinds, _, split, replicated = rows[glue.title]
        if plan is None:
            assert kinds == "none", glue.title
            continue
        assert (kinds, split, replicated) == tuple(", ".join(v) for v in (plan.kinds, plan.split, plan.replicated))


def test_a_model_without_a_plan_names_the_fix():
    with pytest.raises(TypeError, match="declares no parallel_plan.*--sequence_parallel_size 1"):
        enable_sequence_parallel(torch.nn.Linear(2, 2), None)
    model = DiT(input_size=8, hidden_size=32, depth=1, num_heads=4, num_classes=10)
    with pytest.raises(ValueError, match="type 'dsp' does not apply; use 'fastseq' or 'ulysses' or 'auto'"):
        enable_sequence_parallel(model, None, "dsp")
