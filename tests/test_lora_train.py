"""LoRA through the Trainer (DiT-debug on the digits at 8x8, as in test_train.py; flux-debug under sequence
parallelism): adapters on a frozen --init_weights base train, checkpoint, resume exactly and export; the plugins,
sequence parallelism and the lean options run them like the plain path; --init_lora starts from a previous
run's files; previews and sample.py use the adapters (unmerged) like the merged weights."""
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from opendit import config as cfglib
from opendit.checkpoint import export_weights, load_weights
from opendit.ema import clean_fqn
from tests.distributed import run_distributed
from tests.families.test_flux import flux_cfg, tiny_text_encoders
from tests.test_train import run_trainer, tiny_cfg

RANK, LR = 4, 1e-2


# ---- helpers ----------------------------------------------------------------------------------------------------
def lora_cfg(outputs, base, **kw):
    return tiny_cfg(outputs, **{"init_weights": base, "lora_rank": RANK, "lr": LR, **kw})


def build_trainer(cfg):
    """A Trainer set up but not trained; its process group is closed again."""
    from opendit.training.loop import Trainer

    try:
        return Trainer(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def model_state(trainer) -> dict[str, torch.Tensor]:
    """{official name: full tensor} of the model's parameters and buffers."""
    model = trainer.booster.unwrap(trainer.model)
    return {clean_fqn(k): _full(v) for k, v in model.state_dict().items()}


def adapters(trainer) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model_state(trainer).items() if ".lora_" in k}


def frozen(trainer) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model_state(trainer).items() if ".lora_" not in k}


def ema_state(trainer) -> dict[str, torch.Tensor]:
    return {k: _full(v) for k, v in trainer.ema.state_dict().items()}


def assert_base_unchanged(trainer, base: str) -> None:
    """Every non-adapter tensor of the model equals the base file's, bit for bit (in the dtype it is stored in:
    bf16 for the frozen Linear weights under --mixed_precision bf16)."""
    want = load_weights(base)
    have = frozen(trainer)
    assert have.keys() == want.keys()
    for name, value in have.items():
        assert torch.equal(value, want[name].to(value.dtype)), name


def assert_equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert torch.equal(a[name], b[name]), name


def checkpoint_of(outputs, step: int):
    return next((outputs).glob("*/checkpoints")) / f"step-{step:06d}"


