"""CFG-parallel sampling (--cfg_parallel): each rank of a CFG pair runs the model on its half of guidance's
[cond; uncond] batch (or one call of a pipeline's pair of calls) and the halves are all-gathered, so every rank holds
what one process computes. The hook on a 2-rank gloo group equals the whole batch, the pairs mode the one-process
loop; sample.py --cfg_parallel under torchrun writes the samples one process writes (DiT, FLUX, Wan; DiT also at
CFG 2 x SP 2; the models through diffusers' pipelines: their family tests); wrong world sizes and unguided runs are
clear errors."""
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from opendit import config as cfglib
from opendit.parallel import validate_cfg_parallel
from tests.distributed import run_distributed
from tests.run_each import sample_each, sample_here
from tests.families.test_flux import flux_cfg, tiny_text_encoders
from tests.test_train import ROOT, run_trainer, tiny_cfg


def _dit_and_inputs():
    """A 2-block DiT and a guided batch: x [4, 4, 8, 8] = [cond half; its copy], t [4], y [4] (labels; null 10)."""
    from opendit.families.dit.model import DiT

    torch.manual_seed(0)
    model = DiT(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=2, num_heads=4,
                num_classes=10).eval()
    for p in model.parameters():  # the zero-initialised adaLN and final layers would make every output 0
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(2, 4, 8, 8).repeat(2, 1, 1, 1)
    return model, x, torch.tensor([3, 500, 3, 500]), torch.tensor([1, 2, 10, 10])


def _hooked_forward(rank, world):
    from opendit.parallel import CommCounter, enable_cfg_parallel

    model, x, t, y = _dit_and_inputs()
    counter = CommCounter()
    enable_cfg_parallel(model, torch.distributed.group.WORLD, counter)
    with torch.no_grad():
        guided = model.forward_with_cfg(x, t, y, cfg_scale=3.0)
        with pytest.raises(ValueError, match="odd batch of 3"):
            model(x[:3], t[:3], y[:3])
    return guided, counter.total("cfg.all_gather")


def test_two_ranks_halves_equal_the_whole_batch():
    model, x, t, y = _dit_and_inputs()
    with torch.no_grad():
        whole = model.forward_with_cfg(x, t, y, cfg_scale=3.0)  # [4, 8, 8, 8]: guided eps + each half's sigma
    for guided, sent in run_distributed(_hooked_forward, 2):
        # each rank's half is a batch of 2 instead of 4: the same per-sample math, up to matmul blocking
        torch.testing.assert_close(guided, whole, rtol=1e-5, atol=1e-6)
        assert sent == whole.numel() // 2 * 4  # one all-gather per call: the other rank gets this rank's half


class _PairCalled(torch.nn.Module):
    """A model a pipeline calls twice per step (conditional, then unconditional) with keyword inputs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, hidden_states, timestep, encoder_hidden_states):
        return (self.proj(hidden_states) * timestep + encoder_hidden_states.mean(1, keepdim=True),)


def _pipeline_loop(model, steps, cond, uncond, change_at=None):
    """A pipeline's guidance loop: both calls per step, the conditions the same tensors every step."""
    x = torch.ones(2, 3, 4)
    for i in range(steps):
        if i == change_at:
            uncond = uncond + 1
        pos = model(hidden_states=x, timestep=1.0 - i / steps, encoder_hidden_states=cond)[0]
        neg = model(hidden_states=x, timestep=1.0 - i / steps, encoder_hidden_states=uncond)[0]
        x = x - 0.1 * (neg + 3.0 * (pos - neg))
    return x


def _paired_calls(rank, world):
    from opendit.parallel import CommCounter, enable_cfg_parallel

    model, cond, uncond = _PairCalled(), torch.randn(2, 5, 4), torch.randn(2, 7, 4)
    with torch.no_grad():
        whole = _pipeline_loop(model, 4, cond, uncond)
        model.cfg_calls = "pairs"
        counter = CommCounter()
        (hooks,) = enable_cfg_parallel(model, torch.distributed.group.WORLD, counter)
        split = _pipeline_loop(model, 4, cond, uncond)
        hooks.remove()
        enable_cfg_parallel(model, torch.distributed.group.WORLD)
        with pytest.raises(RuntimeError, match=r"unconditional call changed \['encoder_hidden_states'\]"):
            _pipeline_loop(model, 4, cond, uncond, change_at=2)
    return torch.equal(split, whole), counter.total("cfg.all_gather")


def test_pairs_of_calls_split_over_two_ranks_equal_one_process():
    """model.cfg_calls "pairs" (diffusers' pipelines that call the model for each guidance branch): the first step
    whole, then each rank computes one call of the pair; bitwise the one-process loop, one all-gather per later step,
    and a pipeline that changes the swapped conditions is an error."""
    for equal, sent in run_distributed(_paired_calls, 2):
        assert equal
        assert sent == 3 * 2 * 3 * 4 * 4  # steps 2-4: each rank's [2, 3, 4] output, 4 bytes each


