"""Step caches for sampling (opendit.models.step_cache, sample.py --cache): the cache objects on their own (per-row
state: the cond and uncond halves of a guided batch each reuse their own residual; the metric all-reduced over a
sequence-parallel group; PAB's schedule), every model's forward through them (threshold 0 and a disabled PAB
range are the plain forward bitwise; a large threshold skips and stays close), and sample.py's flags end to end."""
import dataclasses
import functools
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from opendit import config as cfglib
from opendit import inference
from opendit.families import family_of
from opendit.families.dit.model import DiT
from opendit.families.flux.model import image_ids, pack_latents, text_ids, unpack_latents
from opendit.families.video.latte import Latte
from opendit.models.step_cache import (BlockLoop, FirstBlockCache, PyramidAttentionBroadcast, TeaCache, make_step_cache,
                                       relative_l1)
from opendit.families.video.vdit import VDiT
from opendit.training.preview import Previewer
from tests.distributed import run_distributed
from tests.test_flux_model import tiny_flux
from tests.test_train import ROOT, tiny_cfg
from tests.test_wan_model import tiny_wan

sys.path.insert(0, str(ROOT))
import sample  # noqa: E402  (the entry script, run in-process)

STEPS = 6


# ---------------------------------------------------------------------------------------------- the cache objects
def _loop(probe, residuals, batch=2):
    """A stand-in model of len(residuals) units: unit i adds residuals[i] ([rows, 1]) to the state; probe: the
    signal TeaCache watches. Returns (loop, calls) where calls counts the units run."""
    calls = []

    def run(state, start=0, stop=None):
        for r in residuals[start:stop]:
            calls.append(1)
            state = state + r
        return state
    return BlockLoop(run, len(residuals), batch, lambda state: probe), calls


def _step(cache, loop, state):
    cache._tick(None, ())  # what the forward pre-hook does on every model call
    return cache.run(loop, state)


@pytest.mark.parametrize("cls", [TeaCache, FirstBlockCache])
def test_each_half_of_a_guided_batch_reuses_its_own_residual(cls):
    cache = cls(STEPS, threshold=10.0)
    state = torch.zeros(2, 1)  # rows: [cond; uncond]
    cond_res, uncond_res = torch.tensor([[1.0], [5.0]]), torch.tensor([[2.0], [7.0]])
    loop, calls = _loop(torch.ones(2, 3), [cond_res, uncond_res])
    assert torch.equal(_step(cache, loop, state), torch.tensor([[3.0], [12.0]]))  # step 0 always family_runs
    calls.clear()
    reused = _step(cache, loop, state + 1)
    assert torch.equal(reused, torch.tensor([[4.0], [13.0]]))  # each row: its input + its own residual
    assert len(calls) == (0 if cls is TeaCache else 1) and cache.skipped_share > 0


def test_teacache_runs_every_row_when_one_half_changed_too_much():
    cache = TeaCache(STEPS, threshold=0.5)
    loop, calls = _loop(torch.ones(2, 3), [torch.ones(2, 1)])
    _step(cache, loop, torch.zeros(2, 1))
    moved, calls[:] = BlockLoop(loop.run, 1, 2, lambda s: torch.tensor([[1.0] * 3, [9.0] * 3])), []
    _step(cache, moved, torch.zeros(2, 1))  # the uncond half's signal moved by 800%: the whole batch family_runs
    assert len(calls) == 1 and cache.skipped == 0
    assert torch.equal(cache.accumulated, torch.zeros(2))  # and every row starts accumulating again


@pytest.mark.parametrize("cls", [TeaCache, FirstBlockCache])
def test_threshold_zero_never_skips_even_an_unchanged_input(cls):
    cache = cls(STEPS, threshold=0.0)
    loop, calls = _loop(torch.ones(2, 3), [torch.ones(2, 1), torch.ones(2, 1)])
    for _ in range(STEPS):
        _step(cache, loop, torch.zeros(2, 1))
    assert len(calls) == 2 * STEPS and cache.skipped_share == 0


def test_the_last_step_always_runs_and_reset_forgets():
    cache = TeaCache(3, threshold=10.0)
    loop, calls = _loop(torch.ones(1, 3), [torch.ones(1, 1)], batch=1)
    for _ in range(3):
        _step(cache, loop, torch.zeros(1, 1))
    assert len(calls) == 2 and cache.skipped == 1  # steps 0 and 2 ran, step 1 reused
    cache.reset()
    assert cache.residual is None and cache.step == -1 and cache.skipped_share == 0


def test_the_metric_is_all_reduced_with_max_over_a_given_group(monkeypatch):
    seen = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: seen.append((op, group)))
    old, new = torch.ones(2, 4), torch.tensor([[1.5] * 4, [1.0] * 4])
    assert torch.equal(relative_l1(new, old, 2), torch.tensor([0.5, 0.0])) and not seen
    relative_l1(new, old, 2, group="sp-group")
    assert seen == [(dist.ReduceOp.MAX, "sp-group")]


