"""opendit's models against diffusers' on the same weights and inputs: a training step (forward + backward) and a
sampling step with classifier-free guidance (one forward of the conditional and unconditional halves), eager and
compiled, fp32 and bf16 autocast, in one process, the two sides alternating.

    python benchmarks/vs_diffusers.py                                  # every family, step, mode and dtype (CPU)
    python benchmarks/vs_diffusers.py --family flux --mode eager --dtype fp32 --repeats 10
    python benchmarks/vs_diffusers.py --device cuda --size gpu         # larger models (gpu_check.sh)

The peers, each loaded with our weights converted to its layout:
  DiT     diffusers' DiTTransformer2DModel, its timestep frequencies and MLP LayerNorm eps set to DiT's (the two
          places where it computes other math than the DiT release; the cost is the same).
  Latte   diffusers' LatteTransformer3DModel is the text-to-video Latte (PixArt-style blocks with cross-attention),
          another network than the class-conditional Latte release opendit implements; the peer is that Latte
          assembled from diffusers' DiT parts (PatchEmbed, the adaLN-Zero BasicTransformerBlock, the output head),
          alternating spatial and temporal blocks, each sample's condition embedded once as diffusers' Latte does.
  FLUX.1  diffusers' FluxTransformer2DModel.     Wan2.1  diffusers' WanTransformer3DModel.
Both sides run in eval mode (no label dropout: the same function); gradients flow as in training.

Before any timing each row checks that the two sides compute the same thing: the model's output in the training
and in the sampling step equal within float rounding (fp32: relative distance between the two under 1e-4; bf16
autocast: each one's distance from the fp32 output under 5e-2, see check()), else the row is marked FAIL and the
script exits 1. --mode compiled compiles each repeated block of both models (opendit: as train.py --compile does;
diffusers: its compile_repeated_blocks, or each transformer block where the class declares none);
--compile_target model compiles the whole models instead. The first two rounds (compilation) are not timed. Each
later round times both sides once; the ratio is diffusers' time / opendit's (above 1: opendit is faster), min /
median / max over the rounds. Eager training rows also count the activation memory each side
keeps for backward. --lora RANK trains adapters only: opendit's LoRA against PEFT's in the diffusers model
(FLUX.1 and Wan2.1, whose LoRA files opendit writes in the diffusers layout).
"""
import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import fmt, sync  # noqa: E402
from opendit.training.fast_step import compile_model  # noqa: E402

GUIDANCE = 4.0
FP32_TOLERANCE = 1e-4
BF16_TOLERANCE = 5e-2  # see check()
SIZES = {  # per family: width, blocks, and the latent each step sees
    "cpu": dict(dit=(384, 12, 32), latte=(384, 12, (8, 16, 16)), flux=(512, (2, 4), 32), wan=(512, 6, (5, 32, 32))),
    "tiny": dict(dit=(64, 2, 8), latte=(64, 2, (2, 4, 4)), flux=(256, (1, 1), 8), wan=(256, 2, (2, 8, 8))),  # tests
    "gpu": dict(dit=(1152, 28, 32), latte=(1152, 28, (16, 32, 32)), flux=(3072, (2, 4), 64),
                wan=(1536, 8, (21, 30, 52))),
}


@dataclass
class Pair:
    """One family's two models with our weights in both, and how each is called on the shared inputs."""
    name: str
    ours: nn.Module
    theirs: nn.Module
    call_ours: Callable  # (model, inputs) -> output, in the layout both share
    call_theirs: Callable
    inputs: Callable  # (batch, conditional: bool) -> inputs dict; the unconditional ones hold the null condition
    compile_theirs: Callable  # (model, target) -> None
    lora_family: str | None = None  # the opendit family whose LoRA layout maps onto the diffusers model


def randomize(model: nn.Module, seed: int) -> nn.Module:
    """Every parameter random (the zero-initialised adaLN and output layers would make the output zero and any
    comparison pass); frozen tables (position embeddings) kept."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                ones = bool((p == 1).all())  # norm scales stay near 1
                p.copy_(torch.randn(p.shape, generator=g) * 0.02 + ones)
    return model


def compile_blocks(classes: tuple[str, ...]):
    """diffusers' regional compile where the class declares its repeated blocks, else each block of `classes`."""
    def apply(model: nn.Module, target: str):
        if target == "model":
            model.compile()
        elif getattr(model, "_repeated_blocks", None):
            model.compile_repeated_blocks()
        else:
            for module in model.modules():
                if type(module).__name__ in classes:
                    module.compile()
    return apply


