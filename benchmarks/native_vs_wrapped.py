"""FLUX.1 and Wan2.1 natively (opendit's own layers: opendit.families.flux, opendit.families.wan) against the same
models through diffusers' own FluxTransformer2DModel / WanTransformer3DModel (the diffusers kind,
opendit.families.wrapped.flux1 / wan21): the same weights (FLUX_WEIGHTS / WAN_WEIGHTS convert them), the same
latents, prompt embeddings, times and noise, each through its family's objective, in one process, alternating.
The losses are compared first (equal within float rounding, else it exits 1); then the forward + backward time of
each (min / median / max over --repeats) and the ratio native / wrapped (below 1: the native path is faster).

    python benchmarks/native_vs_wrapped.py                       # a FLUX-shaped model 512 wide, 64 px latents, CPU
    python benchmarks/native_vs_wrapped.py --family wan          # a Wan-shaped one 512 wide, 5 x 32 x 32 latents
    python benchmarks/native_vs_wrapped.py --width 3072 --depth 19 --single 38 --latent 128 --txt 512   # flux-dev
"""
import argparse
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opendit.families import get_family  # noqa: E402
from opendit.families.flux.family import FlowObjective  # noqa: E402
from opendit.families.flux.model import Flux  # noqa: E402
from opendit.families.flux.weights import FLUX_WEIGHTS  # noqa: E402
from opendit.families.wan.model import WanModel  # noqa: E402
from opendit.families.wan.objective import WanFlowObjective  # noqa: E402
from opendit.families.wan.weights import WAN_WEIGHTS  # noqa: E402
from opendit.families.wrapped.flux1 import patchify  # noqa: E402
from opendit.families.wrapped.kind import WrappedEncoders, WrappedObjective  # noqa: E402

HEAD_DIM, CONTEXT, POOLED = 64, 256, 128  # head width; T5 and CLIP widths of the synthetic prompts


def _timed(step) -> tuple[float, float]:
    start = time.perf_counter()
    loss = step()
    return time.perf_counter() - start, loss


def compare(a) -> dict:
    """{native_s, wrapped_s: median seconds per forward + backward; *_all: every repeat; loss_native, loss_wrapped}."""
    return _timed_pair(*(_wan if getattr(a, "family", "flux") == "wan" else _flux)(a), a.repeats)


