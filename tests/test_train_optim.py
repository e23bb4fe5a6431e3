"""train.py's optimizer flags through the Trainer: --optimizer, --optimizer_offload, --optimizer_state_dtype,
--master_weights, --fused_backward, --blocks_to_swap (DiT-debug on the digits at 8x8, as in test_train.py)."""
import contextlib

import pytest
import torch
import torch.distributed as dist

from opendit import optim as lean
from opendit.optim import build_optimizer
from opendit.training.optimizer import run_optimizer_settings
from tests.test_train import run_trainer, tiny_cfg

LEAN_U16 = dict(optimizer_state_dtype="u16", optimizer_offload=True)
BF16_EXACT = dict(master_weights="bf16_exact", mixed_precision="bf16")


def params(trainer) -> torch.Tensor:
    """Every parameter, gathered if sharded, as one fp32 vector."""
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in trainer.model.parameters()]
    return torch.cat([p.detach().float().flatten() for p in full])


def train(outputs, **kw):
    trainer, losses = run_trainer(tiny_cfg(outputs, **kw))
    return trainer, losses


@pytest.mark.parametrize("flags, kind", [
    ({}, torch.optim.AdamW),  # all defaults: torch's AdamW, as before these flags
    ({"optimizer_state_dtype": "bf16"}, lean.AdamW),
    ({"optimizer_offload": True}, lean.AdamW),
    ({"fused_backward": True}, lean.AdamW),
    ({"optimizer": "nadamw"}, lean.NAdamW),
    ({"optimizer": "adan"}, lean.Adan),
    ({"optimizer": "adafactor"}, torch.optim.Adafactor),
])
def test_flags_pick_the_optimizer(flags, kind, tmp_path):
    model = torch.nn.Linear(4, 3)
    settings = run_optimizer_settings(tiny_cfg(tmp_path, lr=1e-3, weight_decay=0.01, **flags))
    opt = build_optimizer(model.parameters(), settings, hooks=False)
    assert type(opt) is kind
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[0]["weight_decay"] == 0.01


def test_fused_backward_equals_normal_step_and_lean_fp32_tracks_torch(tmp_path):
    torch_run, torch_losses = train(tmp_path / "torch", max_steps=4)
    step_run, step_losses = train(tmp_path / "step", max_steps=4, optimizer_offload=True)
    fused_run, fused_losses = train(tmp_path / "fused", max_steps=4, optimizer_offload=True, fused_backward=True)
    assert fused_run.fused is not None and step_run.fused is None
    assert fused_losses == step_losses and torch.equal(params(fused_run), params(step_run))
    # opendit's AdamW with fp32 states is torch's AdamW op for op; torch's foreach kernels may round differently
    assert step_losses == pytest.approx(torch_losses, rel=1e-6)
    assert (params(step_run) - params(torch_run)).abs().max() <= 1e-6


@pytest.mark.parametrize("kw", [
    dict(**LEAN_U16, **BF16_EXACT),  # compressed states on the host, bf16 params + int16 residual
    dict(optimizer="adan", optimizer_state_dtype="f24", fused_backward=True),
    dict(optimizer="adafactor"),
    dict(master_weights="fp32_copy", mixed_precision="bf16"),  # the fast path: multi-tensor fused AdamW
], ids=["adamw-u16-offload-bf16_exact", "adan-f24-fused", "adafactor", "adamw-fp32_copy"])
def test_resume_equals_uninterrupted(tmp_path, kw):
    full, full_losses = train(tmp_path / "a", max_steps=6, ckpt_every=3, **kw)
    train(tmp_path / "b", max_steps=3, ckpt_every=3, **kw)
    resumed, resumed_losses = train(tmp_path / "b", max_steps=6, ckpt_every=3, load="latest", **kw)
    assert resumed_losses == full_losses[3:]
    assert torch.equal(params(resumed), params(full))
    a, b = full.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert a.keys() == b.keys() and len(a) > 0
    for pid in a:
        for key, value in a[pid].items():
            assert torch.equal(value, b[pid][key]), (pid, key)