# ---------------------------------------------------------------------------------------------------- families
def dit_pair(width: int, depth: int, latent: int) -> Pair:
    from diffusers import DiTTransformer2DModel

    from opendit.families.dit.model import DiT
    from opendit.families.dit.weights import DIT_WEIGHTS

    heads = width // 64
    ours = randomize(DiT(input_size=latent, patch_size=2, in_channels=4, hidden_size=width, depth=depth,
                         num_heads=heads, num_classes=1000, learn_sigma=True), 0)
    theirs = DiTTransformer2DModel(num_attention_heads=heads, attention_head_dim=64, in_channels=4, out_channels=8,
                                   num_layers=depth, sample_size=latent, patch_size=2, num_embeds_ada_norm=1000,
                                   norm_type="ada_norm_zero", norm_eps=1e-6)
    for block in theirs.transformer_blocks:
        block.norm1.emb.time_proj.downscale_freq_shift = 0  # DiT's frequencies i / half
    theirs.load_state_dict(DIT_WEIGHTS.to_diffusers(ours.state_dict()))

    def inputs(b, conditional):
        g = torch.Generator().manual_seed(1)
        return dict(x=torch.randn(b, 4, latent, latent, generator=g), t=torch.randint(0, 1000, (b,), generator=g),
                    y=torch.randint(0, 1000, (b,), generator=g) if conditional else torch.full((b,), 1000))
    return Pair(f"DiT {width} wide, {depth} blocks, {(latent // 2) ** 2} tokens", ours, theirs,
                lambda m, i: m(i["x"], i["t"], i["y"]),
                lambda m, i: m(i["x"], timestep=i["t"], class_labels=i["y"]).sample,
                inputs, compile_blocks(("BasicTransformerBlock",)))


class _OncePerSample(nn.Module):
    """A block's condition embedder given rows repeated `repeats` times per sample: embeds each sample once and
    repeats the result, as diffusers' Latte embeds its condition once for all frames / positions."""

    def __init__(self, emb: nn.Module, repeats: int):
        super().__init__()
        self.emb, self.repeats = emb, repeats

    def forward(self, timestep, class_labels, hidden_dtype=None):
        r = self.repeats
        return self.emb(timestep[::r], class_labels[::r], hidden_dtype=hidden_dtype).repeat_interleave(r, dim=0)


class DiffusersLatte(nn.Module):
    """The class-conditional Latte from diffusers' DiT parts: blocks 2k attend within a frame, 2k+1 across frames."""

    def __init__(self, dit, frames: int, temp_embed: torch.Tensor):
        super().__init__()
        self.dit, self.frames = dit, frames
        self.register_buffer("temp_embed", temp_embed.detach().clone())
        positions = dit.pos_embed.height * dit.pos_embed.width
        for i, block in enumerate(dit.transformer_blocks):
            block.norm1.emb = _OncePerSample(block.norm1.emb, positions if i % 2 else frames)

    def forward(self, x, t, y):
        B, C, T, H, W = x.shape
        dit = self.dit
        tokens = dit.pos_embed(x.transpose(1, 2).flatten(0, 1))  # [B*T, S, D], sin-cos positions added
        S, D = tokens.shape[1:]
        for i, block in enumerate(dit.transformer_blocks):
            if i % 2 == 0:
                tokens = block(tokens, timestep=t.repeat_interleave(T), class_labels=y.repeat_interleave(T))
                continue
            per_pos = tokens.view(B, T, S, D).transpose(1, 2)
            if i == 1:
                per_pos = per_pos + self.temp_embed[:, :T]
            per_pos = block(per_pos.reshape(B * S, T, D), timestep=t.repeat_interleave(S),
                            class_labels=y.repeat_interleave(S))
            tokens = per_pos.view(B, S, T, D).transpose(1, 2).reshape(B * T, S, D)
        emb = dit.transformer_blocks[0].norm1.emb(t.repeat_interleave(T), y.repeat_interleave(T),
                                                  hidden_dtype=tokens.dtype)  # diffusers' DiT head uses block 0's
        shift, scale = dit.proj_out_1(F.silu(emb)).chunk(2, dim=1)
        tokens = dit.proj_out_2(dit.norm_out(tokens) * (1 + scale[:, None]) + shift[:, None])
        p, c, h, w = dit.patch_size, dit.out_channels, H // dit.patch_size, W // dit.patch_size
        out = tokens.reshape(B, T, h, w, p, p, c).permute(0, 6, 1, 2, 4, 3, 5)
        return out.reshape(B, c, T, H, W)


