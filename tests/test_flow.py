"""FLUX's rectified flow (opendit.diffusion.flow) against official FLUX's formulas, diffusers'
FlowMatchEulerDiscreteScheduler (as FluxPipeline drives it) and closed forms."""
import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from opendit.diffusion import (FLOW_SAMPLERS, TIMESTEP_SAMPLINGS, RectifiedFlow, cfg_velocity, euler_sample,
                               flux_mu, flux_schedule, time_shift)

CASES = [(4, 256), (28, 1024), (50, 4096), (7, 777), (10, 6000)]  # (steps, packed image tokens)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _official_schedule(num_steps, image_seq_len, base_shift=0.5, max_shift=1.15, shift=True):
    """black-forest-labs/flux src/flux/sampling.py get_schedule, transcribed."""
    timesteps = torch.linspace(1, 0, num_steps + 1)
    if shift:
        m = (max_shift - base_shift) / (4096 - 256)
        mu = m * image_seq_len + (base_shift - m * 256)
        timesteps = math.exp(mu) / (math.exp(mu) + (1 / timesteps - 1) ** 1.0)
    return timesteps.tolist()


def _closed_form(num_steps, image_seq_len):
    """The shifted schedule in float64, written independently: t' = e^mu t / (e^mu t + 1 - t)."""
    mu = 0.5 + (1.15 - 0.5) * (image_seq_len - 256) / (4096 - 256)
    t = np.linspace(1.0, 0.0, num_steps + 1)
    return np.exp(mu) * t / (np.exp(mu) * t + 1 - t)


def _diffusers(num_steps, image_seq_len):
    """FlowMatchEulerDiscreteScheduler set up as diffusers' FluxPipeline does (FLUX.1 scheduler config)."""
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                            base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                            max_image_seq_len=4096)
    sched.set_timesteps(num_steps, mu=flux_mu(image_seq_len),
                        sigmas=np.linspace(1.0, 1 / num_steps, num_steps))
    return sched


# ---- schedule ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps,seq_len", CASES)
def test_schedule_matches_official(steps, seq_len):
    ours = flux_schedule(steps, seq_len)
    assert isinstance(ours, list) and len(ours) == steps + 1
    assert ours == _official_schedule(steps, seq_len)  # same float32 ops: bit-identical
    np.testing.assert_allclose(ours, _closed_form(steps, seq_len), atol=1e-6)
    assert ours[0] == 1.0 and ours[-1] == 0.0
    assert all(a > b for a, b in zip(ours[:-1], ours[1:]))


def test_schedule_shift_and_unshifted():
    assert flux_schedule(4, 4096, shift=False) == torch.linspace(1, 0, 5).tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    shifted = flux_schedule(4, 4096)
    assert all(s > u for s, u in zip(shifted[1:-1], [0.75, 0.5, 0.25]))  # shifting spends more steps near noise
    # the shift grows with resolution; custom base/max shifts reach mu
    assert flux_schedule(4, 4096)[2] > flux_schedule(4, 256)[2]
    assert flux_schedule(4, 256, base_shift=0.0)[2] == pytest.approx(0.5, abs=1e-7)  # mu = 0: identity
    with pytest.raises(ValueError, match="num_steps=0"):
        flux_schedule(0, 256)


def test_flux_mu_and_time_shift():
    assert flux_mu(256) == pytest.approx(0.5) and flux_mu(4096) == pytest.approx(1.15)
    for n in (64, 1024, 4096, 8192):
        assert flux_mu(n) == pytest.approx(calculate_shift(n, 256, 4096, 0.5, 1.15), abs=1e-12)
    assert flux_mu(1000, base_shift=0.2, max_shift=0.9) == pytest.approx(calculate_shift(1000, 256, 4096, 0.2, 0.9))
    with pytest.raises(ValueError, match="image_seq_len=0"):
        flux_mu(0)
    # floats: ends fixed, identity at mu = 0 and sigma = 1, closed form otherwise
    assert time_shift(1.0, 1.0, 0.0) == 0.0 and time_shift(1.0, 1.0, 1.0) == 1.0
    assert time_shift(0.0, 1.0, 0.3) == pytest.approx(0.3)
    assert time_shift(0.7, 2.0, 0.3) == pytest.approx(math.exp(0.7) / (math.exp(0.7) + (1 / 0.3 - 1) ** 2))
    t = torch.tensor([0.0, 0.3, 1.0])
    torch.testing.assert_close(time_shift(0.7, 1.0, t), torch.tensor([0.0, time_shift(0.7, 1.0, 0.3), 1.0]))


