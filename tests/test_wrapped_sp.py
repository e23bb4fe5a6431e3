"""Sequence parallelism of diffusers transformers (opendit.families.wrapped.context_parallel): at 2 ranks under gloo
the output and every parameter's gradient equal the unsplit model's (FLUX.1, FLUX.2 [klein], Qwen-Image with a padded
text mask, Wan2.1's clips), a token count that does not split evenly is an error naming it, and a model without a
context-parallel plan (Z-Image) refuses --sequence_parallel_size. Training and sampling at 2 ranks: the families'
tests."""
import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed

MODELS = {"flux1": "flux1-debug-diffusers", "flux2": "flux2-klein-debug", "qwenimage": "qwen-image-debug",
          "wan21": "wan-debug-diffusers"}
# inputs at 2 ranks: an even and an odd token count (images: 2x2-packed latents; Wan-debug: 4x4-patched clips)
GRIDS = {"wan21": ((2, 8, 12), (3, 4, 20), "15 tokens")}
IMAGE_GRIDS = ((4, 6), (3, 5), "15 tokens")


def _split_equals_unsplit(rank, world_size, family_name):
    from opendit.families import get_family
    from opendit.parallel import enable_sequence_parallel

    family = get_family(family_name)
    glue, spec = family.glue, family.models[MODELS[family_name]]
    torch.manual_seed(0)
    plain, split = spec.build(), spec.build()
    split.load_state_dict(plain.state_dict())
    hook = enable_sequence_parallel(split, dist.new_group([0, 1]), "auto")
    even, odd_grid, odd_tokens = GRIDS.get(family_name, IMAGE_GRIDS)
    x, t = torch.randn(2, spec.arch["in_channels"], *even), torch.rand(2)
    cond = glue.random_conditions(spec, 2, "cpu")
    if "mask" in cond:
        cond["mask"][1, 5:] = False  # one padded caption

    def step(model):
        v = glue.from_output(model(**glue.forward_kwargs(model, x, t, cond, None))[0], x.shape)
        (v - x).square().mean().backward()
        return v.detach()
    out, split_out = step(plain), step(split)
    worst = 0.0
    for (name, p), q in zip(plain.named_parameters(), split.parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        grad = q.grad.clone()
        dist.all_reduce(grad)  # every plugin averages over the group
        worst = max(worst, ((grad / world_size - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item())
    odd = torch.randn(2, spec.arch["in_channels"], *odd_grid)
    with pytest.raises(ValueError, match=rf"splits hidden_states \({odd_tokens}\) into equal chunks"):
        split(**glue.forward_kwargs(split, odd, t, cond, None))
    return hook.kind, (out - split_out).abs().max().item(), worst


@pytest.mark.slow
@pytest.mark.parametrize("family_name", MODELS)
def test_two_ranks_equal_the_unsplit_model_in_outputs_and_gradients(family_name):
    for kind, out_err, grad_err in run_distributed(_split_equals_unsplit, 2, family_name):
        assert kind == "ulysses"
        assert out_err < 1e-5 and grad_err < 1e-5


def test_a_model_without_a_context_parallel_plan_refuses_sequence_parallelism():
    from opendit.families import get_family
    from opendit.parallel.plan import validate_sp

    spec = get_family("zimage").models["z-image-debug"]
    with pytest.raises(ValueError, match="implements no sequence parallelism; use 1"):
        validate_sp(2, 2, "auto", spec.num_heads, kinds=spec.sp_kinds)
    flux2 = get_family("flux2").models["flux2-klein-debug"]
    assert validate_sp(2, 2, "auto", flux2.num_heads, kinds=flux2.sp_kinds) == "ulysses"
    with pytest.raises(ValueError, match="does not apply to this model"):
        validate_sp(2, 2, "fastseq", flux2.num_heads, kinds=flux2.sp_kinds)