def test_bf16_master_weights_keep_bf16_params_fp32_ema_and_residual(tmp_path):
    trainer, losses = train(tmp_path, max_steps=3, optimizer_state_dtype="u16", **BF16_EXACT)
    model = trainer.booster.unwrap(trainer.model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters() if p.requires_grad)
    assert model.pos_embed.dtype == torch.float32  # frozen: not the optimizer's, kept as built
    assert all(t.dtype == torch.float32 for t in trainer.ema.state_dict().values())
    state = trainer.optimizer.state[model.blocks[0].attn.qkv.weight]
    assert state["master_lo"].dtype == torch.int16 and "exp_avg.u16" in state
    assert all(map(torch.isfinite, map(torch.tensor, losses)))


@pytest.mark.parametrize("plugin", ["ddp", "zero2"])
def test_fp32_copy_trains_like_bf16_exact_bitwise(tmp_path, plugin):
    """The fast path (bf16 params, fp32 master copy, multi-tensor fused AdamW) and the memory-lean one
    (int16 residual, per-parameter updates) hold the same fp32 master, so whole runs agree bit for bit.
    Under ddp both run without autocast: the plugin casts inputs to bf16 and outputs to fp32."""
    fast, fast_losses = train(tmp_path / "copy", max_steps=4, plugin=plugin, master_weights="fp32_copy",
                              mixed_precision="bf16")
    lean_run, lean_losses = train(tmp_path / "exact", max_steps=4, plugin=plugin, **LEAN_U16 | BF16_EXACT |
                                  dict(optimizer_state_dtype="fp32"))
    assert fast.optimizer.multi_tensor_ready() and not lean_run.optimizer.multi_tensor_ready()
    assert fast_losses == lean_losses and torch.equal(params(fast), params(lean_run))
    model = fast.booster.unwrap(fast.model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters() if p.requires_grad)
    if plugin == "ddp":
        assert fast.booster.plugin.params_in_compute_dtype
        assert isinstance(fast.booster.autocast(), type(contextlib.nullcontext()))


@pytest.mark.parametrize("kw", [
    dict(grad_checkpoint=1),  # torch's AdamW steps the swapped blocks on the host
    dict(optimizer="adan", fused_backward=True, optimizer_offload=True),
], ids=["torch-adamw-checkpointed", "adan-fused-offload"])
def test_block_swap_training_equals_no_swap(tmp_path, kw):
    ref, ref_losses = train(tmp_path / "ref", max_steps=4, **kw)
    swapped, losses = train(tmp_path / "swap", max_steps=4, blocks_to_swap=2, **kw)
    swap = swapped.booster.plugin.block_swap
    assert swap is not None and swap.swapped == [0, 1]  # DiT-debug's two blocks
    assert not swap._resident  # between steps every swapped block is back on the host copy
    assert losses == ref_losses and torch.equal(params(swapped), params(ref))


def test_one_process_ddp_has_no_wrapper_and_still_accumulates(tmp_path):
    trainer, losses = train(tmp_path, max_steps=2, grad_accum=2)  # no_sync on the plain module: a no-op
    assert not isinstance(trainer.model, torch.nn.parallel.DistributedDataParallel)
    assert trainer.booster.plugin.block_swap is None and trainer.fused is None
    assert len(losses) == 2 and all(map(torch.isfinite, map(torch.tensor, losses)))


