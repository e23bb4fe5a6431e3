"""Sequence parallelism of diffusers transformers (opendit.families.wrapped.context_parallel): at 2 ranks under gloo
the output and every parameter's gradient equal the unsplit model's for every family of the kind with a parallel plan
(Qwen-Image with a padded text mask, Wan2.1's clips; through opendit's plans for classes without one:
HunyuanVideo-1.5's clips, and Z-Image at 3 ranks, whose joint sequence gets padded), a token count that does not
split evenly is an error naming it, and a model without a parallel plan refuses --sequence_parallel_size. Training
and sampling at 2 ranks: the families' tests."""
import pytest
import torch
import torch.distributed as dist

from opendit.families import get_family
from tests.distributed import run_distributed

from tests.families.test_conformance import DEBUG

# every family of the kind with a parallel plan (Z-Image: at 3 ranks below), by its debug model
MODELS = {f: m for f, m in DEBUG.items() if f != "zimage" and get_family(f).glue.parallel_plan is not None}
# inputs at 2 ranks: an even and an odd token count (images: 2x2-packed latents; Wan-debug: 4x4-patched clips)
# HunyuanVideo-1.5 (patch 1): its joint text sequence (729 + 256 + 16 tokens) is odd, so its Qwen tokens get padded;
# LTX-2 (patch 1): its video tokens, with its audio stream (one token) whole on each rank
GRIDS = {"wan21": ((2, 8, 12), (3, 4, 20), "15 tokens"), "hunyuanvideo15": ((2, 4, 6), (3, 3, 5), "45 tokens"),
         "ltx2": ((2, 4, 6), (3, 3, 5), "45 tokens")}
IMAGE_GRIDS = ((4, 6), (3, 5), "15 tokens")


def _split_equals_unsplit(rank, world_size, family_name, spec=None, grid=None):
    from opendit.families import get_family
    from opendit.parallel import enable_sequence_parallel

    family = get_family(family_name)
    glue, spec = family.glue, spec or family.models[MODELS[family_name]]
    torch.manual_seed(0)
    plain, split = spec.build(), spec.build()
    split.load_state_dict(plain.state_dict())
    hook = enable_sequence_parallel(split, dist.new_group(list(range(world_size))), "auto")
    even, odd_grid, odd_tokens = GRIDS.get(family_name, IMAGE_GRIDS)
    x, t = torch.randn(2, spec.arch["in_channels"], *(grid or even)), torch.rand(2)
    cond = glue.random_conditions(spec, 2, "cpu")
    if "mask" in cond:
        cond["mask"][1, cond["mask"].shape[1] // 2:] = False  # one padded caption

    def step(model):
        v = glue.from_output(model(**glue.forward_kwargs(model, x, t, cond, None))[0], x.shape)
        (v - x).square().mean().backward()
        return v.detach()
    out, split_out = step(plain), step(split)
    worst = 0.0
    # each gradient relative to its own largest entry; one that is zero but for rounding (an attention key bias:
    # softmax does not see it; HunyuanVideo-1.5's token refiner has one, 1e-14) relative to the model's largest
    floor = 1e-6 * max(p.grad.abs().max() for p in plain.parameters() if p.grad is not None)
    for (name, p), q in zip(plain.named_parameters(), split.parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        grad = q.grad.clone()
        dist.all_reduce(grad)  # every plugin averages over the group
        worst = max(worst, ((grad / world_size - p.grad).abs().max() / p.grad.abs().max().clamp_min(floor)).item())
    if grid is None:
        odd = torch.randn(2, spec.arch["in_channels"], *odd_grid)
        with pytest.raises(ValueError, match=rf"splits hidden_states \({odd_tokens}\) into equal chunks"):
            split(**glue.forward_kwargs(split, odd, t, cond, None))
    return hook.kind, (out - split_out).abs().max().item(), worst


def _each_family(rank, world_size, names):
    """_split_equals_unsplit for each family in turn -> {name: its result, or the traceback it failed with}."""
    import traceback
    found = {}
    for name in names:
        try:
            found[name] = _split_equals_unsplit(rank, world_size, name)
        except BaseException:  # pytest.raises' Failed too; the ranks fail alike (before or after the collectives)
            found[name] = traceback.format_exc()
    return found


@pytest.fixture(scope="module")
def two_rank_results():
    """Every MODELS family's check at 2 ranks, all in one spawn (the start-up and imports paid once)."""
    return run_distributed(_each_family, 2, list(MODELS))


@pytest.mark.slow
@pytest.mark.parametrize("family_name", MODELS)
def test_two_ranks_equal_the_unsplit_model_in_outputs_and_gradients(two_rank_results, family_name):
    results = [by_family[family_name] for by_family in two_rank_results]
    assert not any(isinstance(r, str) for r in results), next(r for r in results if isinstance(r, str))
    for kind, out_err, grad_err in results:
        assert kind == "ulysses"
        assert out_err < 1e-5 and grad_err < 1e-5


@pytest.mark.slow
def test_z_image_at_three_ranks_pads_its_joint_sequence_and_equals_the_unsplit_model():
    """Z-Image pads image and caption tokens to multiples of 32 itself, so 3 ranks need opendit's masked padding: 64
    image tokens (a 16x16 latent, 2x2 patches) and 40 / 20 caption tokens make joint sequences of 128 and 96 tokens
    (a batch mask), 128 padded to 129. Three heads of 16 channels, so that 3 ranks hold whole heads."""
    import dataclasses

    from opendit.families import get_family

    spec = get_family("zimage").models["z-image-debug"]
    arch = {**spec.arch, "dim": 48, "n_heads": 3, "n_kv_heads": 3, "axes_lens": (128, 32, 32)}
    spec = dataclasses.replace(spec, arch=arch, constants={**spec.constants, "max_sequence_length": 40})
    for kind, out_err, grad_err in run_distributed(_split_equals_unsplit, 3, "zimage", spec, (16, 16)):
        assert kind == "ulysses"
        assert out_err < 1e-5 and grad_err < 1e-5


def test_a_model_without_a_parallel_plan_refuses_sequence_parallelism():
    from opendit.families import get_family
    from opendit.parallel.plan import validate_sp

    with pytest.raises(ValueError, match="implements no sequence parallelism; use 1"):
        validate_sp(2, 2, "auto", 4, kinds=())
    spec = get_family("zimage").models["z-image-debug"]
    assert validate_sp(2, 2, "auto", spec.num_heads, kinds=spec.sp_kinds) == "ulysses"
    flux2 = get_family("flux2").models["flux2-klein-debug"]
    assert validate_sp(2, 2, "auto", flux2.num_heads, kinds=flux2.sp_kinds) == "ulysses"
    with pytest.raises(ValueError, match="does not apply to this model"):
        validate_sp(2, 2, "fastseq", flux2.num_heads, kinds=flux2.sp_kinds)
