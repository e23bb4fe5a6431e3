"""Sequence parallelism for video models on spawned gloo groups: VDiT (FastSeq, Ulysses over all T'·S tokens)
and Latte (DSP: frames split for spatial blocks, positions for temporal ones) equal the unsplit model.

Tolerances as tests/test_seq_parallel_dist.py (fp32: outputs atol 1e-5, gradients atol 2e-5 / rtol 1e-4): SP
changes only the order of floating-point sums; a real bug (a leaked padded frame or position, a wrong frame
order, a missing 1/P) is off by O(1) relative. Byte counts must equal opendit.parallel.plan's formulas exactly.
Geometries: 3 frames x 9 positions (neither divisible by 2 or 4: padded frames AND positions; at P = 4 one
rank holds only a padded frame) and 4 x 4 (divisible; at P = 4 one position per rank).
"""
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from opendit.families.video.latte import Latte
from opendit.families.video.vdit import VDiT
from opendit.parallel import (CommCounter, comm_bytes_per_layer, dsp_comm_bytes_per_block, enable_sequence_parallel,
                              gather_comm_bytes, validate_sp)
from tests.distributed import run_distributed
from tests.test_seq_parallel_dist import GRAD_TOL, OUT_TOL

D, B, DEPTH = 32, 2, 4
GEOMETRIES = {"3x9": (3, 6, 6), "4x4": (4, 4, 4)}  # input_size (T, H, W) with 2x2 patches: T' x S


def _build(cls, input_size, **kw):
    torch.manual_seed(0)
    patch = (1, 2, 2) if cls is VDiT else 2
    model = cls(input_size=input_size, patch_size=patch, hidden_size=D, depth=DEPTH, num_heads=4,
                class_dropout_prob=0.0, **kw)  # label dropout draws random numbers: keep them out
    with torch.no_grad():  # break adaLN-Zero's identity init so every path carries signal
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    return model