@pytest.mark.parametrize("overrides, match", [
    (dict(optimizer="sgd"), "unknown --optimizer 'sgd'"),
    (dict(optimizer_state_dtype="int8"), "valid: fp32, bf16, u16, f24"),
    (dict(master_weights="fp16"), "valid: fp32, bf16_exact, bf16_stochastic"),
    (dict(master_weights="bf16_exact"), "add --mixed_precision bf16"),
    (dict(optimizer="adafactor", optimizer_offload=True), "drop them"),
    (dict(optimizer="adafactor", plugin="zero2"), "--plugin ddp"),
    (dict(fused_backward=True, grad_accum=2), "--grad_accum 1"),
    (dict(fused_backward=True, grad_clip=1.0), "--grad_clip 0"),
    (dict(fused_backward=True, mixed_precision="fp16"), "--mixed_precision bf16"),
    (dict(fused_backward=True, blocks_to_swap=1), "needs --optimizer_offload"),
    (dict(blocks_to_swap=1, plugin="zero2"), "use --plugin ddp in one process"),
    (dict(blocks_to_swap=1, compile=True), "drop --compile"),
    (dict(blocks_to_swap=-1), "integer >= 0"),
])
def test_bad_combinations_fail_before_any_work(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        run_trainer(tiny_cfg(tmp_path, **overrides))
    assert not any(tmp_path.iterdir())  # no run folder: nothing was loaded or written


def test_too_many_swapped_blocks_is_named(tmp_path):
    with pytest.raises(ValueError, match="between 0 and the model's 2 blocks"):
        run_trainer(tiny_cfg(tmp_path, blocks_to_swap=3))


# ---- two processes (gloo) ---------------------------------------------------------------------------------------
FSDP_CASES = {
    "zero2": dict(plugin="zero2", optimizer_state_dtype="u16"),
    "zero3": dict(plugin="zero3", optimizer="adan"),
    "hsdp": dict(plugin="hsdp", dp_replicate=2, optimizer_offload=True),  # hooks after the replicas' all-reduce
    "gemini": dict(plugin="gemini", **BF16_EXACT),  # sharded and on the CPU
}
REFUSED_AT_2 = {
    "ddp-fused": (dict(fused_backward=True), "un-reduced gradient"),
    "ddp-swap": (dict(blocks_to_swap=1), "world size is 2"),
}


def _two_rank_worker(rank, world_size, root):
    from opendit.training.loop import Trainer

    def run(name, **kw):
        trainer = Trainer(tiny_cfg(f"{root}/{name}", max_steps=kw.pop("max_steps", 3), **kw))
        return trainer.train(), params(trainer), trainer

    out = {}
    for name, kw in FSDP_CASES.items():
        step_losses, step_params, _ = run(name, **kw)
        fused_losses, fused_params, trainer = run(name + "-fused", fused_backward=True, **kw)
        out[name] = (step_losses, fused_losses, torch.equal(step_params, fused_params), trainer.fused is not None)
    # ddp at 2 ranks steps opendit's optimizer after DDP's all-reduce (no fused backward there)
    out["ddp"] = run("ddp", **(FSDP_CASES["zero2"] | {"plugin": "ddp"}))[0]
    # resume a sharded fused run with compressed, offloaded states: DTensor states through DCP
    resume = dict(plugin="zero2", fused_backward=True, **LEAN_U16, ckpt_every=3)
    full_losses, full_params, _ = run("full", max_steps=6, **resume)
    run("part", max_steps=3, **resume)
    resumed_losses, resumed_params, _ = run("part", max_steps=6, load="latest", **resume)
    out["resume"] = (full_losses[3:], resumed_losses, torch.equal(full_params, resumed_params))
    for name, (kw, _) in REFUSED_AT_2.items():
        try:
            Trainer(tiny_cfg(f"{root}/{name}", **kw))
            out[name] = "no error"
        except ValueError as err:
            out[name] = str(err)
    return out


@pytest.mark.slow
def test_two_ranks_fsdp_fused_backward_equals_step_and_ddp_refusals(tmp_path):
    from tests.distributed import run_distributed

    rank0, rank1 = run_distributed(_two_rank_worker, 2, str(tmp_path))
    for name in FSDP_CASES:  # FSDP2 runs the hooks on the sharded parameters with the reduced gradient
        step_losses, fused_losses, same_params, fused_on = rank0[name]
        assert fused_on and fused_losses == step_losses and same_params, name
        assert rank1[name] == rank0[name]
    # same optimizer and global batches; only the gradient reduction (all-reduce vs reduce-scatter) differs
    assert rank0["ddp"] == pytest.approx(rank0["zero2"][0], rel=1e-5)
    full, resumed, same = rank0["resume"]
    assert resumed == full and same
    for name, (_, match) in REFUSED_AT_2.items():
        assert match in rank0[name], (name, rank0[name])


@pytest.mark.gpu
def test_cuda_block_swap_with_fused_offloaded_adamw_equals_no_swap(tmp_path):
    kw = dict(fused_backward=True, optimizer_offload=True, optimizer_state_dtype="u16", **BF16_EXACT)
    ref, ref_losses = train(tmp_path / "ref", max_steps=4, **kw)
    swapped, losses = train(tmp_path / "swap", max_steps=4, blocks_to_swap=1, **kw)
    blocks = swapped.booster.unwrap(swapped.model).blocks
    assert blocks[1].attn.qkv.weight.device.type == "cpu" and blocks[0].attn.qkv.weight.is_cuda
    assert losses == ref_losses and torch.equal(params(swapped), params(ref))
    assert not dist.is_initialized()