def latte_pair(width: int, depth: int, latent: tuple) -> Pair:
    from diffusers import DiTTransformer2DModel

    from opendit.families.dit.weights import DIT_WEIGHTS
    from opendit.families.video.latte import Latte

    frames, side, _ = latent
    heads = width // 64
    ours = randomize(Latte(input_size=latent, patch_size=2, in_channels=4, hidden_size=width, depth=depth,
                           num_heads=heads, num_classes=101, learn_sigma=True), 0)
    dit = DiTTransformer2DModel(num_attention_heads=heads, attention_head_dim=64, in_channels=4, out_channels=8,
                                num_layers=depth, sample_size=side, patch_size=2, num_embeds_ada_norm=101,
                                norm_type="ada_norm_zero", norm_eps=1e-6)
    for block in dit.transformer_blocks:
        block.norm1.emb.time_proj.downscale_freq_shift = 0
    state = {k: v for k, v in ours.state_dict().items() if k != "temp_embed"}
    dit.load_state_dict(DIT_WEIGHTS.to_diffusers(state))
    theirs = DiffusersLatte(dit, frames, ours.temp_embed)

    def inputs(b, conditional):
        g = torch.Generator().manual_seed(1)
        return dict(x=torch.randn(b, 4, *latent, generator=g), t=torch.randint(0, 1000, (b,), generator=g),
                    y=torch.randint(0, 101, (b,), generator=g) if conditional else torch.full((b,), 101))
    return Pair(f"Latte {width} wide, {depth} blocks, {frames} x {(side // 2) ** 2} tokens", ours, theirs,
                lambda m, i: m(i["x"], i["t"], i["y"]), lambda m, i: m(i["x"], i["t"], i["y"]),
                inputs, compile_blocks(("BasicTransformerBlock",)))


def flux_pair(width: int, depth: tuple, latent: int, txt: int = 128, context: int = 256, pooled: int = 128) -> Pair:
    from opendit.families import get_family
    from opendit.families.flux.model import Flux, image_ids, pack_latents, text_ids
    from opendit.families.flux.weights import FLUX_WEIGHTS

    heads, (double, single) = width // 128, depth
    axes = (16, 56, 56)
    ours = randomize(Flux(in_channels=64, vec_in_dim=pooled, context_in_dim=context, hidden_size=width,
                          num_heads=heads, depth=double, depth_single_blocks=single, axes_dim=axes,
                          guidance_embed=True), 0)
    theirs = get_family("flux1").glue(patch_size=1, in_channels=64, num_layers=double, num_single_layers=single,
                                      attention_head_dim=128, num_attention_heads=heads, joint_attention_dim=context,
                                      pooled_projection_dim=pooled, guidance_embeds=True, axes_dims_rope=axes)
    theirs.load_state_dict(FLUX_WEIGHTS.to_diffusers(ours.state_dict()))

    def inputs(b, conditional):
        g = torch.Generator().manual_seed(1 if conditional else 2)
        x = torch.randn(b, 16, latent, latent, generator=torch.Generator().manual_seed(0))
        return dict(x=pack_latents(x), t=torch.rand(b, generator=g), txt=torch.randn(b, txt, context, generator=g),
                    pooled=torch.randn(b, pooled, generator=g), guidance=torch.full((b,), 3.5))
    img_ids, txt_ids = image_ids(1, latent, latent), text_ids(1, txt)

    def call_ours(m, i):
        ids = [a.to(i["x"].device) for a in (img_ids, txt_ids)]
        return m(i["x"], ids[0], i["txt"], ids[1], i["t"], i["pooled"], i["guidance"])

    def call_theirs(m, i):
        ids = [a[0].to(i["x"].device) for a in (img_ids, txt_ids)]
        return m(hidden_states=i["x"], encoder_hidden_states=i["txt"], pooled_projections=i["pooled"],
                 timestep=i["t"], img_ids=ids[0], txt_ids=ids[1], guidance=i["guidance"]).sample
    return Pair(f"FLUX.1 {width} wide, {double} + {single} blocks, {(latent // 2) ** 2} + {txt} tokens", ours,
                theirs, call_ours, call_theirs, inputs, compile_blocks(()), "flux")