def _case(group, cls, kind, input_size, text=False):
    """Forward/backward with the same (replicated) loss on every rank; returns the SP output, the group SUM
    of the gradients, the unsplit reference and the bytes counted."""
    model = _build(cls, input_size, **(dict(text_dim=6) if text else dict(num_classes=10)))
    torch.manual_seed(1)
    x, t = torch.randn(B, 4, *input_size), torch.randint(0, 1000, (B,))
    cond = dict(text=torch.randn(B, 6)) if text else dict(y=torch.tensor([3, 7]))
    target = torch.randn(B, 8, *input_size)
    ref_model = copy.deepcopy(model)
    ref_out = ref_model(x, t, **cond)
    ((ref_out - target) ** 2).mean().backward()

    counter = CommCounter()
    enable_sequence_parallel(model, group, kind, counter)
    out = model(x, t, **cond)
    ((out - target) ** 2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():
        dist.all_reduce(g, group=group)  # the SUM over the group; the test checks SUM / P == unsplit
    ref = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
    return out.detach(), ref_out.detach(), grads, ref, dict(counter.bytes)


def _worker(rank, world_size):
    group = dist.group.WORLD
    res = {}
    for geo, size in GEOMETRIES.items():
        for kind in ("fastseq", "ulysses"):
            res["VDiT", kind, geo] = _case(group, VDiT, kind, size)
        res["Latte", "dsp", geo] = _case(group, Latte, "dsp", size)
    res["Latte", "dsp", "3x9 text"] = _case(group, Latte, "auto", GEOMETRIES["3x9"], text=True)
    try:
        enable_sequence_parallel(VDiT(input_size=(2, 2, 2), hidden_size=8, depth=1, num_heads=4), group, "dsp")
    except ValueError as e:
        res["vdit dsp error"] = str(e)
    return res


def _expected_bytes(kind, P, geo):
    """Analytic bytes per rank, forward + backward, of the whole model: its attention layers (FastSeq,
    Ulysses) or temporal blocks (DSP), plus the output gather (p*p*2C = 32 values per token)."""
    T, S = GEOMETRIES[geo][0], (GEOMETRIES[geo][1] // 2) * (GEOMETRIES[geo][2] // 2)
    if kind == "dsp":  # the gather is over frames, each S tokens wide
        return {"dsp": DEPTH // 2 * dsp_comm_bytes_per_block(P, T, S, D, B),
                "boundary": gather_comm_bytes(P, T, S * 32, B)}
    return {kind: DEPTH * comm_bytes_per_layer(kind, P, T * S, D, B), "boundary": gather_comm_bytes(P, T * S, 32, B)}


@pytest.mark.slow
@pytest.mark.parametrize("P", [2, 4])
def test_video_sp_equals_the_unsplit_model(P):
    results = run_distributed(_worker, P)
    for rank, res in enumerate(results):
        assert "'dsp' does not apply" in res.pop("vdit dsp error")
        for (name, kind, geo), (out, ref_out, grads, ref, sent) in res.items():
            where = f"{name} {kind} P={P} {geo} rank {rank}"
            torch.testing.assert_close(out, ref_out, **OUT_TOL, msg=lambda m: f"{where} output: {m}")
            assert grads.keys() == ref.keys(), where
            for n in ref:
                # Every rank's loss is the whole clip's loss: the group MEAN is the unsplit gradient.
                torch.testing.assert_close(grads[n] / P, ref[n], **GRAD_TOL, msg=lambda m: f"{where} {n}: {m}")
            expected = _expected_bytes(kind, P, geo.split()[0])
            got = {site: sum(v for k, v in sent.items() if k.startswith(site + ".")) for site in expected}
            assert got == expected and sum(sent.values()) == sum(expected.values()), (where, sent)


# ------------------------------------------------------------------------------------ planning, one process
def test_validate_sp_takes_the_models_kinds():
    assert validate_sp(8, 4, "auto", 6, kinds=Latte.parallel_plan.kinds) == "dsp"  # DSP: no head rule (6 heads, P=4)
    assert validate_sp(8, 8, "dsp", 16, kinds=Latte.parallel_plan.kinds) == "dsp"
    assert validate_sp(8, 2, "auto", 16, kinds=VDiT.parallel_plan.kinds) == "fastseq"
    assert validate_sp(8, 4, "auto", 16, kinds=VDiT.parallel_plan.kinds) == "ulysses"
    with pytest.raises(ValueError, match="dsp does not apply to this model; it supports \\('fastseq', 'ulysses'"):
        validate_sp(8, 2, "dsp", 16)  # the default kinds: a model that splits one token sequence
    with pytest.raises(ValueError, match="ulysses does not apply to this model; it supports \\('dsp', 'auto'\\)"):
        validate_sp(8, 2, "ulysses", 16, kinds=Latte.parallel_plan.kinds)
    with pytest.raises(ValueError, match="does not divide the world size"):
        validate_sp(6, 4, "dsp", 16, kinds=Latte.parallel_plan.kinds)


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_dsp_volume_is_a_quarter_of_ulysses_per_pair_of_blocks(P):
    T, S, Dm = 2 * P, 3 * P, 8 * P
    dsp = dsp_comm_bytes_per_block(P, T, S, Dm, backward=False)
    assert dsp * P * P == 2 * (P - 1) * T * S * Dm * 4  # two all-to-alls of (P-1)/P^2 of B T' S D e each
    assert 4 * dsp == 2 * comm_bytes_per_layer("ulysses", P, T * S, Dm, backward=False)
    assert dsp_comm_bytes_per_block(P, T - 1, S - 1, Dm) == 2 * dsp  # padded up; backward mirrors forward
    assert gather_comm_bytes(P, T - 1, 5, backward=False) == (P - 1) * 2 * 5 * 4  # (P-1) x this rank's chunk
    with pytest.raises(ValueError, match="dsp_comm_bytes_per_block"):
        comm_bytes_per_layer("dsp", P, T * S, Dm)


@pytest.mark.slow
def test_benchmark_cpu_mode_prints_the_video_table():
    """benchmarks/seq_parallel.py at a small size; it exits non-zero if a counted byte differs from the formula."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "seq_parallel.py"
    out = subprocess.run([sys.executable, str(script), "--seq_len", "9", "--hidden", "32", "--heads", "4",
                          "--sizes", "2", "--steps", "1", "--video_frames", "3", "--video_latent", "6"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 2 | ")]
    assert [r.split(" | ")[1:3] for r in rows[-3:]] == [["VDiT", "fastseq"], ["VDiT", "ulysses"], ["Latte", "dsp"]]