@pytest.mark.parametrize("steps,seq_len", CASES)
def test_schedule_matches_diffusers(steps, seq_len):
    sigmas = _diffusers(steps, seq_len).sigmas  # steps + 1 values: FluxPipeline's, plus the trailing 0
    assert sigmas.shape == (steps + 1,)
    np.testing.assert_allclose(flux_schedule(steps, seq_len), sigmas.double().numpy(), atol=1e-6, rtol=0)


# ---- sampling ------------------------------------------------------------------------------------------------
def _fake_velocity(x, t):
    """A deterministic, nonlinear stand-in for a trained velocity network."""
    return torch.sin(2 * x + 3 * t.view(-1, *([1] * (x.ndim - 1))))


def test_euler_exact_on_straight_paths():
    """Data at one point x0: the true velocity at x_t is (x_t - x0) / t, constant along x_t's straight path, so
    Euler is exact on any schedule and lands on x0 from any noise."""
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    seen = []

    def velocity(x, t):
        seen.append(t.clone())
        return (x - x0) / t.view(-1, 1, 1, 1)

    for timesteps in (flux_schedule(9, 4096), flux_schedule(4, 256, shift=False), [1.0, 0.9, 0.2, 0.0]):
        seen.clear()
        out = euler_sample(velocity, noise, timesteps)
        torch.testing.assert_close(out, x0, rtol=1e-5, atol=1e-5)
        assert len(seen) == len(timesteps) - 1  # one call per step, never at the final t = 0
        for t, want in zip(seen, timesteps[:-1]):
            assert t.shape == (3,) and t.dtype == torch.float32 and torch.all(t == torch.tensor(want))
    # half way: x at t = 0.4 is exactly on the path
    torch.testing.assert_close(euler_sample(velocity, noise, torch.tensor([1.0, 0.4])), 0.6 * x0 + 0.4 * noise)


@pytest.mark.parametrize("steps", [1, 6])
def test_euler_matches_diffusers_steps(steps):
    seq_len = 1024
    x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(1))
    sched = _diffusers(steps, seq_len)
    ref = x.clone()
    for timestep in sched.timesteps:
        t = (timestep / 1000).expand(ref.shape[0])
        ref = sched.step(_fake_velocity(ref, t), timestep, ref).prev_sample
    out = euler_sample(_fake_velocity, x, flux_schedule(steps, seq_len))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_euler_state_in_fp32_with_bf16_model():
    x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(2))
    timesteps = flux_schedule(8, 4096)

    def bf16_model(x, t):
        assert x.dtype == t.dtype == torch.float32  # the sampler's state; the model casts it
        return _fake_velocity(x.bfloat16(), t.bfloat16())

    out = euler_sample(bf16_model, x.bfloat16(), timesteps)  # a bf16 start is upcast too
    assert out.dtype == torch.float32
    ref = x.bfloat16().float()
    for t_curr, t_prev in zip(timesteps[:-1], timesteps[1:]):
        ref = ref + (t_prev - t_curr) * bf16_model(ref, torch.full((2,), t_curr)).float()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_euler_validates():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="timesteps has 1 value"):
        euler_sample(_fake_velocity, x, [1.0])
    with pytest.raises(ValueError, match=r"returned shape \(2, 1, 3\)"):
        euler_sample(lambda x, t: x[:, None], x, [1.0, 0.0])
    assert FLOW_SAMPLERS == ("euler",) and TIMESTEP_SAMPLINGS == ("logit_normal", "uniform")


def test_cfg_velocity():
    cond, uncond = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0])
    torch.testing.assert_close(cfg_velocity(cond, uncond, 1.0), cond)
    torch.testing.assert_close(cfg_velocity(cond, uncond, 0.0), uncond)
    torch.testing.assert_close(cfg_velocity(cond, uncond, 3.5), torch.tensor([0.5 + 3.5 * 0.5, -1.0 + 3.5 * 3.0]))
    assert cfg_velocity(cond.bfloat16(), uncond.bfloat16(), 2.0).dtype == torch.float32


# ---- training times ------------------------------------------------------------------------------------------
N = 20000


