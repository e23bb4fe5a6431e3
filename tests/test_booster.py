"""Fast single-process booster tests: config validation, loss scaling, block transforms, optimizer rebinding,
and a Booster that starts its own one-process group."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from opendit.booster import Booster, DynamicLossScaler, build_plugin, mesh_shape, validate_parallel_config
from opendit.booster import parallelize as par
from opendit.booster.precision import cast_forward_io, params_in_dtype
from tests.test_booster_helpers import make_model, make_optimizer


@pytest.mark.parametrize("kwargs, match", [
    (dict(plugin="zero4", world_size=2), "valid plugins: ddp, zero2, zero3, fsdp, hsdp, gemini"),
    (dict(plugin="hsdp", world_size=6, dp_replicate=4), "--dp_replicate 4 does not divide"),
    (dict(plugin="zero3", world_size=8, sp_size=3), "sequence-parallel size 3 does not divide the world size 8"),
    (dict(plugin="hsdp", world_size=8, dp_replicate=4, sp_size=4), "--dp_replicate 4 does not divide"),
    (dict(plugin="zero2", world_size=4, dp_replicate=2), "only applies to --plugin hsdp"),
    (dict(plugin="ddp", world_size=2, mixed_precision="fp8"), "unknown mixed precision 'fp8'"),
    (dict(plugin="ddp", world_size=2, grad_checkpoint=-1), "grad_checkpoint must be"),
])
def test_impossible_configurations_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        validate_parallel_config(**kwargs)


def test_build_plugin_rejects_unknown_names_and_settings():
    with pytest.raises(ValueError, match="valid plugins: ddp, zero2"):
        build_plugin("colossal")
    with pytest.raises(ValueError, match="only applies to --plugin hsdp"):
        build_plugin("zero3", dp_replicate=2)
    assert build_plugin("fsdp").reshard_after_forward and not build_plugin("zero2").reshard_after_forward
    assert build_plugin("gemini").offload and build_plugin("hsdp").replicate
    assert build_plugin("ddp", compile=True).compile_backend == "inductor"


@pytest.mark.parametrize("plugin, world, kwargs, shape", [
    ("ddp", 8, {}, (8, 1, 1)), ("zero2", 8, {}, (1, 8, 1)), ("hsdp", 8, dict(dp_replicate=2), (2, 4, 1)),
    ("zero3", 8, dict(sp_size=2), (1, 4, 2)), ("hsdp", 8, dict(dp_replicate=2, sp_size=2), (2, 2, 2)),
])
def test_mesh_shapes(plugin, world, kwargs, shape):
    validate_parallel_config(plugin, world, **kwargs)
    assert mesh_shape(plugin, world, **kwargs) == shape


def test_loss_scaler_skips_overflow_and_grows_after_clean_steps():
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([8.0, 16.0, 24.0])
    assert not scaler.unscale_([p]) and torch.equal(p.grad, torch.tensor([1.0, 2.0, 3.0]))
    assert not scaler.unscale_([p]) and torch.equal(p.grad, torch.tensor([1.0, 2.0, 3.0])), "unscaled twice"
    assert scaler.update() and scaler.scale == 8.0
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert scaler.unscale_([p]) and not scaler.update()
    assert scaler.scale == 4.0 and scaler.skipped_steps == 1
    for _ in range(2):
        p.grad = torch.ones(3)
        scaler.unscale_([p])
        scaler.update()
    assert scaler.scale == 8.0
    restored = DynamicLossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


def _loss_and_grads(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, t, y = torch.randn(2, 3, 8, 8, generator=g), torch.tensor([3, 500]), torch.tensor([1, 7])
    model.zero_grad()
    loss = model(x, t, y).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("every, expected", [(1, 2), (2, 1), (0, 0)])
def test_activation_checkpointing_keeps_keys_and_math(every, expected):
    plain, ac = make_model(), make_model()
    keys = list(plain.state_dict())
    assert par.apply_activation_checkpointing(ac, every) == expected
    assert list(ac.state_dict()) == keys
    (l0, g0), (l1, g1) = _loss_and_grads(plain), _loss_and_grads(ac)
    assert torch.equal(l0, l1) and all(torch.equal(g0[n], g1[n]) for n in g0)


def test_per_block_compile_keeps_keys_and_math():
    plain, compiled = make_model(), make_model()
    par.apply_compile(compiled, backend="eager")
    assert list(compiled.state_dict()) == list(plain.state_dict())
    (l0, g0), (l1, g1) = _loss_and_grads(plain), _loss_and_grads(compiled)
    assert torch.allclose(l0, l1) and all(torch.allclose(g0[n], g1[n]) for n in g0)


def test_models_must_declare_their_blocks():
    with pytest.raises(ValueError, match="_block_lists"):
        list(par.iter_blocks(nn.Linear(2, 2)))


def test_rebind_optimizer_keeps_groups_and_rejects_stepped_optimizers():
    model = make_model()
    optimizer = make_optimizer(model)
    names = par.parameter_names(model)
    for module in model.modules():  # what a sharding transform does: new Parameter objects, same names
        for n, p in list(module.named_parameters(recurse=False)):
            setattr(module, n, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
    par.rebind_optimizer(optimizer, names, model)
    params = {id(p) for p in model.parameters()}
    assert all(id(p) in params for g in optimizer.param_groups for p in g["params"])
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]
    assert optimizer.param_groups[1]["lr"] == 5e-4
    _loss_and_grads(model)
    optimizer.step()
    with pytest.raises(ValueError, match="before the first optimizer step"):
        par.rebind_optimizer(optimizer, par.parameter_names(model), model)
    stranger = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        par.rebind_optimizer(stranger, par.parameter_names(model), model)


@pytest.mark.skipif(dist.is_initialized(), reason="needs no process group in this process")
def test_booster_without_process_group_starts_and_closes_its_own():
    booster = Booster(build_plugin("zero3", mixed_precision="bf16", grad_checkpoint=1))
    try:
        assert dist.get_world_size() == 1 and (booster.dp_size, booster.dp_rank) == (1, 0)
        assert booster.mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "sp") and booster.sp_group is None
        plain = make_model()
        model = make_model()
        optimizer = make_optimizer(model)
        model, optimizer, _, _ = booster.boost(model, optimizer)
        assert list(booster.unwrap(model).state_dict()) == list(plain.state_dict())
        with booster.autocast():
            loss = model(torch.randn(2, 3, 8, 8), torch.tensor([1, 2]), torch.tensor([3, 4])).square().mean()
        assert loss.dtype == torch.float32  # the root returns fp32 so the loss is computed in fp32
        booster.backward(loss, optimizer)
        assert float(booster.clip_grad_norm_(model, 1.0)) > 0
        assert booster.step(optimizer) and all(p.grad is None for p in model.parameters())
    finally:
        booster.close()
    assert not dist.is_initialized()


def test_forward_io_cast_for_bf16_params():
    """ddp with bf16 params (a bf16 --master_weights mode): no autocast; floating inputs reach the model as bf16,
    integer ones unchanged, and the output leaves as fp32, as at an FSDP2 root."""
    seen = {}

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))

        def forward(self, x, t, scale=None):
            seen.update(x=x.dtype, t=t.dtype, scale=scale.dtype)
            return {"out": x * self.w * scale}

    model = Probe()
    assert params_in_dtype(model, torch.bfloat16) and not params_in_dtype(torch.nn.Linear(2, 2), torch.bfloat16)
    cast_forward_io(model, torch.bfloat16)
    out = model(torch.full((3,), 1 / 3), torch.arange(3), scale=torch.ones(3))["out"]
    assert seen == dict(x=torch.bfloat16, t=torch.int64, scale=torch.bfloat16)
    assert out.dtype == torch.float32 and torch.equal(out, torch.full((3,), 1 / 3).bfloat16().float())