def _sp_agreement(rank, world_size):
    """Rank 0's chunk barely moves, rank 1's moves a lot: both must run the blocks."""
    cache = TeaCache(STEPS, threshold=0.5)
    calls = []
    for step in range(2):
        probe = torch.ones(1, 4) * (1 + step * (0.01 if rank == 0 else 2.0))
        loop, calls = _loop(probe, [torch.ones(1, 1)], batch=1)
        loop = BlockLoop(loop.run, 1, 1, loop.probe, group=dist.group.WORLD)
        _step(cache, loop, torch.zeros(1, 1))
    return len(calls)


def test_every_sequence_parallel_rank_takes_the_same_decision():
    assert run_distributed(_sp_agreement, 2) == [1, 1]


def test_pab_recomputes_each_kind_every_n_steps_inside_its_range():
    pab = PyramidAttentionBroadcast(10, {"spatial": 2, "temporal": 4, "cross": 6}, 0.1, 0.9)
    pattern = {}
    for step in range(10):
        pab.step = step
        pattern.setdefault("spatial", []).append(pab._broadcasts("spatial"))
        pattern.setdefault("cross", []).append(pab._broadcasts("cross"))
    # steps 1..8 are inside; the range's first step computes, then every N-th
    assert [s for s, b in enumerate(pattern["spatial"]) if not b] == [0, 1, 3, 5, 7, 9]
    assert [s for s, b in enumerate(pattern["cross"]) if not b] == [0, 1, 7, 9]