def _flux(a):
    """FLUX.1: (objectives, inputs) of the native and the wrapped side."""
    heads = max(1, a.width // HEAD_DIM)
    axes = (HEAD_DIM // 8, HEAD_DIM * 7 // 16, HEAD_DIM * 7 // 16)
    torch.manual_seed(0)
    native = Flux(in_channels=64, vec_in_dim=POOLED, context_in_dim=CONTEXT, hidden_size=heads * HEAD_DIM,
                  num_heads=heads, depth=a.depth, depth_single_blocks=a.single, axes_dim=axes, guidance_embed=True)
    glue = get_family("flux1").glue
    wrapped = glue(patch_size=1, in_channels=64, num_layers=a.depth, num_single_layers=a.single,
                   attention_head_dim=HEAD_DIM, num_attention_heads=heads, joint_attention_dim=CONTEXT,
                   pooled_projection_dim=POOLED, guidance_embeds=True, axes_dims_rope=axes)
    wrapped.load_state_dict(FLUX_WEIGHTS.to_diffusers(native.state_dict()))
    cfg = types.SimpleNamespace(guidance=1.0, timestep_sampling="uniform", model="flux1-dev-diffusers")
    objectives = (FlowObjective(None, cfg, guidance_embed=True, vae_shift=0.0),
                  WrappedObjective(WrappedEncoders(vae=None, text=None, glue=glue), cfg))
    x, noise = torch.randn(2, a.batch, 16, a.latent, a.latent).unbind(0)
    txt, vec, t = torch.randn(a.batch, a.txt, CONTEXT), torch.randn(a.batch, POOLED), torch.rand(a.batch)
    inputs = ((native, x, {"txt": txt, "y": vec}, noise, t),
              (wrapped, patchify(x), {"embeds": txt, "pooled": vec}, patchify(noise), t))
    return objectives, inputs


def _wan(a):
    """Wan2.1 (text-to-video): (objectives, inputs) of the native and the wrapped side; --latent is the latent side,
    5 latent frames, 2x2 patches."""
    heads = max(1, a.width // HEAD_DIM)
    torch.manual_seed(0)
    dim, layers = heads * HEAD_DIM, a.depth + a.single
    native = WanModel(patch_size=(1, 2, 2), text_len=a.txt, in_dim=16, dim=dim, ffn_dim=4 * dim, freq_dim=256,
                      text_dim=CONTEXT, out_dim=16, num_heads=heads, num_layers=layers)
    glue = get_family("wan21").glue
    wrapped = glue(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=HEAD_DIM, in_channels=16,
                   text_dim=CONTEXT, freq_dim=256, ffn_dim=4 * dim, num_layers=layers,
                   cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
    wrapped.load_state_dict(WAN_WEIGHTS.to_diffusers(native.state_dict()))
    cfg = types.SimpleNamespace(timestep_sampling="uniform", model="wan2.1-t2v-1.3b-diffusers")
    objectives = (WanFlowObjective(None, shift=1.0, timestep_sampling="uniform", dropout=0.0),
                  WrappedObjective(WrappedEncoders(vae=None, text=None, glue=glue), cfg))
    x, noise = torch.randn(2, a.batch, 16, 5, a.latent, a.latent).unbind(0)
    txt, t = torch.randn(a.batch, a.txt, CONTEXT), torch.rand(a.batch)
    return objectives, ((native, x, {"context": txt}, noise, t), (wrapped, x, {"embeds": txt}, noise, t))


def _timed_pair(objectives, inputs, repeats: int) -> dict:
    def step(i):
        model, xi, cond, ni, t = inputs[i]
        model.zero_grad(set_to_none=True)
        loss = objectives[i].losses(model, xi, cond, t_frac=t, noise=ni)[0].mean()
        loss.backward()
        return loss.item()
    times, losses = ([], []), [None, None]
    for _ in range(repeats + 1):  # the first round warms up
        for i in (0, 1):
            seconds, losses[i] = _timed(lambda: step(i))
            times[i].append(seconds)
    native_s, wrapped_s = (statistics.median(ts[1:]) for ts in times)
    return dict(native_s=native_s, wrapped_s=wrapped_s, native_all=times[0][1:], wrapped_all=times[1][1:],
                loss_native=losses[0], loss_wrapped=losses[1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=("flux", "wan"), default="flux")
    p.add_argument("--width", type=int, default=512, help="hidden size (heads of 64)")
    p.add_argument("--depth", type=int, default=2, help="double-stream blocks (Wan: blocks, with --single)")
    p.add_argument("--single", type=int, default=4, help="single-stream blocks")
    p.add_argument("--latent", type=int, default=64, help="latent side (16 channels; 2x2 tokens: (latent/2)^2)")
    p.add_argument("--txt", type=int, default=128, help="text tokens")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    found = compare(a)
    if abs(found["loss_native"] - found["loss_wrapped"]) > 1e-5 * abs(found["loss_native"]):
        print(f"FAIL: losses differ: native {found['loss_native']:.7f}, wrapped {found['loss_wrapped']:.7f}")
        sys.exit(1)

    def spread(ts):
        return f"{min(ts):.3f} / {statistics.median(ts):.3f} / {max(ts):.3f}"
    shape = f"{a.depth} + {a.single} blocks, {(a.latent // 2) ** 2}" if a.family == "flux" else \
        f"{a.depth + a.single} blocks, {5 * (a.latent // 2) ** 2}"
    print(f"| {'FLUX.1' if a.family == 'flux' else 'Wan2.1'} {a.width} wide, {shape} + {a.txt} tokens, "
          f"batch {a.batch} | loss {found['loss_native']:.6f} = {found['loss_wrapped']:.6f} | "
          f"{spread(found['native_all'])} | {spread(found['wrapped_all'])} | "
          f"{found['native_s'] / found['wrapped_s']:.2f} |")


if __name__ == "__main__":
    main()