def wan_pair(width: int, depth: int, latent: tuple, txt: int = 64, context: int = 256) -> Pair:
    from opendit.families import get_family
    from opendit.families.wan.model import WanModel
    from opendit.families.wan.weights import WAN_WEIGHTS

    heads = width // 128
    ours = randomize(WanModel(patch_size=(1, 2, 2), text_len=txt, in_dim=16, dim=width, ffn_dim=4 * width,
                              freq_dim=256, text_dim=context, out_dim=16, num_heads=heads, num_layers=depth), 0)
    theirs = get_family("wan21").glue(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=128,
                                      in_channels=16, text_dim=context, freq_dim=256, ffn_dim=4 * width,
                                      num_layers=depth, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                      eps=1e-6)
    theirs.load_state_dict(WAN_WEIGHTS.to_diffusers(ours.state_dict()))

    def inputs(b, conditional):
        g = torch.Generator().manual_seed(1 if conditional else 2)
        x = torch.randn(b, 16, *latent, generator=torch.Generator().manual_seed(0))
        return dict(x=x, t=torch.rand(b, generator=g) * 1000, txt=torch.randn(b, txt, context, generator=g))
    frames, h, w = latent
    return Pair(f"Wan2.1 {width} wide, {depth} blocks, {frames * h * w // 4} + {txt} tokens", ours, theirs,
                lambda m, i: m(i["x"], i["t"], i["txt"]),
                lambda m, i: m(hidden_states=i["x"], timestep=i["t"], encoder_hidden_states=i["txt"]).sample,
                inputs, compile_blocks(()), "wan")


FAMILIES = {"dit": dit_pair, "latte": latte_pair, "flux": flux_pair, "wan": wan_pair}


def add_adapters(pair: Pair, rank: int, folder: Path) -> None:
    """opendit's LoRA on the family's default targets (random B: a zero B would hide a mapping error), saved in
    the diffusers layout and loaded into the diffusers model by its own loader (PEFT layers); only the adapters
    train on both sides. A fused layer of ours (FLUX's qkv) is one adapter with one A; PEFT gets one per diffusers
    Linear (the same A copied, its rows of B): the same function, PEFT's layout."""
    from opendit.families import get_family
    from opendit.lora.formats import save_adapters
    from opendit.lora.layer import add_lora, lora_modules, trained_adapters
    from opendit.lora.run import family_module_map

    family = get_family(pair.lora_family)
    torch.manual_seed(0)
    add_lora(pair.ours, rank, rank, family.lora_targets)
    with torch.no_grad():
        for module in lora_modules(pair.ours).values():
            module.lora_B[0].normal_(0, 0.02)
    path = folder / "lora.safetensors"
    save_adapters(str(path), trained_adapters(pair.ours), "diffusers", family_module_map(family, pair.ours))
    pair.theirs.load_lora_adapter(str(path), prefix="transformer", use_safetensors=True)
    for name, p in pair.theirs.named_parameters():
        p.requires_grad_("lora_" in name)
    pair.name += f", LoRA rank {rank}"


def saved_for_backward(model: nn.Module, step) -> int:
    """Bytes of the tensors autograd keeps for backward during step() (activations; parameters not counted, each
    storage once): the activation memory of a training step, on any device."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def op_seconds(step) -> dict:
    """Self time of step()'s operators by kind (torch.profiler): {"matmul": s, "attention": s, "rest": s}. The
    matmuls and attention are the same kernels on both sides; the rest (elementwise, norms, copies) is where an
    implementation can gain."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        step()
    found = dict(matmul=0.0, attention=0.0, rest=0.0)
    for e in prof.key_averages():
        name = e.key.lower()
        kind = "attention" if "scaled_dot_product" in name or "flash" in name else \
            "matmul" if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm") or "gemm" in name \
            or "convolution" in name else "rest"
        found[kind] += e.self_device_time_total if activities[-1] != ProfilerActivity.CPU else e.self_cpu_time_total
    return {k: v / 1e6 for k, v in found.items()}


