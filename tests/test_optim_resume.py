"""Checkpoint resume: state_dict / load_state_dict of every optimizer, format and master mode is exact."""
import io

import pytest
import torch

from opendit.optim import build_optimizer
from opendit.optim.formats import U16Format
from tests.test_optim import batches, flat, tiny, train

pytestmark = pytest.mark.usefixtures("one_thread")

GRID = [(name, fmt, master, dev)
        for name in ("adamw", "nadamw", "adan")
        for fmt in ("fp32", "bf16", "u16", "f24")
        for master, dev in (("fp32", "gpu"), ("bf16_exact", "cpu"), ("bf16_stochastic", "gpu"))]


def make(name, fmt, master, dev, fused=False):
    m = tiny(torch.float32 if master == "fp32" else torch.bfloat16)
    opt = build_optimizer(m.parameters(), name, lr=1e-3, weight_decay=0.01, state_dtype=fmt, master_weights=master,
                          state_device=dev, small_numel=256, fused_backward=fused, seed=7)
    return m, opt


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("name,fmt,master,dev", GRID)
def test_resume_is_exact(name, fmt, master, dev):
    data = batches(6)
    full, opt = make(name, fmt, master, dev)
    train(full, opt, data)

    first, opt1 = make(name, fmt, master, dev)
    train(first, opt1, data[:3])
    model_sd, opt_sd = roundtrip(first.state_dict()), roundtrip(opt1.state_dict())
    resumed, opt2 = make(name, fmt, master, dev)
    resumed.load_state_dict(model_sd)
    opt2.load_state_dict(opt_sd)
    train(resumed, opt2, data[3:])
    assert torch.equal(flat(full), flat(resumed))
    for p, q in zip(full.parameters(), resumed.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[q][k]), k


def test_saved_keys_name_their_format():
    m, opt = make("adamw", "u16", "bf16_exact", "cpu")
    train(m, opt, batches(1))
    sd = opt.state_dict()
    w, ln = sd["state"][0], sd["state"][2]  # Linear(24, 320).weight (2-D), LayerNorm(320).weight (1-D)
    assert {"step", "exp_avg.u16", "exp_avg.u16range", "exp_avg_sq.u16", "exp_avg_sq.u16range", "master_lo"} == set(w)
    assert {"exp_avg.f24hi", "exp_avg.f24lo"} <= set(ln)
    assert sd["param_groups"][0]["state_dtype"] == "u16"


def test_load_into_another_format_reencodes():
    data = batches(3)
    m, opt = make("adamw", "fp32", "fp32", "gpu")
    train(m, opt, data)
    sd = roundtrip(opt.state_dict())
    m2, opt2 = make("adamw", "u16", "fp32", "cpu")
    opt2.load_state_dict(sd)
    fmt = U16Format(256, 3.0)
    p = m2[0].weight
    for n in ("exp_avg", "exp_avg_sq"):
        got = fmt.decode({q: opt2.state[p][f"{n}.{q}"] for q in fmt.parts})
        want = sd["state"][0][n]
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
    assert opt2.param_groups[0]["state_dtype"] == "u16"  # our format stays; hyper-parameters come from the file
    train(m2, opt2, data)  # and it keeps training


def test_load_into_another_master_mode():
    m, opt = make("adamw", "fp32", "bf16_exact", "gpu")
    train(m, opt, batches(3))
    sd = roundtrip(opt.state_dict())
    m2, opt2 = make("adamw", "fp32", "fp32", "gpu")
    m2 = m2.to(torch.bfloat16)
    opt2 = build_optimizer(m2.parameters(), "adamw", lr=1e-3, small_numel=256)
    m2.load_state_dict(m.state_dict())
    opt2.load_state_dict(sd)
    from opendit.optim import join_bf16
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(join_bf16(p.detach(), opt.state[p]["master_lo"]), opt2.state[q]["master"])