# ---- fixtures ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(base weights, other weights): DiT-debug after 10 steps on the digits (an untrained DiT's zero-initialised
    modulation and final layer give its Linears no gradient), exported with export_weights; the other file
    is the same model with one weight changed."""
    root = tmp_path_factory.mktemp("lora_base")
    trainer, _ = run_trainer(tiny_cfg(root / "run", max_steps=10, log_every=10, lr=2e-3, ema_decay=0))
    state, meta = model_state(trainer), {"config": cfglib.run_record(trainer.chosen, trainer.cfg)}
    export_weights(str(root / "base.safetensors"), state, metadata=meta)
    state["blocks.0.attn.qkv.weight"] = state["blocks.0.attn.qkv.weight"] + 1e-3
    export_weights(str(root / "other.safetensors"), state, metadata=meta)
    return str(root / "base.safetensors"), str(root / "other.safetensors")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base):
    """A 20-step LoRA run (a checkpoint at step 20) and the same run with a learning rate of ~0 (the frozen
    base's losses on the same batches, noise and timesteps)."""
    root = tmp_path_factory.mktemp("lora_run")
    trainer, losses = run_trainer(lora_cfg(root / "lora", base[0], max_steps=20))
    _, reference = run_trainer(lora_cfg(root / "ref", base[0], max_steps=20, lr=1e-12))
    return trainer, losses, reference, checkpoint_of(root / "lora", 20)


# ---- one process ------------------------------------------------------------------------------------------------
def test_a_lora_run_trains_only_its_adapters_and_saves_only_them(base, lora_run):
    trainer, losses, reference, ckpt = lora_run
    assert_base_unchanged(trainer, base[0])
    model = trainer.booster.unwrap(trainer.model)
    trained = {clean_fqn(n): p for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(re.search(r"\.lora_[AB]\.0$", n) for n in trained)
    assert len(trained) == 2 * 8  # A and B of qkv, proj, fc1, fc2 in each of the 2 blocks
    optimized = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert len(optimized) == len(trained) and {id(p) for p in optimized} == {id(p) for p in trained.values()}
    assert set(trainer.ema.state_dict()) == set(trained)
    assert all(bool(v.abs().sum()) for k, v in adapters(trainer).items() if ".lora_B." in k)  # B started at zero
    # the same batches, noise and timesteps: step 1 is the base model's loss (B = 0), then the adapters learn
    assert losses[0] == reference[0] and all(np.isfinite(losses))
    assert all(a < b for a, b in zip(losses[2:], reference[2:])), (losses, reference)
    assert np.mean(losses[10:]) < 0.92 * np.mean(reference[10:]), (losses, reference)

    # the checkpoint: adapters, their optimizer states and EMA; no base weight
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    model_keys = {k[len("model."):] for k in saved if k.startswith("model.")}
    buffers = {clean_fqn(n) for n, _ in model.named_buffers()}
    assert set(trained) <= model_keys <= set(trained) | buffers
    assert {k[len("ema."):] for k in saved if k.startswith("ema.")} == set(trained)
    size = sum(f.stat().st_size for f in ckpt.glob("*.distcp"))
    full = sum(f.stat().st_size for f in checkpoint_of(Path(base[0]).parent / "run", 10).glob("*.distcp"))
    assert size < full / 5, (size, full)  # the base run's: all weights and their optimizer states, no EMA
    manifest = json.loads((ckpt / "manifest.json").read_text())["files"]
    for name in ("lora.safetensors", "lora_kohya.safetensors"):
        assert (ckpt / name).is_file() and name in manifest
    assert not (ckpt / "ema.safetensors").exists()

    # lora.safetensors holds the EMA's adapters
    from opendit.lora.formats import load_adapters
    from opendit.lora.layer import linear_names
    from opendit.lora.run import family_module_map

    ema = ema_state(trainer)
    for file in ("lora.safetensors", "lora_kohya.safetensors"):
        loaded = load_adapters(str(ckpt / file), family_module_map(trainer.family, model), linear_names(model))
        assert len(loaded) == 8
        for name, a in loaded.items():
            assert torch.equal(a.A, ema[f"{name}.lora_A.0"]) and torch.equal(a.B, ema[f"{name}.lora_B.0"]), name
            assert a.alpha == RANK


def test_resumed_lora_run_equals_uninterrupted_and_refuses_another_base(tmp_path, base):
    full, full_losses = run_trainer(lora_cfg(tmp_path / "a", base[0], max_steps=6, ckpt_every=3))
    run_trainer(lora_cfg(tmp_path / "b", base[0], max_steps=3, ckpt_every=3))
    resumed, resumed_losses = run_trainer(lora_cfg(tmp_path / "b", base[0], max_steps=6, ckpt_every=3,
                                                   load="latest"))
    assert resumed_losses == full_losses[3:]  # exact in fp32
    assert_equal_states(adapters(resumed), adapters(full))
    assert_equal_states(ema_state(resumed), ema_state(full))
    assert_base_unchanged(resumed, base[0])
    with pytest.raises(ValueError, match="pass the same base weights") as err:
        build_trainer(lora_cfg(tmp_path / "b", base[1], max_steps=9, load="latest"))
    assert base[0] in str(err.value) and base[1] in str(err.value)


@pytest.mark.parametrize("overrides, match", [
    (dict(lora_rank=4), "--lora_rank 4 trains adapters on frozen base weights: pass them with --init_weights"),
    (dict(lora_alpha=8.0), "--lora_alpha applies to LoRA runs: add --lora_rank"),
    (dict(init_lora="x.safetensors"), "--init_lora applies to LoRA runs: add --lora_rank"),
])
def test_lora_flags_without_their_prerequisite_are_refused(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        run_trainer(tiny_cfg(tmp_path, **overrides))
    assert not any(tmp_path.iterdir())  # refused before any work


def test_mixed_precision_bf16_stores_the_frozen_linears_in_bf16_and_adapters_in_fp32(tmp_path, base):
    trainer, losses = run_trainer(lora_cfg(tmp_path, base[0], max_steps=2, mixed_precision="bf16"))
    model = trainer.booster.unwrap(trainer.model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert all(m.bias.dtype == torch.bfloat16 for m in linears if m.bias is not None)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.dtype == torch.float32, name
    assert model.pos_embed.dtype == torch.float32  # frozen, not a Linear: kept as built
    assert all(v.dtype == torch.float32 for v in trainer.ema.state_dict().values())
    assert all(np.isfinite(losses))
    assert_base_unchanged(trainer, base[0])


LEAN = {
    "grad_checkpoint": dict(grad_checkpoint=1),
    "bf16_exact-offload-u16-fused": dict(mixed_precision="bf16", master_weights="bf16_exact", optimizer_offload=True,
                                         optimizer_state_dtype="u16", fused_backward=True),
    "block_swap": dict(blocks_to_swap=1),  # one process (plugin ddp)
}


@pytest.fixture(scope="module")
def plain_4_steps(tmp_path_factory, base):
    return run_trainer(lora_cfg(tmp_path_factory.mktemp("plain4"), base[0], max_steps=4))[1]


@pytest.mark.parametrize("name", LEAN)
def test_lean_options_train_lora_and_resume_exactly(tmp_path, base, plain_4_steps, name):
    kw = LEAN[name]
    full, full_losses = run_trainer(lora_cfg(tmp_path / "a", base[0], max_steps=4, ckpt_every=2, **kw))
    run_trainer(lora_cfg(tmp_path / "b", base[0], max_steps=2, ckpt_every=2, **kw))
    resumed, resumed_losses = run_trainer(lora_cfg(tmp_path / "b", base[0], max_steps=4, ckpt_every=2,
                                                   load="latest", **kw))
    assert all(np.isfinite(full_losses))
    assert resumed_losses == full_losses[2:]
    assert_equal_states(adapters(resumed), adapters(full))
    assert_base_unchanged(full, base[0])
    assert all(bool(v.abs().sum()) for k, v in adapters(full).items() if ".lora_B." in k)
    if name == "block_swap":
        assert full.booster.plugin.block_swap is not None
    if "mixed_precision" in kw:  # bf16 weights and compressed states: close to the plain fp32 run, not equal
        assert full_losses == pytest.approx(plain_4_steps, rel=0.05)
        model = full.booster.unwrap(full.model)
        assert all(p.dtype == torch.bfloat16 for p in model.parameters() if p.requires_grad)  # bf16 master
        assert full.fused is not None
    else:  # the same arithmetic, rearranged
        assert full_losses == pytest.approx(plain_4_steps, rel=1e-5)


def test_init_lora_starts_from_a_previous_runs_adapters(tmp_path, base, lora_run):
    trainer, _, _, ckpt = lora_run
    ema = ema_state(trainer)
    first = {}
    for file in ("lora.safetensors", "lora_kohya.safetensors"):
        started = build_trainer(lora_cfg(tmp_path / file, base[0], init_lora=str(ckpt / file)))
        assert_equal_states(adapters(started), ema)
        assert_equal_states(ema_state(started), ema)  # the EMA starts from them too
        first[file] = run_trainer(lora_cfg(tmp_path / f"{file}-run", base[0], init_lora=str(ckpt / file),
                                           max_steps=1))[1]
    assert first["lora.safetensors"] == first["lora_kohya.safetensors"]
    # another --lora_alpha: the run keeps its scale, B is rescaled so that the weights change as the file says
    scaled = adapters(build_trainer(lora_cfg(tmp_path / "alpha", base[0], init_lora=str(ckpt / "lora.safetensors"),
                                             lora_alpha=2.0 * RANK)))
    for key in (k for k in ema if ".lora_B." in k):
        a_key = key.replace(".lora_B.", ".lora_A.")
        torch.testing.assert_close(scaled[key] @ scaled[a_key] * 2.0, ema[key] @ ema[a_key], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=f"has rank {RANK}.*pass --lora_rank {RANK}"):
        build_trainer(lora_cfg(tmp_path / "rank", base[0], lora_rank=2, init_lora=str(ckpt / "lora.safetensors")))


def test_previews_and_sampling_a_lora_checkpoint_equal_the_merged_weights(tmp_path, base, lora_run):
    trainer, _ = run_trainer(lora_cfg(tmp_path / "preview", base[0], max_steps=2, sample_every=2, preview_steps=2))
    assert list((trainer.run_dir / "previews").glob("*2.png"))  # the step-2 grid

    import sample
    from opendit.lora.__main__ import main as lora_cli

    ckpt = lora_run[3]
    merged = tmp_path / "merged.safetensors"
    assert lora_cli(["merge", "--ckpt", str(ckpt), "--out", str(merged)]) == 0
    common = dict(num_samples=4, batch_size=4, num_sampling_steps=5, cfg_scale=2.0, npz=True)
    arrays = {}
    for name, path in (("lora", ckpt), ("merged", merged), ("base", base[0])):
        try:
            sample.main(cfglib.SampleConfig(ckpt=str(path), out=str(tmp_path / name), **common))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        arrays[name] = np.load(tmp_path / name / "samples.npz")["arr_0"]
    assert arrays["lora"].shape == (4, 8, 8, 3)
    # the adapters applied unmerged vs folded into the weights: fp32 rounding only
    diff = np.abs(arrays["lora"].astype(int) - arrays["merged"].astype(int))
    assert diff.max() <= 1 and (diff == 0).mean() > 0.95, diff.max()
    assert not np.array_equal(arrays["lora"], arrays["base"])  # the adapters change the samples


# ---- two processes ----------------------------------------------------------------------------------------------
STEPS = 3
PLUGIN_CASES = {
    "zero2": dict(plugin="zero2"),
    "fsdp": dict(plugin="zero3", sample_every=STEPS, preview_steps=2),  # a preview of the gathered adapters
    "hsdp": dict(plugin="hsdp", dp_replicate=2),
    "gemini": dict(plugin="gemini"),
}
SP_CASES = {f"sp2-{kind}": dict(sequence_parallel_size=2, sequence_parallel_type=kind)
            for kind in ("ulysses", "fastseq")}
FLUX_SP_CASES = {"flux-sp2": dict(sequence_parallel_size=2)}


def _two_process_worker(rank, world_size, root, dit_base, flux_base, encoders):
    from opendit.training.loop import Trainer

    def run(cfg):
        trainer = Trainer(cfg)
        return trainer.train(), adapters(trainer)  # gathered on every rank (a collective under FSDP)

    out = {name: run(lora_cfg(f"{root}/{name}", dit_base, max_steps=STEPS, **kw))
           for name, kw in {"ddp": {}, **PLUGIN_CASES, **SP_CASES}.items()}
    out |= {name: run(flux_lora_cfg(f"{root}/{name}", flux_base, encoders, **kw))
            for name, kw in FLUX_SP_CASES.items()}
    # a sharded resume: the adapters' DTensors, their optimizer states and the EMA through DCP (trainable only)
    resume = dict(plugin="zero3", ckpt_every=2)
    run(lora_cfg(f"{root}/part", dit_base, max_steps=2, **resume))
    out["fsdp-full"] = run(lora_cfg(f"{root}/full", dit_base, max_steps=4, **resume))
    out["fsdp-resumed"] = run(lora_cfg(f"{root}/part", dit_base, max_steps=4, load="latest", **resume))
    return out if rank == 0 else {name: losses for name, (losses, _) in out.items()}


def flux_lora_cfg(outputs, flux_base, encoders, **kw):
    return flux_cfg(outputs, encoders, **{"init_weights": flux_base, "lora_rank": RANK, "lr": LR,
                                          "max_steps": STEPS, **kw})


@pytest.fixture(scope="module")
def flux_base(tmp_path_factory):
    """(tiny T5 and CLIP folders, flux-debug weights after 4 steps on the captioned digits)."""
    root = tmp_path_factory.mktemp("lora_flux")
    encoders = tiny_text_encoders(root)
    trainer, _ = run_trainer(flux_cfg(root / "run", encoders, max_steps=4, ema_decay=0, lr=2e-3))
    export_weights(str(root / "base.safetensors"), model_state(trainer))
    return encoders, str(root / "base.safetensors")


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory, base, flux_base):
    """Every two-process case, run in one spawned gloo group, and the one-process runs sequence parallelism
    compares with (both ranks of an SP group see the same batch one process does)."""
    root = tmp_path_factory.mktemp("lora_dist")
    encoders, flux_weights = flux_base
    rank0, rank1 = run_distributed(_two_process_worker, 2, str(root), base[0], flux_weights, encoders)
    assert rank1 == {name: losses for name, (losses, _) in rank0.items()}  # the logged loss is all-reduced
    for name, cfg in (("one", lora_cfg(root / "one", base[0], max_steps=STEPS)),
                      ("flux-one", flux_lora_cfg(root / "flux-one", flux_weights, encoders))):
        trainer, losses = run_trainer(cfg)
        rank0[name] = losses, adapters(trainer)
    rank0["root"] = root
    return rank0


@pytest.mark.slow
@pytest.mark.parametrize("case", [*PLUGIN_CASES, *SP_CASES, *FLUX_SP_CASES])
def test_two_process_lora_runs_equal_the_plain_ones(two_process_runs, case):
    # the plugins shard the batch like 2-process ddp; sequence parallelism splits each sample's tokens (the
    # SP projections take the LoRA Linears' merged weight, opendit.models.layers.linear_weight)
    ref_losses, ref_adapters = two_process_runs["flux-one" if case.startswith("flux") else
                                                "one" if case.startswith("sp") else "ddp"]
    losses, trained = two_process_runs[case]
    if PLUGIN_CASES.get(case, {}).get("sample_every"):
        assert list((two_process_runs["root"] / case).glob(f"*/previews/*{STEPS}.png"))
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)  # as the family tests' plugin equivalence
    assert trained.keys() == ref_adapters.keys()
    # fp32: only the order of sums differs (test_booster_dist's 5e-6 for the plugins). Sequence parallelism
    # also splits the attention's sums, and Adam's 1 / sqrt(v) turns that rounding of the few smallest
    # gradients into up to ~7e-6 (flux-debug; mean 3e-8) after steps of lr = 1e-2
    atol = 5e-6 if case in PLUGIN_CASES else 2e-5
    for name, value in trained.items():
        if ".lora_B." in name:
            assert value.abs().max() > 1e-3, f"{case}: {name} did not train"
        torch.testing.assert_close(value, ref_adapters[name], rtol=0, atol=atol, msg=f"{case}: {name}")




@pytest.mark.slow
def test_a_sharded_lora_run_resumes_exactly(two_process_runs):
    (full, full_adapters), (resumed, resumed_adapters) = (two_process_runs[k] for k in ("fsdp-full", "fsdp-resumed"))
    assert resumed == full[2:]
    assert_equal_states(resumed_adapters, full_adapters)


def test_sampling_a_lora_checkpoint_whose_base_moved_names_the_fix(tmp_path):
    from opendit.run_files import lora_run_weights

    step = tmp_path / "step-000010"
    step.mkdir()
    with pytest.raises(ValueError, match="without its lora.safetensors; pass the base weights as --ckpt"):
        lora_run_weights(step, {"init_weights": str(tmp_path / "base.safetensors")})
    (step / "lora.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"base.safetensors\) are not there; pass them as --ckpt and the adapters "
                                         r"with --lora .*step-000010/lora.safetensors"):
        lora_run_weights(step, {"init_weights": str(tmp_path / "base.safetensors")})
