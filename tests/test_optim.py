"""opendit.optim math: AdamW / NAdamW against torch, Adan against the paper, master weights, options."""
import pytest
import torch

from opendit.optim import (AdamW, build_optimizer, join_bf16, round_bf16_nearest, split_bf16,
                           stochastic_round_bf16)


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    # 2-D weights above small_numel=256 (compressed), 1-D LayerNorm of 320 (f24 under u16), small biases
    return torch.nn.Sequential(torch.nn.Linear(24, 320), torch.nn.GELU(), torch.nn.LayerNorm(320),
                               torch.nn.Linear(320, 8)).to(dtype)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 24, generator=g), torch.randn(16, 8, generator=g)) for _ in range(n)]


def train(model, opt, data):
    dtype = next(model.parameters()).dtype
    for x, y in data:
        loss = (model(x.to(dtype)).float() - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def flat(model):
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


@pytest.mark.parametrize("state_device", ["gpu", "cpu"], ids=["states_beside_params", "states_offloaded"])
def test_adamw_equals_torch(state_device):
    data = batches(20)
    ref = train(m := tiny(), torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1), data)
    ours = train(m := tiny(), build_optimizer(m.parameters(), "adamw", lr=1e-2, betas=(0.8, 0.99),
                                              weight_decay=0.1, state_device=state_device), data)
    assert (flat(ours) - flat(ref)).abs().max() <= 1e-6


@pytest.mark.parametrize("state_device", ["gpu", "cpu"], ids=["states_beside_params", "states_offloaded"])
def test_nadamw_equals_torch_nadam_decoupled(state_device):
    data = batches(20)
    ref = train(m := tiny(), torch.optim.NAdam(m.parameters(), lr=1e-2, weight_decay=0.1,
                                               decoupled_weight_decay=True), data)
    ours = train(m := tiny(), build_optimizer(m.parameters(), "nadamw", lr=1e-2, weight_decay=0.1,
                                              state_device=state_device), data)
    assert (flat(ours) - flat(ref)).abs().max() <= 1e-6


def adan_paper(model, data, lr, beta, eps, wd):
    """Adan, Algorithm 1 of Xie et al. (2022) in the paper's notation (beta = weight of the new term),
    with the authors' bias correction, in float64."""
    params = [p.detach().double().clone().requires_grad_(True) for p in model.parameters()]
    b1, b2, b3 = beta
    m = [torch.zeros_like(p) for p in params]
    v, n, prev = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params], [None] * len(params)
    for k, (x, y) in enumerate(data, start=1):
        out = torch.func.functional_call(model.double(), dict(zip([n_ for n_, _ in model.named_parameters()],
                                                                  params)), (x.double(),))
        grads = torch.autograd.grad((out - y.double()).square().mean(), params)
        with torch.no_grad():
            for i, (p, g) in enumerate(zip(params, grads)):
                d = g - prev[i] if k > 1 else torch.zeros_like(g)
                m[i] = (1 - b1) * m[i] + b1 * g
                v[i] = (1 - b2) * v[i] + b2 * d
                n[i] = (1 - b3) * n[i] + b3 * (g + (1 - b2) * d) ** 2
                mh, vh, nh = (m[i] / (1 - (1 - b1) ** k), v[i] / (1 - (1 - b2) ** k), n[i] / (1 - (1 - b3) ** k))
                eta = lr / (nh.sqrt() + eps)
                p.copy_((p - eta * (mh + (1 - b2) * vh)) / (1 + wd * lr))
                prev[i] = g
    return torch.cat([p.detach().flatten() for p in params])


def test_adan_equals_paper():
    data = batches(20)
    ref = adan_paper(tiny(), data, lr=1e-2, beta=(0.02, 0.08, 0.01), eps=1e-8, wd=0.05)
    ours = train(m := tiny(), build_optimizer(m.parameters(), "adan", lr=1e-2, betas=(0.98, 0.92, 0.99),
                                              eps=1e-8, weight_decay=0.05), data)
    # fp32 against float64 over 20 steps of size ~lr
    assert (flat(ours).double() - ref).abs().max() <= 2e-5


@pytest.mark.parametrize("name", ["adamw", "nadamw", "adan"])
@pytest.mark.parametrize("fmt,tol", [("bf16", 1e-2), ("f24", 1e-4), ("u16", 3e-4)])
def test_compressed_states_track_fp32(name, fmt, tol):
    data = batches(20)
    ref = train(m := tiny(), build_optimizer(m.parameters(), name, lr=1e-3), data)
    ours = train(m := tiny(), build_optimizer(m.parameters(), name, lr=1e-3, state_dtype=fmt, small_numel=256),
                 data)
    # drift after 20 steps as a fraction of the largest movement (measured: bf16 ~5e-3, u16 ~9e-5, f24 ~3e-5)
    moved = (flat(ref) - flat(tiny())).abs().max()
    assert (flat(ours) - flat(ref)).abs().max() <= tol * moved


