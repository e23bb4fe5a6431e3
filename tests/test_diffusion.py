"""Gaussian diffusion (opendit.diffusion) against diffusers' DDPM/DDIM schedulers and closed forms.

diffusers keeps its schedule in float32 while ours is float64, so comparisons use rtol/atol 1e-5
(1e-4 near t=T, where x0 = (x - sqrt(1 - acp) eps) / sqrt(acp) divides by sqrt(acp) ~ 6e-3).
"""
import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler

from opendit.diffusion import (GaussianDiffusion, LossType, ModelMeanType, ModelVarType, create_diffusion,
                               get_named_beta_schedule, space_timesteps)

SHAPE = (2, 3, 4, 5)  # [B, C, H, W], odd sizes on purpose
TOL = dict(rtol=1e-4, atol=1e-5)


def _ddpm(variance_type, **kw):
    return DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear", beta_start=1e-4, beta_end=0.02,
                         variance_type=variance_type, clip_sample=False, prediction_type="epsilon", **kw)


def _ddim(**kw):
    return DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", beta_start=1e-4, beta_end=0.02,
                         clip_sample=False, set_alpha_to_one=True, steps_offset=0, prediction_type="epsilon",
                         timestep_spacing="leading", **kw)


def _fake_eps(x, t):
    """A deterministic stand-in for a trained eps network; depends on the (original) timestep."""
    return torch.sin(3 * x + t.float().view(-1, 1, 1, 1) / 100.0)


def _seeded(seed):
    return torch.Generator().manual_seed(seed)


def test_schedule_matches_diffusers():
    ours = create_diffusion(learn_sigma=False)
    ref = _ddpm("fixed_small")
    np.testing.assert_allclose(ours.betas, ref.betas.double().numpy(), rtol=1e-6)
    np.testing.assert_allclose(ours.alphas_cumprod, ref.alphas_cumprod.double().numpy(), rtol=2e-5)
    assert ours.betas.dtype == np.float64 and ours.num_timesteps == 1000


def test_q_sample_matches_diffusers_add_noise():
    x0, noise = torch.randn(SHAPE, generator=_seeded(0)), torch.randn(SHAPE, generator=_seeded(1))
    t = torch.tensor([7, 900])
    ours = create_diffusion().q_sample(x0, t, noise=noise)
    torch.testing.assert_close(ours, _ddpm("fixed_small").add_noise(x0, noise, t), **TOL)


@pytest.mark.parametrize("sigma_small,variance_type", [(True, "fixed_small"), (False, "fixed_large")])
@pytest.mark.parametrize("step", [999, 500, 1, 0])
def test_ddpm_step_matches_diffusers(sigma_small, variance_type, step):
    ours, ref = create_diffusion(learn_sigma=False, sigma_small=sigma_small), _ddpm(variance_type)
    x = torch.randn(SHAPE, generator=_seeded(2))
    t = torch.full((SHAPE[0],), step)
    eps = _fake_eps(x, t)
    expected = ref.step(eps, step, x, generator=_seeded(3))
    got = ours.p_sample(lambda x_, t_: _fake_eps(x_, t_), x, t, generator=_seeded(3))
    torch.testing.assert_close(got["pred_xstart"], expected.pred_original_sample, **TOL)
    torch.testing.assert_close(got["sample"], expected.prev_sample, **TOL)
    # The mean alone: diffusers adds sqrt(var) * noise to it for step > 0.
    noise = torch.randn(SHAPE, generator=_seeded(3))
    ref_std = ref._get_variance(step).sqrt() if step > 0 else 0.0
    mean = ours.p_mean_variance(lambda x_, t_: _fake_eps(x_, t_), x, t)["mean"]
    torch.testing.assert_close(mean, expected.prev_sample - ref_std * noise, **TOL)


