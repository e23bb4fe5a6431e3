"""Host memory of the weight paths that stream tensor by tensor: reading a bf16 file into an fp32 model
(--init_weights under --master_weights fp32), a LoRA run's set-up on a bf16 base (its frozen Linears read as stored),
exporting the EMA (export_ema), and merging a LoRA or a LoKr file into
the base (python -m opendit.lora merge). Each runs in a fresh process through benchmarks/host_memory.py's own path,
on a 640 MB bf16 base, and may grow the process's peak RSS by at most 1.3x the bytes of the weights it handles.

Why 1.3x: a streamed path holds the weights once, plus about one tensor at a time (the largest here, a 29 MB fp32
update, is 5% of the base) and the allocator's slack (about 0.1 GB whatever the base); each regression this guards
against holds a second copy of the weights (measured on the code before the fix: 1.5x for the fp32 read,
3.0x for the LoRA set-up, 2.0x for the export, 5x for the merges). The growth is counted from the process's RSS just
before the path (after its imports and set-up), so a process's own RSS noise is well under 10% of the base."""
import sys

import pytest

from benchmarks.bench_common import write_zero_base
from benchmarks.host_memory import MODEL, run_child, write_adapters

ARCH = dict(hidden_size=1024, num_heads=8, depth=4, depth_single_blocks=10)  # 319M parameters: 640 MB in bf16


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("host_memory")
    write_zero_base(work / "base.safetensors", MODEL, **ARCH)
    write_adapters(work, ARCH)
    return work


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process's RSS from /proc/self/status")
@pytest.mark.parametrize("path", ["single_fp32", "lora_setup", "export", "merge_lora", "merge_lokr"])
def test_a_weight_path_holds_its_weights_once(work, path):
    result = run_child(path, work, ARCH)
    assert result["bytes"] > 250e6  # the base is large enough for the RSS noise of a process not to matter
    assert result["growth"] <= 1.3 * result["bytes"], (
        f"{path} grew the host memory by {result['growth'] / 1e6:.0f} MB handling {result['bytes'] / 1e6:.0f} MB of "
        f"weights ({result['growth'] / result['bytes']:.2f}x): it holds a second copy; python "
        f"benchmarks/host_memory.py measures every path")


def test_a_lora_run_reading_its_frozen_linears_as_stored_ends_with_the_same_weights(tmp_path):
    """lora.run.kept_as_stored: the Linears a LoRA run stores in bf16 may be read as a bf16 file stores them (never
    held in fp32, twice the base's bytes); after adapt_model every weight is bitwise what the fp32 read gives."""
    import types

    import torch

    from opendit.checkpoint import load_into_meta_model
    from opendit.checkpoint.folders import write_safetensors
    from opendit.families import family_of
    from opendit.lora.run import adapt_model, kept_as_stored

    family, arch = family_of(MODEL), dict(hidden_size=64, num_heads=4, axes_dim=(4, 6, 6), depth=1,
                                          depth_single_blocks=1, context_in_dim=32, vec_in_dim=16)
    cfg = types.SimpleNamespace(lora_targets=None, lora_rank=4, lora_alpha=None, lora_dropout=0.0, init_lora=None,
                                master_weights="fp32", base_dtype="auto", mixed_precision="bf16")
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in family.models[MODEL].build(**arch).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "base.safetensors"
    write_safetensors(path, {k: (torch.bfloat16, s) for k, s in shapes.items()},
                      (torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes.values()))
    states = []
    for kept in (False, True):
        with torch.device("meta"):
            model = family.models[MODEL].build(**arch)
        keep = kept_as_stored(model, cfg) if kept else False
        assert not kept or "double_blocks.0.img_attn.qkv.weight" in keep
        load_into_meta_model(model, family.load_weights(str(path)), str(path), keep_dtype=keep)
        torch.manual_seed(0)  # the adapters' A
        adapt_model(model, family, cfg, torch.bfloat16)
        states.append(model.state_dict())
    assert states[0].keys() == states[1].keys()
    for k, v in states[0].items():
        assert v.dtype == states[1][k].dtype and torch.equal(v, states[1][k]), k