# ---------------------------------------------------------------------------------------------- every model
def _randomize(model, seed=0):
    """Break adaLN-Zero's identity init so every block carries signal."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model.eval()


@functools.cache
def _models():
    """name -> (model, call(x, t in (0, 1)) -> the model's output of x's shape, x0); batches of 2 rows, each with
    its own condition (as a guided batch's [cond; uncond])."""
    tiny = dict(hidden_size=32, num_heads=4, num_classes=10, class_dropout_prob=0.0, learn_sigma=False)
    y = torch.tensor([3, 7])
    dit = _randomize(DiT(input_size=8, patch_size=2, in_channels=4, depth=3, **tiny))
    vdit = _randomize(VDiT(input_size=(4, 8, 8), patch_size=(1, 2, 2), in_channels=4, depth=3, **tiny))
    latte = _randomize(Latte(input_size=(4, 8, 8), patch_size=2, in_channels=4, depth=4, **tiny))
    flux = tiny_flux(depth=2, depth_single_blocks=2).eval()
    wan = tiny_wan(out_dim=4).eval()
    g = torch.Generator().manual_seed(0)
    txt, vec = torch.randn(2, 5, 12, generator=g), torch.randn(2, 6, generator=g)
    context = torch.randn(2, 8, 12, generator=g)

    def flux_call(x, t):
        img = pack_latents(x)
        out = flux(img, image_ids(2, 6, 6), txt, text_ids(2, 5), t.expand(2), vec, torch.full((2,), 3.5))
        return unpack_latents(out, 6, 6)
    return {"dit": (dit, lambda x, t: dit(x, (t * 1000).expand(2), y), torch.randn(2, 4, 8, 8, generator=g)),
            "vdit": (vdit, lambda x, t: vdit(x, (t * 1000).expand(2), y=y), torch.randn(2, 4, 4, 8, 8, generator=g)),
            "latte": (latte, lambda x, t: latte(x, (t * 1000).expand(2), y=y),
                      torch.randn(2, 4, 4, 8, 8, generator=g)),
            "flux": (flux, flux_call, torch.randn(2, 2, 6, 6, generator=g)),
            "wan": (wan, lambda x, t: wan(x, (t * 1000).expand(2), context),
                    torch.randn(2, 4, 2, 4, 4, generator=g))}


NAMES = ("dit", "vdit", "latte", "flux", "wan")


def _trajectory(name, cache=None, steps=STEPS):
    """Euler-like steps x <- x - v / steps from t = 1 down, with `cache` attached (None: the plain forward)."""
    model, call, x = _models()[name]
    if cache is not None:
        cache.attach(model)
    try:
        with torch.no_grad():
            for t in torch.linspace(1, 1 / steps, steps):
                v = call(x, t)
                x = x - v / steps
    finally:
        if cache is not None:
            cache.detach()
    return x


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", ["teacache", "fbcache"])
def test_threshold_zero_is_the_plain_forward_bitwise_and_a_large_one_skips(name, kind, one_thread):
    plain = _trajectory(name)
    cache = make_step_cache(kind, STEPS, 0.0)
    assert torch.equal(_trajectory(name, cache), plain) and cache.skipped_share == 0
    cache = make_step_cache(kind, STEPS, 5.0)
    cached = _trajectory(name, cache)
    assert cache.skipped_share > 0 and torch.isfinite(cached).all() and not torch.equal(cached, plain)
    assert (cached - plain).abs().mean() < 0.5 * plain.abs().mean()


@pytest.mark.parametrize("name", ["vdit", "latte", "wan"])
def test_pab_without_a_range_is_the_plain_forward_and_with_one_broadcasts(name, one_thread):
    steps = 10
    plain = _trajectory(name, steps=steps)
    off = make_step_cache("pab", steps, pab_range=(0.0, 0.0))
    assert torch.equal(_trajectory(name, off, steps), plain) and off.skipped_share == 0
    pab = make_step_cache("pab", steps)
    cached = _trajectory(name, pab, steps)
    assert pab.skipped_share > 0 and torch.isfinite(cached).all() and not torch.equal(cached, plain)
    assert (cached - plain).abs().mean() < 0.5 * plain.abs().mean()
    assert all("forward" not in vars(m) for m in _models()[name][0].modules())  # detach unwrapped every layer


def test_pab_on_an_image_model_names_the_flag_and_the_fix():
    with pytest.raises(ValueError, match="--cache pab: DiT has no attention for PAB.*use --cache teacache"):
        make_step_cache("pab", STEPS).attach(_models()["dit"][0])


# ---------------------------------------------------------------------------------------------- sample.py
def _sample(family_runs, name, out, **flags):
    """sample.py's samples (uint8) and its log lines of written batches."""
    prompt = {"flux": ["a handwritten one"], "wan": ["the digit 1 moving down"]}.get(name, [])
    guided = {"cfg_scale": 2.0} if name == "flux" else {}  # FLUX's default 1 would leave the batch unguided
    lines = []
    info = inference.logger.info  # sample.py's run logs through opendit.inference's logger
    inference.logger.info = lambda msg, *args: lines.append(msg % args)
    try:
        sample.main(cfglib.SampleConfig(ckpt="latest", outputs=str(family_runs / name), num_samples=2, batch_size=2,
                                        num_sampling_steps=4, prompts=prompt, out=str(out), npz=True,
                                        **{**guided, **flags}))
    finally:
        inference.logger.info = info
    return np.load(out / "samples.npz")["arr_0"], [line for line in lines if "written" in line]


@pytest.mark.parametrize("name", NAMES)
def test_sample_py_threshold_zero_equals_no_cache_bitwise(family_runs, name, tmp_path, one_thread):
    plain, _ = _sample(family_runs, name, tmp_path / "none")
    caches = [dict(cache="teacache", cache_threshold=0.0), dict(cache="fbcache", cache_threshold=0.0)]
    if name in ("vdit", "latte", "wan"):
        caches.append(dict(cache="pab", pab_range=[0.0, 0.0]))
    for flags in caches:
        cached, log = _sample(family_runs, name, tmp_path / flags["cache"], **flags)
        assert np.array_equal(cached, plain), flags
        assert f"({flags['cache']} skipped 0.0% of" in log[0]
    skipping, log = _sample(family_runs, name, tmp_path / "skip", cache="teacache", cache_threshold=100.0)
    assert "teacache skipped 50.0% of" in log[0]  # 4 steps: the first and the last run, the middle two reuse
    assert skipping.shape == plain.shape


def test_sample_py_cache_errors_name_the_flag(family_runs, tmp_path):
    def refused(name, **flags):
        with pytest.raises(SystemExit) as e:
            _sample(family_runs, name, tmp_path / "refused", **flags)
        dist.destroy_process_group()  # sample.py stopped before its own cleanup
        return str(e.value)
    assert "--cache pab: DiT has no attention for PAB" in refused("dit", cache="pab")
    assert "--cache_threshold 0.1 applies to --cache teacache or fbcache" in refused("dit", cache_threshold=0.1)
    assert "--pab_range 0.9 0.1: must be two fractions" in refused("latte", cache="pab", pab_range=[0.9, 0.1])
    assert "--cache pab with --compile" in refused("latte", cache="pab", compile=True)


def test_the_family_default_threshold_is_filled_and_previews_take_the_cache(tmp_path):
    cfg = tiny_cfg(tmp_path, sample_every=1, preview_cache="fbcache")
    family = family_of(cfg.model)
    cfg = family.resolve_config(cfg)
    encoders = family.load_encoders(cfg, torch.device("cpu"), training=True)
    dataset, cfg = family.load_data(cfg, encoders)
    previewer = Previewer(family, cfg, encoders, "cpu", tmp_path / "run", dataset=dataset)
    assert previewer.sample_cfg.cache == "fbcache"
    assert previewer.sample_cfg.cache_threshold == family.cache_thresholds["fbcache"]
    with pytest.raises(ValueError, match="--cache pab: DiT has no attention"):
        Previewer(family, dataclasses.replace(cfg, preview_cache="pab"), encoders, "cpu", tmp_path / "run",
                  dataset=dataset)