# ---------------------------------------------------------------------------------------------------- steps
def _to(inputs: dict, device) -> dict:
    return {k: v.to(device) for k, v in inputs.items()}


def train_step(call, model, inputs, target):
    """Forward, the MSE loss against a fixed target, backward -> (the model's output, the loss). The output is
    compared: a scalar loss can land near the fp32 one by chance under bf16 (see check())."""
    model.zero_grad(set_to_none=True)
    out = call(model, inputs).float()
    loss = F.mse_loss(out, target)
    loss.backward()
    return out.detach(), loss.detach()


@torch.no_grad()
def sample_step(call, model, inputs, _target):
    """The conditional and unconditional halves in one forward, combined by the guidance scale -> (the model's
    output, the guided one). The first is compared: guidance amplifies rounding differences by its scale."""
    out = call(model, inputs).float()
    cond, uncond = out.chunk(2)
    return out, uncond + GUIDANCE * (cond - uncond)


def run_row(pair: Pair, step: str, dtype: str, batch: int, repeats: int, device, eager: bool,
            profile: bool = False) -> dict:
    """-> dict: the two sides' results (the model's output of the first round), each round's seconds of both,
    (eager training steps) the bytes each saves for backward and (profile) each one's op_seconds."""
    cond = pair.inputs(batch, True)
    inputs = cond if step == "train" else {k: torch.cat([v, u]) for (k, v), u in
                                           zip(cond.items(), pair.inputs(batch, False).values())}
    inputs = _to(inputs, device)
    with torch.no_grad():
        shape = pair.call_ours(pair.ours, inputs).shape
    target = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(device)
    fn = train_step if step == "train" else sample_step
    sides = [(pair.call_ours, pair.ours), (pair.call_theirs, pair.theirs)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")
    seconds, results = ([], []), [None, None]
    for round_ in range(repeats + 2):
        for i in (0, 1) if round_ % 2 else (1, 0):  # who goes first alternates: no side always runs on a warm cache
            call, model = sides[i]
            sync(device)
            start = time.perf_counter()
            with autocast:
                results[i] = fn(call, model, inputs, target)
            sync(device)
            if round_ >= 2:
                seconds[i].append(time.perf_counter() - start)
        if round_ == 0:
            first = [r[0].cpu() for r in results]
    saved, ops = [None, None], [None, None]
    for i, (call, model) in enumerate(sides):
        if step == "train" and eager:
            with autocast:
                saved[i] = saved_for_backward(model, lambda: fn(call, model, inputs, target))
    for _ in range(3 if profile else 0):  # alternating, as the timed rounds
        for i, (call, model) in enumerate(sides):
            with autocast:
                found = op_seconds(lambda: fn(call, model, inputs, target))
            ops[i] = {k: v / 3 + (ops[i] or {}).get(k, 0.0) for k, v in found.items()}
    return dict(results=first, ours=seconds[0], theirs=seconds[1], saved=saved, ops=ops)


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def check(results: list, dtype: str, fp32_result: torch.Tensor | None) -> tuple[list[float], float]:
    """-> (the relative distances checked, their tolerance). fp32: the two sides' distance, under 1e-4: the same
    function. bf16: each side's distance from the fp32 result of the same row, under BF16_TOLERANCE: bf16 keeps 8
    significant bits, and through these block stacks its rounding moves an output by 0.3-4% (the two sides keep
    different ops in fp32, so the one is often several times closer than the other); a NaN, an overflow or a
    bf16-only fault lands at O(1). Without an fp32 result (--dtype bf16 alone) the two sides' distance."""
    if dtype == "fp32":
        return [distance(*results)], FP32_TOLERANCE
    if fp32_result is None:
        return [distance(*results)], BF16_TOLERANCE
    return [distance(r, fp32_result) for r in results], BF16_TOLERANCE


def spread(values, spec=".3f") -> str:
    return " / ".join(format(v, spec) for v in (min(values), statistics.median(values), max(values)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", nargs="+", choices=tuple(FAMILIES), default=list(FAMILIES))
    p.add_argument("--step", nargs="+", choices=("train", "sample"), default=["train", "sample"])
    p.add_argument("--mode", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"])
    p.add_argument("--dtype", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    p.add_argument("--compile_target", choices=("blocks", "model"), default="blocks")
    p.add_argument("--size", choices=tuple(SIZES), default="cpu")
    p.add_argument("--batch", type=int, default=2, help="samples per training step (a sampling step runs twice as "
                                                        "many: the conditional and unconditional halves)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true",
                   help="after each row, each side's seconds in matmuls, attention and the rest (torch.profiler)")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="train LoRA adapters of this rank (FLUX.1 and Wan2.1: opendit's against PEFT's in diffusers)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    print(f"torch {torch.__version__}, {device.type}, {torch.get_num_threads()} threads; ratio = diffusers / opendit "
          f"(above 1: opendit faster); compile target {a.compile_target}")
    print("| model | step | mode | dtype | distance <= tolerance | opendit s (min/med/max) | diffusers s "
          "| ratio (min/med/max) | saved for backward MB (opendit / diffusers) |")
    print("|---|---|---|---|---|---|---|---|---|")
    families = [f for f in a.family if not a.lora or FAMILIES[f] in (flux_pair, wan_pair)]
    steps = ["train"] if a.lora else a.step
    failed, profiles, fp32_results = False, [], {}
    for mode in a.mode:  # every eager row first: a run cut short by a time limit keeps them
        for family in families:
            pair = FAMILIES[family](*SIZES[a.size][family])  # compiled modes get fresh, uncompiled models
            if a.lora:
                with tempfile.TemporaryDirectory() as folder:
                    add_adapters(pair, a.lora, Path(folder))
            for model in (pair.ours, pair.theirs):
                model.to(device).eval()
            if mode == "compiled":
                compile_model(pair.ours, a.compile_target)
                pair.compile_theirs(pair.theirs, a.compile_target)
            for step in steps:
                for dtype in a.dtype:
                    row = run_row(pair, step, dtype, a.batch, a.repeats, device, mode == "eager", a.profile)
                    if dtype == "fp32":
                        fp32_results.setdefault((family, step), row["results"][0])
                    gaps, tolerance = check(row["results"], dtype, fp32_results.get((family, step)))
                    ok = all(g <= tolerance for g in gaps)  # a NaN compares False
                    failed |= not ok
                    ratios = [t / o for o, t in zip(row["ours"], row["theirs"])]
                    verdict = f"{' / '.join(f'{g:.1e}' for g in gaps)} {'<=' if ok else 'FAIL'} {tolerance:.0e}"
                    print(f"| {pair.name} | {step} | {mode} | {dtype} | {verdict} | "
                          f"{spread(row['ours'])} | {spread(row['theirs'])} | {spread(ratios, '.2f')} | "
                          f"{' / '.join(fmt(b and b / 2 ** 20, '.0f') for b in row['saved'])} |", flush=True)
                    if a.profile:
                        profiles.append((pair.name, step, mode, dtype, *row["ops"],
                                         statistics.median(row["theirs"]) / statistics.median(row["ours"])))
            del pair
    if profiles:
        print("\nProfile, seconds per step (opendit / diffusers): matmuls and attention run the same kernels on both "
              "sides; the rest is where an implementation differs. bound = the ratio if opendit's rest took no time.")
        print("| model | step | mode | dtype | matmul | attention | rest | matmul + attention share | bound |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, step, mode, dtype, ours, theirs, ratio in profiles:
            cells = " | ".join(f"{ours[k]:.3f} / {theirs[k]:.3f}" for k in ("matmul", "attention", "rest"))
            share = [(d["matmul"] + d["attention"]) / sum(d.values()) for d in (ours, theirs)]
            print(f"| {name} | {step} | {mode} | {dtype} | {cells} | {share[0]:.0%} / {share[1]:.0%} | "
                  f"{ratio / share[0]:.2f} |")
    if failed:
        print("FAIL: a row's two sides computed different results (an output's distance above its tolerance)")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