def test_sample_t_logit_normal_unshifted():
    flow = RectifiedFlow(shift=False)
    torch.manual_seed(0)
    t = flow.sample_t(N, "cpu")
    assert t.shape == (N,) and t.dtype == torch.float32
    assert torch.all((t > 0) & (t < 1))
    assert t.median().item() == pytest.approx(0.5, abs=0.02)
    logit = torch.logit(t.double())
    assert logit.mean().item() == pytest.approx(0.0, abs=0.05) and logit.std().item() == pytest.approx(1.0, abs=0.05)
    # from the global RNG, exactly sigmoid(N(mean, std))
    torch.manual_seed(3)
    t = flow.sample_t(5, "cpu", logit_mean=1.0, logit_std=0.5)
    torch.manual_seed(3)
    torch.testing.assert_close(t, torch.sigmoid(torch.randn(5) * 0.5 + 1.0))


@pytest.mark.parametrize("seq_len", [256, 4096])
def test_sample_t_shift(seq_len):
    flow = RectifiedFlow()
    torch.manual_seed(0)
    shifted = flow.sample_t(N, "cpu", image_seq_len=seq_len)
    torch.manual_seed(0)
    plain = flow.sample_t(N, "cpu", shift=False)
    mu = flux_mu(seq_len)
    torch.testing.assert_close(shifted, time_shift(mu, 1.0, plain))
    want = time_shift(mu, 1.0, 0.5)  # the shift is monotone: the median moves with it
    assert want > 0.6
    assert shifted.median().item() == pytest.approx(want, abs=0.02)
    assert torch.all((shifted > 0) & (shifted < 1))


def test_sample_t_longer_sequences_noisier():
    flow = RectifiedFlow()
    medians = []
    for seq_len in (256, 1024, 4096):
        torch.manual_seed(0)
        medians.append(flow.sample_t(N, "cpu", image_seq_len=seq_len).median().item())
    assert medians[0] < medians[1] < medians[2]


def test_sample_t_uniform():
    flow = RectifiedFlow("uniform", shift=False)
    torch.manual_seed(0)
    t = flow.sample_t(N, "cpu")
    assert torch.all((t >= 0) & (t < 1))
    q = torch.quantile(t, torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9]))
    torch.testing.assert_close(q, torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9]), atol=0.02, rtol=0)
    torch.manual_seed(1)
    torch.testing.assert_close(flow.sample_t(4, "cpu"), (torch.manual_seed(1), torch.rand(4))[1])
    # the uniform draw shifted for a 1024x1024 image
    torch.manual_seed(1)
    torch.testing.assert_close(flow.sample_t(4, "cpu", image_seq_len=4096, shift=True),
                               time_shift(1.15, 1.0, (torch.manual_seed(1), torch.rand(4))[1]))


def test_sample_t_reproducible_from_global_rng():
    flow = RectifiedFlow()
    torch.manual_seed(7)
    a = flow.sample_t(16, "cpu", image_seq_len=1024)
    torch.manual_seed(7)
    b = flow.sample_t(16, "cpu", image_seq_len=1024)
    assert torch.equal(a, b)
    state = torch.get_rng_state()  # what a checkpoint saves
    c = flow.sample_t(16, "cpu", image_seq_len=1024)
    assert not torch.equal(a, c)
    torch.set_rng_state(state)
    assert torch.equal(flow.sample_t(16, "cpu", image_seq_len=1024), c)


def test_sample_t_validates():
    with pytest.raises(ValueError, match=r"'lognormal'.*logit_normal, uniform"):
        RectifiedFlow("lognormal")
    with pytest.raises(ValueError, match=r"'beta'.*logit_normal, uniform"):
        RectifiedFlow().sample_t(4, "cpu", 256, distribution="beta")
    with pytest.raises(ValueError, match="needs image_seq_len"):
        RectifiedFlow().sample_t(4, "cpu")
    with pytest.raises(ValueError, match="logit_std=-1"):
        RectifiedFlow(logit_std=-1)