def test_resume_with_fused_backward_is_exact():
    data = batches(6)

    def fused_train(m, opt, chunk):
        for x, y in chunk:
            (m(x) - y).square().mean().backward()
            opt.step()

    full, opt = make("adan", "u16", "fp32", "cpu", fused=True)
    fused_train(full, opt, data)
    first, opt1 = make("adan", "u16", "fp32", "cpu", fused=True)
    fused_train(first, opt1, data[:3])
    resumed, opt2 = make("adan", "u16", "fp32", "cpu", fused=True)
    resumed.load_state_dict(first.state_dict())
    opt2.load_state_dict(roundtrip(opt1.state_dict()))
    fused_train(resumed, opt2, data[3:])
    assert torch.equal(flat(full), flat(resumed))


def test_mismatched_groups_are_refused():
    m, opt = make("adamw", "fp32", "fp32", "gpu")
    train(m, opt, batches(1))
    other = build_optimizer(list(m.parameters())[:2], "adamw")
    with pytest.raises(ValueError, match="same parameters in the same order"):
        other.load_state_dict(opt.state_dict())


def _fsdp_worker(rank, world_size, fmt, master):
    """Train a fully_shard'ed tiny model on rank-split batches; checkpoint and resume through DCP's
    state-dict API; return full parameters (uninterrupted, resumed) and the state types."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    dtype = torch.float32 if master == "fp32" else torch.bfloat16

    def make_sharded():
        m = tiny(dtype)
        for layer in (m[0], m[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m, build_optimizer(m.parameters(), "adamw", lr=1e-3, weight_decay=0.01, state_dtype=fmt,
                                  master_weights=master, state_device="cpu", small_numel=256)

    def step(m, opt, x, y):
        xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        (m(xs.to(dtype)).float() - ys).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    data = batches(5)
    full, opt = make_sharded()
    for x, y in data:
        step(full, opt, x, y)
    part, opt1 = make_sharded()
    for x, y in data[:3]:
        step(part, opt1, x, y)
    osd = get_optimizer_state_dict(part, opt1)
    kinds = {k: type(v).__name__ for k, v in next(iter(osd["state"].values())).items()}
    resumed, opt2 = make_sharded()
    resumed.load_state_dict(part.state_dict())
    set_optimizer_state_dict(resumed, opt2, osd)
    for x, y in data[3:]:
        step(resumed, opt2, x, y)
    gather = lambda m: torch.cat([p.full_tensor().float().flatten() for p in m.parameters()])  # noqa: E731
    assert all(isinstance(p, DTensor) for p in full.parameters())
    return gather(full), gather(resumed), kinds


@pytest.mark.slow
@pytest.mark.parametrize("fmt,master", [("u16", "fp32"), ("f24", "bf16_exact")])
def test_fsdp2_shards_match_single_process_and_resume(fmt, master):
    from tests.distributed import run_distributed
    results = run_distributed(_fsdp_worker, 2, fmt, master)
    (full, resumed, kinds), (full1, _, _) = results
    assert torch.equal(full, full1)  # ranks agree
    assert torch.equal(full, resumed)  # DCP state-dict round trip resumes exactly
    assert kinds["exp_avg." + fmt if fmt == "u16" else "exp_avg.f24hi"] == "DTensor" and kinds["step"] == "Tensor"
    # the same training on one process (states over whole tensors) lands on the same weights
    dtype = torch.float32 if master == "fp32" else torch.bfloat16
    m = tiny(dtype)
    opt = build_optimizer(m.parameters(), "adamw", lr=1e-3, weight_decay=0.01, state_dtype=fmt,
                          master_weights=master, small_numel=256)
    train(m, opt, batches(5))
    # gradients are averaged across ranks by a reduce-scatter, so they differ from the single-process mean
    # in the last bits; an fp32 step moves weights ~1e-3, a state quantization step changes it by ~1e-7
    tol = 1e-6 if master == "fp32" else 2 ** -7  # bf16 weights: one ulp at |w|<1 if a rounding flips
    assert (flat(m) - full).abs().max() <= tol