@pytest.mark.parametrize("name", ["adamw", "adan"])
@pytest.mark.parametrize("state_device", ["gpu", "cpu"], ids=["states_beside_params", "states_offloaded"])
def test_bf16_exact_master_equals_fp32_master_bitwise(name, state_device):
    data = batches(20)
    a = tiny(torch.bfloat16)
    opt_a = build_optimizer(a.parameters(), name, lr=1e-3, weight_decay=0.01, master_weights="fp32",
                            state_device=state_device)
    b = tiny(torch.bfloat16)
    opt_b = build_optimizer(b.parameters(), name, lr=1e-3, weight_decay=0.01, master_weights="bf16_exact",
                            state_device=state_device)
    train(a, opt_a, data)
    train(b, opt_b, data)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa.view(torch.int16), pb.view(torch.int16))
        master_a = opt_a.state[pa]["master"]
        master_b = join_bf16(pb.detach(), opt_b.state[pb]["master_lo"])
        assert torch.equal(master_a.view(torch.int32), master_b.view(torch.int32))
    # and the master really moved below bf16 resolution (otherwise the test would prove nothing)
    p = next(b.parameters())
    assert (opt_b.state[p]["master_lo"] != 0).float().mean() > 0.5


def test_split_join_bf16_is_bitwise_and_nearest():
    x = torch.randn(100000) * torch.logspace(-40, 38, 100000)
    x[:4] = torch.tensor([0.0, -0.0, 1e-45, torch.finfo(torch.float32).max])
    hi, lo = split_bf16(x)
    assert torch.equal(join_bf16(hi, lo).view(torch.int32), x.view(torch.int32))
    # nearest: never further from x than torch's round-to-nearest-even (differs only at exact ties)
    rne = x.to(torch.bfloat16)
    finite = torch.isfinite(rne)
    assert ((hi.float() - x).abs()[finite] <= (rne.float() - x).abs()[finite]).all()
    assert torch.equal(round_bf16_nearest(x), hi)


def test_stochastic_rounding_is_unbiased_and_neighbouring():
    x = torch.full((200000,), 1.0 + 2 ** -9)  # a quarter of the way from 1.0 to the next bf16 (1 + 2^-7)
    r = stochastic_round_bf16(x, torch.Generator().manual_seed(0)).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert abs(r.mean().item() - x[0].item()) < 2e-5  # mean of 200k draws: std 2^-7 * 0.43 / 447 ~ 4e-6


def test_bf16_stochastic_training_moves_below_bf16_resolution():
    # Updates far below half a bf16 ulp vanish with nearest rounding but survive on average with SR.
    p_sr = torch.nn.Parameter(torch.ones(64, 128, dtype=torch.bfloat16))
    p_nr = torch.nn.Parameter(torch.ones(64, 128, dtype=torch.bfloat16))
    opt_sr = build_optimizer([p_sr], "adamw", lr=1e-4, master_weights="bf16_stochastic")
    for _ in range(30):
        p_sr.grad = torch.ones_like(p_sr)
        opt_sr.step()
        with torch.no_grad():
            p_nr.copy_(round_bf16_nearest(p_nr.float() - 1e-4))
    assert torch.equal(p_nr, torch.ones_like(p_nr))
    assert abs(p_sr.float().mean().item() - (1 - 30e-4)) < 3e-4


def test_per_tensor_clip():
    p = torch.nn.Parameter(torch.zeros(10))
    q = torch.nn.Parameter(torch.zeros(10))
    g = torch.arange(10.0)
    opt = build_optimizer([p], "adamw", lr=0.1, per_tensor_clip=1.0)
    ref = build_optimizer([q], "adamw", lr=0.1)
    p.grad, q.grad = g.clone(), g / (g.norm() + 1e-6)
    opt.step()
    ref.step()
    assert torch.allclose(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"], rtol=0, atol=1e-7)


def test_bad_options_name_the_fix():
    w = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="cast the model to torch.bfloat16"):
        build_optimizer([w], "adamw", master_weights="bf16_exact")
    with pytest.raises(ValueError, match="state_device"):
        build_optimizer([w], "adamw", state_device="disk")
    with pytest.raises(ValueError, match="unknown optimizer"):
        build_optimizer([w], "lion")
    with pytest.raises(ValueError, match="three betas"):
        build_optimizer([w], "adan", betas=(0.9, 0.99))
    with pytest.raises(ValueError, match="torch's torch_adamw supports only"):
        build_optimizer([w], "torch_adamw", state_dtype="u16")


def test_torch_passthroughs_train():
    for name in ("torch_adamw", "adafactor"):
        m = tiny()
        opt = build_optimizer(m.parameters(), name, lr=1e-2)
        before = flat(m)
        train(m, opt, batches(3))
        assert not torch.equal(before, flat(m))
    assert isinstance(build_optimizer(tiny().parameters(), "torch_adamw"), torch.optim.AdamW)


def test_param_groups_keep_their_own_options():
    m = tiny()
    opt = AdamW([{"params": m[0].parameters(), "state_dtype": "u16", "lr": 1e-3},
                 {"params": m[3].parameters()}], lr=1e-2, small_numel=256)
    train(m, opt, batches(2))
    assert "exp_avg.u16" in opt.state[m[0].weight] and "exp_avg" in opt.state[m[3].weight]


def test_groups_rebound_before_the_first_step():
    # a booster swaps the parameters in the groups (e.g. for FSDP2 shards) before any state exists
    data = batches(3)
    ref = train(m := tiny(torch.bfloat16), build_optimizer(m.parameters(), "adamw", lr=1e-3,
                                                           master_weights="bf16_stochastic"), data)
    m = tiny(torch.bfloat16)
    opt = build_optimizer(tiny(torch.bfloat16).parameters(), "adamw", lr=1e-3, master_weights="bf16_stochastic")
    opt.param_groups[0]["params"] = list(m.parameters())
    train(m, opt, data)
    assert torch.equal(flat(ref), flat(m))