@pytest.mark.parametrize("step", [999, 300, 1])
def test_ddpm_learned_range_step_matches_diffusers(step):
    ours, ref = create_diffusion(learn_sigma=True), _ddpm("learned_range")
    x = torch.randn(SHAPE, generator=_seeded(4))
    var_values = torch.rand(SHAPE, generator=_seeded(5)) * 2 - 1
    t = torch.full((SHAPE[0],), step)
    out = torch.cat([_fake_eps(x, t), var_values], dim=1)  # [B, 2C, H, W]
    expected = ref.step(out, step, x, generator=_seeded(6)).prev_sample
    got = ours.p_sample(lambda *_: out, x, t, generator=_seeded(6))["sample"]
    torch.testing.assert_close(got, expected, **TOL)


def test_ddpm_respaced_loop_matches_diffusers():
    ours = create_diffusion("250", learn_sigma=False, sigma_small=True)
    ref = _ddpm("fixed_small", timestep_spacing="linspace")
    ref.set_timesteps(250)
    assert ref.timesteps.tolist() == ours.timestep_map[::-1]
    x_T = torch.randn(SHAPE, generator=_seeded(7))
    seen = []

    def model_fn(x, t):
        seen.append(int(t[0]))
        return _fake_eps(x, t)

    got = ours.p_sample_loop(model_fn, SHAPE, noise=x_T, generator=_seeded(8))
    assert seen == ref.timesteps.tolist()  # the model sees the original steps, high to low
    x, gen = x_T, _seeded(8)
    for step in ref.timesteps:
        x = ref.step(_fake_eps(x, step.expand(SHAPE[0])), step, x, generator=gen).prev_sample
    torch.testing.assert_close(got, x, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("eta", [0.0, 0.7])
@pytest.mark.parametrize("step_index", [0, 25, 49])
def test_ddim_step_matches_diffusers(eta, step_index):
    ours, ref = create_diffusion("ddim50", learn_sigma=True), _ddim()
    ref.set_timesteps(50)
    assert ref.timesteps.tolist() == ours.timestep_map[::-1]
    step = int(ref.timesteps[step_index])
    x, noise = torch.randn(SHAPE, generator=_seeded(9)), torch.randn(SHAPE, generator=_seeded(10))
    eps = _fake_eps(x, torch.full((SHAPE[0],), step))
    expected = ref.step(eps, step, x, eta=eta, variance_noise=noise if eta else None)
    # Our index for original step `step`; the model also returns (ignored) variance channels.
    t = torch.full((SHAPE[0],), ours.timestep_map.index(step))
    got = ours.ddim_sample(lambda x_, t_: torch.cat([_fake_eps(x_, t_), torch.zeros_like(x_)], 1), x, t,
                           eta=eta, noise=noise)
    torch.testing.assert_close(got["pred_xstart"], expected.pred_original_sample, **TOL)
    torch.testing.assert_close(got["sample"], expected.prev_sample, **TOL)


def test_ddim_loop_with_eta_matches_diffusers():
    ours, ref = create_diffusion("ddim50", learn_sigma=False), _ddim()
    ref.set_timesteps(50)
    x_T = torch.randn(SHAPE, generator=_seeded(11))
    got = ours.ddim_sample_loop(_fake_eps, SHAPE, noise=x_T, eta=0.5, generator=_seeded(12))
    x, gen = x_T, _seeded(12)
    for step in ref.timesteps:
        x = ref.step(_fake_eps(x, step.expand(SHAPE[0])), step, x, eta=0.5, generator=gen).prev_sample
    torch.testing.assert_close(got, x, rtol=1e-4, atol=1e-4)


def test_learned_range_endpoints():
    d = create_diffusion(learn_sigma=True)
    x = torch.randn(SHAPE, generator=_seeded(13))
    t = torch.tensor([1, 640])
    for value, expected in [(-1.0, d.posterior_variance), (1.0, d.betas)]:
        out = d.p_mean_variance(lambda x_, t_: torch.cat([x_, torch.full_like(x_, value)], 1), x, t)
        want = torch.from_numpy(expected[t.numpy()]).float().view(-1, 1, 1, 1).expand_as(x)
        torch.testing.assert_close(out["variance"], want, rtol=1e-5, atol=0)


def _leaf_output(x, channels, seed):
    """A model output [B, channels, ...] that is a leaf tensor, to inspect gradients."""
    return torch.randn((x.shape[0], channels, *x.shape[2:]), generator=_seeded(seed)).requires_grad_()


def test_training_losses_hybrid():
    d = create_diffusion()
    x0, noise = torch.randn(SHAPE, generator=_seeded(14)), torch.randn(SHAPE, generator=_seeded(15))
    t = torch.tensor([0, 411])  # t == 0 exercises the decoder NLL branch
    out = _leaf_output(x0, 2 * SHAPE[1], 16)
    terms = d.training_losses(lambda *_: out, x0, t, noise=noise)
    for key in ("loss", "mse", "vb"):
        assert terms[key].shape == (SHAPE[0],) and torch.isfinite(terms[key]).all(), key
    torch.testing.assert_close(terms["mse"], ((out[:, :3] - noise) ** 2).mean(dim=(1, 2, 3)))
    torch.testing.assert_close(terms["loss"], terms["mse"] + terms["vb"])
    assert (terms["vb"] > 0).all()
    terms["vb"].sum().backward()
    assert (out.grad[:, :3] == 0).all(), "the VLB term must not train the eps channels"
    assert out.grad[:, 3:].abs().sum() > 0, "the VLB term must train the variance channels"


def test_vb_vanishes_for_the_true_posterior():
    # eps = the true noise and var_values = -1 (beta_tilde): p equals q(x_{t-1} | x_t, x_0), so KL = 0.
    d = create_diffusion()
    x0, noise = torch.randn(SHAPE, generator=_seeded(17)), torch.randn(SHAPE, generator=_seeded(18))
    t = torch.tensor([5, 700])
    terms = d.training_losses(lambda x, t_: torch.cat([noise, -torch.ones_like(x)], 1), x0, t, noise=noise)
    torch.testing.assert_close(terms["vb"], torch.zeros(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(terms["mse"], torch.zeros(2))


def test_training_losses_fixed_variance_and_kl():
    x0, noise = torch.randn(SHAPE, generator=_seeded(19)), torch.randn(SHAPE, generator=_seeded(20))
    t = torch.tensor([3, 999])
    fixed = create_diffusion(learn_sigma=False)
    out = _leaf_output(x0, SHAPE[1], 21)
    terms = fixed.training_losses(lambda *_: out, x0, t, noise=noise)
    assert (terms["vb"] == 0).all()
    torch.testing.assert_close(terms["loss"], terms["mse"])
    kl = create_diffusion(use_kl=True)
    out = _leaf_output(x0, 2 * SHAPE[1], 22)
    terms = kl.training_losses(lambda *_: out, x0, t, noise=noise)
    torch.testing.assert_close(terms["loss"], terms["vb"] * 1000)
    terms["loss"].sum().backward()
    assert out.grad[:, :3].abs().sum() > 0, "with a KL loss the bound trains the mean too"


def test_training_losses_rejects_wrong_channels():
    x0 = torch.randn(SHAPE)
    with pytest.raises(ValueError, match="channels"):
        create_diffusion(learn_sigma=True).training_losses(lambda x, t: x, x0, torch.tensor([1, 2]))


def test_respacing_steps_and_map():
    base = create_diffusion()
    d = create_diffusion("250")
    assert d.num_timesteps == 250 and len(d.timestep_map) == 250
    assert d.timestep_map[0] == 0 and d.timestep_map[-1] == 999
    assert d.timestep_map == sorted(d.use_timesteps) and all(np.diff(d.timestep_map) > 0)
    np.testing.assert_allclose(d.alphas_cumprod, base.alphas_cumprod[d.timestep_map], rtol=1e-12)
    assert create_diffusion("ddim50").timestep_map == list(range(0, 1000, 20))
    steps = sorted(space_timesteps(1000, "10,15,20"))
    assert len(steps) == 45 and steps[:10][-1] == 333 and steps[10] == 334 and steps[-1] == 999
    # IDDPM accumulates the float stride; i * stride (diffusers' linspace) would give 500 here.
    assert 499 in space_timesteps(1000, "21") and 500 not in space_timesteps(1000, "21")
    for bad in ("ddim999", "abc", "2000", "0"):
        with pytest.raises(ValueError):
            space_timesteps(1000, bad)


def test_respaced_training_calls_model_with_original_steps():
    d = create_diffusion("ddim50")
    seen = []

    def model_fn(x, t):
        seen.append(t.clone())
        return torch.cat([torch.zeros_like(x), torch.zeros_like(x)], 1)

    d.training_losses(model_fn, torch.randn(SHAPE), torch.tensor([1, 49]))
    assert seen[0].tolist() == [20, 980]


def test_sample_timesteps():
    d = create_diffusion()
    t = d.sample_timesteps(4096, "cpu", generator=_seeded(23))
    assert t.dtype == torch.long and t.min() >= 0 and t.max() <= 999 and t.unique().numel() > 900
    assert torch.equal(t, d.sample_timesteps(4096, "cpu", generator=_seeded(23)))


@pytest.mark.parametrize("loop", ["p_sample_loop", "ddim_sample_loop"])
def test_sampler_determinism(loop):
    d = create_diffusion("ddim10")
    kwargs = {"eta": 1.0} if loop == "ddim_sample_loop" else {}
    model_fn = lambda x, t: torch.cat([_fake_eps(x, t), torch.zeros_like(x)], 1)  # noqa: E731
    a = getattr(d, loop)(model_fn, SHAPE, generator=_seeded(24), **kwargs)
    b = getattr(d, loop)(model_fn, SHAPE, generator=_seeded(24), **kwargs)
    c = getattr(d, loop)(model_fn, SHAPE, generator=_seeded(25), **kwargs)
    assert torch.equal(a, b) and not torch.allclose(a, c)


def _oracle(base, x0):
    """A perfect denoiser for one known x0: returns the eps that produced x_t (original steps t)."""
    acp = torch.from_numpy(base.alphas_cumprod)

    def model_fn(x, t):
        a = acp[t].view(-1, 1, 1, 1)  # float64: in bf16, 1 - acp[0] would round to 0
        eps = ((x - a.sqrt() * x0) / (1 - a).sqrt()).to(x.dtype)
        return torch.cat([eps, torch.zeros_like(eps)], 1)
    return model_fn


@pytest.mark.parametrize("respacing,loop", [("ddim50", "ddim_sample_loop"), ("25", "p_sample_loop")])
def test_oracle_denoiser_recovers_x0(respacing, loop):
    x0 = torch.rand(SHAPE, generator=_seeded(26)) * 2 - 1
    d = create_diffusion(respacing)
    got = getattr(d, loop)(_oracle(create_diffusion(), x0), SHAPE, generator=_seeded(27))
    torch.testing.assert_close(got, x0, rtol=1e-4, atol=1e-4)


def test_bfloat16_sampling_follows_the_sample_dtype():
    # bf16 has ~3 significant digits, so the oracle's x0 comes back only to ~1e-2.
    x0 = torch.rand(SHAPE, generator=_seeded(28)) * 2 - 1
    d = create_diffusion("ddim10")
    x_T = torch.randn(SHAPE, generator=_seeded(29)).bfloat16()
    got = d.ddim_sample_loop(_oracle(create_diffusion(), x0.bfloat16()), SHAPE, noise=x_T)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), x0, rtol=0, atol=2e-2)


def test_direct_construction_and_bad_betas():
    d = GaussianDiffusion(betas=get_named_beta_schedule("squaredcos_cap_v2", 100),
                          model_mean_type=ModelMeanType.START_X, model_var_type=ModelVarType.FIXED_SMALL,
                          loss_type=LossType.MSE)
    x0 = torch.randn(SHAPE)
    terms = d.training_losses(lambda x, t: x0, x0, torch.tensor([0, 99]))
    torch.testing.assert_close(terms["mse"], torch.zeros(2))  # START_X target is x0 itself
    with pytest.raises(ValueError, match="betas"):
        GaussianDiffusion(betas=np.array([0.1, 1.5]), model_mean_type=ModelMeanType.EPSILON,
                          model_var_type=ModelVarType.FIXED_SMALL, loss_type=LossType.MSE)