# ---- training loss -------------------------------------------------------------------------------------------
def test_noisy_and_target():
    x0, noise = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    t = torch.tensor([0.0, 1.0])
    x_t = RectifiedFlow.noisy(x0, t, noise)
    torch.testing.assert_close(x_t[0], x0[0])
    torch.testing.assert_close(x_t[1], noise[1])
    torch.testing.assert_close(RectifiedFlow.noisy(x0, torch.tensor([0.25, 0.5]), noise)[0],
                               0.75 * x0[0] + 0.25 * noise[0])
    torch.testing.assert_close(RectifiedFlow.target(x0, noise), noise - x0)
    assert RectifiedFlow.noisy(x0.bfloat16(), t, noise.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"t shape \(3,\) must be \[B\] = \[2\]"):
        RectifiedFlow.noisy(x0, torch.zeros(3), noise)
    with pytest.raises(ValueError, match="noise shape"):
        RectifiedFlow.noisy(x0, t, noise[:, :2])


def test_training_loss_zero_for_perfect_predictor():
    flow = RectifiedFlow()
    x0 = torch.randn(4, 16, 6, generator=torch.Generator().manual_seed(3))

    def oracle(x_t, t):  # data is the single point x0: the velocity field is (x_t - x0) / t
        return (x_t - x0) / t.view(-1, 1, 1)

    torch.manual_seed(0)
    loss = flow.training_loss(oracle, x0, image_seq_len=96)
    assert loss.shape == () and loss.dtype == torch.float32
    assert loss.item() < 1e-9
    assert flow.training_loss(lambda x_t, t: torch.zeros_like(x_t), x0, image_seq_len=96).item() > 0.5


def test_training_loss_hand_computed():
    flow = RectifiedFlow()
    x0 = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    noise = torch.tensor([[0.5, 0.0], [2.0, 1.0]])
    t = torch.tensor([0.25, 0.75])
    seen = {}

    def model_fn(x_t, t, scale=1.0):
        seen["t"], seen["scale"] = t, scale
        return scale * x_t

    loss = flow.training_loss(model_fn, x0, t=t, noise=noise, scale=2.0)
    assert seen["t"] is t and seen["scale"] == 2.0
    # x_t = [[0.875, 1.5], [1.5, 0.5]]; pred = 2 x_t = [[1.75, 3], [3, 1]]; target = [[-0.5, -2], [2, 2]]
    per_sample = [((1.75 + 0.5) ** 2 + (3 + 2) ** 2) / 2, ((3 - 2) ** 2 + (1 - 2) ** 2) / 2]
    assert loss.item() == pytest.approx(sum(per_sample) / 2)
    split = flow.loss_from(2 * RectifiedFlow.noisy(x0, t, noise), x0=x0, noise=noise)
    assert split.item() == pytest.approx(loss.item())
    with pytest.raises(TypeError):  # x0 / noise are keyword-only: swapping them would flip the target's sign
        flow.loss_from(x0, noise, x0)
    with pytest.raises(ValueError, match=r"prediction shape \(2, 1, 2\) must equal target shape \(2, 2\)"):
        flow.mse(x0[:, None], x0)


def test_training_loss_draws_t_then_noise_from_global_rng():
    flow = RectifiedFlow()
    x0 = torch.randn(3, 4, 5)
    seen = {}

    def model_fn(x_t, t):
        seen["x_t"], seen["t"] = x_t, t
        return torch.zeros_like(x_t)

    torch.manual_seed(11)
    flow.training_loss(model_fn, x0, image_seq_len=4096)
    torch.manual_seed(11)
    t = flow.sample_t(3, "cpu", image_seq_len=4096)
    noise = torch.randn(x0.shape)
    assert torch.equal(seen["t"], t)
    torch.testing.assert_close(seen["x_t"], (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * noise)


def test_loss_in_fp32_for_bf16_prediction():
    flow = RectifiedFlow()
    g = torch.Generator().manual_seed(5)
    x0, noise = torch.randn(2, 64, generator=g), torch.randn(2, 64, generator=g)
    target = noise - x0
    pred = (target + 1e-2 * torch.randn(2, 64, generator=g)).bfloat16()
    loss = flow.loss_from(pred, x0=x0, noise=noise)
    assert loss.dtype == torch.float32
    exact = ((pred.double() - target.double()) ** 2).mean()
    assert loss.item() == pytest.approx(exact.item(), rel=1e-5)
    # computing it in bf16 instead would be far off: the test can tell the two apart
    in_bf16 = ((pred - target.bfloat16()) ** 2).mean()
    assert abs(in_bf16.item() - exact.item()) > 1e-3 * exact.item()