@pytest.mark.parametrize("world, sp, match", [
    (1, 1, "needs 2 x --sequence_parallel_size = 2 processes .* got 1: launch torchrun --nproc_per_node 2"),
    (6, 2, "needs 2 x --sequence_parallel_size = 4 processes .* or a multiple of 4; got 6"),
])
def test_a_world_without_two_halves_is_refused(world, sp, match):
    with pytest.raises(ValueError, match=match):
        validate_cfg_parallel(world, sp, guided=True)
    validate_cfg_parallel(8, 2, guided=True)  # data parallel over two CFG x SP groups


@pytest.mark.parametrize("cfg_scale, conditions", [(1.0, [0, 1]), (4.0, [None])], ids=["scale1", "unconditional"])
def test_sampling_without_guidance_is_refused(cfg_scale, conditions):
    from opendit.inference import sampling_groups

    sample_cfg = cfglib.SampleConfig(ckpt="x", cfg_parallel=True, cfg_scale=cfg_scale)
    info = SimpleNamespace(rank=0, world_size=2, device=torch.device("cpu"))  # refused before any group is built
    with pytest.raises(ValueError, match="--cfg_parallel splits .* without guidance .* pass --cfg_scale > 1"):
        sampling_groups(None, sample_cfg, conditions, info)


def _sample(args, nproc=1):
    cmd = [sys.executable, *map(str, args)] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _equal_to_one_process(tmp_path, common, cases):
    """Each (nproc, flags) case's samples.npz against the 1-process run's: equal up to 1 level of 255 (a half
    batch rounds its matmuls differently from the whole one; a level flips where a value lies near a step). The
    1-process run samples in this process; the cases of one process count share one torchrun launch."""
    sample_here(*common, "--out", tmp_path / "one")
    one = np.load(tmp_path / "one" / "samples.npz")["arr_0"].astype(int)
    out = {(nproc, tuple(flags)): tmp_path / f"{nproc}{''.join(flags)}" for nproc, flags in cases}
    for n in dict.fromkeys(nproc for nproc, _ in cases):
        sample_each([[*common, *flags, "--out", out[nproc, tuple(flags)]] for nproc, flags in cases if nproc == n],
                    nproc=n)
    for nproc, flags in cases:
        got = np.load(out[nproc, tuple(flags)] / "samples.npz")["arr_0"].astype(int)
        assert got.shape == one.shape
        assert np.abs(got - one).max() <= 1, f"{nproc} processes {flags}: differs by {np.abs(got - one).max()}"


@pytest.fixture(scope="module")
def dit_flags(tmp_path_factory):
    """sample.py's flags for a DiT-debug checkpoint trained one step (3 samples in batches of 2, guided)."""
    outputs = tmp_path_factory.mktemp("dit_run")
    run_trainer(tiny_cfg(outputs, max_steps=1))
    return ["--ckpt", "latest", "--outputs", outputs, "--num_samples", "3", "--batch_size", "2",
            "--num_sampling_steps", "5", "--cfg_scale", "2", "--npz"]


@pytest.mark.slow
def test_dit_cfg_parallel_samples_equal_one_process(tmp_path, dit_flags):
    _equal_to_one_process(tmp_path, dit_flags, [(2, ["--cfg_parallel"])])
    alone = _sample(["sample.py", *dit_flags, "--cfg_parallel", "--out", tmp_path / "alone"])
    assert alone.returncode == 2 and "--cfg_parallel needs 2 x --sequence_parallel_size = 2 processes" in alone.stderr


@pytest.mark.slow
def test_dit_cfg_parallel_with_sequence_parallel_and_data_parallel(tmp_path, dit_flags):
    # 4 ranks: CFG 2 x SP 2 (one batch per step split both ways), then DP 2 x CFG 2 (two batches at a time)
    _equal_to_one_process(tmp_path, dit_flags, [(4, ["--cfg_parallel", "--sequence_parallel_size", "2"]),
                                                (4, ["--cfg_parallel"])])


@pytest.mark.slow
def test_flux_cfg_parallel_samples_equal_one_process(tmp_path):
    run_trainer(flux_cfg(tmp_path, tiny_text_encoders(tmp_path / "enc"), max_steps=1))
    common = ["--ckpt", "latest", "--outputs", tmp_path, "--prompts", "a one", "a two", "--num_samples", "3",
              "--batch_size", "2", "--num_sampling_steps", "3", "--cfg_scale", "2", "--npz"]
    _equal_to_one_process(tmp_path, common, [(2, ["--cfg_parallel"])])


@pytest.mark.slow
def test_wan_cfg_parallel_samples_equal_one_process(tmp_path):
    from opendit.families.wan.tiny_umt5 import save_tiny_umt5
    from tests.families.test_wan import wan_cfg

    run_trainer(wan_cfg(tmp_path, save_tiny_umt5(tmp_path / "umt5", max_length=16), max_steps=1))
    common = ["--ckpt", "latest", "--outputs", tmp_path, "--prompts", "the digit 1 moving up", "--num_samples", "3",
              "--batch_size", "2", "--num_sampling_steps", "3", "--npz"]  # Wan-debug guides at its default scale 8
    _equal_to_one_process(tmp_path, common, [(2, ["--cfg_parallel"])])
