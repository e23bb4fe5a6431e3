"""Fused Triton kernels vs their PyTorch reference vs torch.compile(reference), on one GPU.

    python benchmarks/kernel_speed.py                 # DiT-XL/2 sizes: x [256, 256, 1152] bf16
    python benchmarks/kernel_speed.py --only rope rms --no-compile

For each kernel and mode (fwd, fwd+bwd) it prints the median time (triton.testing.do_bench),
the bandwidth computed from the minimal bytes the op must move (each activation read or written
once), that bandwidth as a share of a device-to-device copy measured in the same run, and the
relative error ||out - exact|| / ||exact|| against the reference run in fp32 on the same inputs
(for fwd+bwd: the error of x's grad). Exits with a message on a machine without CUDA.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from opendit import kernels  # noqa: E402
from opendit.kernels import reference  # noqa: E402


def make_cases(B, N, C, heads, seq, head_dim, dtype, device="cuda"):
    """name -> (inputs factory, public fn, reference fn, minimal bytes fwd, minimal bytes fwd+bwd).

    Bytes count activation traffic only ([B, C] / [C] vectors are < 0.5% of it): e.g. the fused
    LayerNorm-modulate reads x and writes y forward, and reads x, dy and writes dx backward.
    """
    el = torch.tensor([], dtype=dtype).element_size()
    act = B * N * C * el
    qk = B * heads * seq * head_dim * el

    def dev(*shape, grad=True, dt=dtype):
        return torch.randn(*shape, device=device, dtype=dt).requires_grad_(grad)

    def rope_inputs():
        ang = torch.rand(seq, head_dim // 2, device=device) * 6.28
        return [dev(B, heads, seq, head_dim), ang.cos(), ang.sin()]

    return {
        "layernorm_modulate": (lambda: [dev(B, N, C), dev(B, C), dev(B, C)],
                               kernels.layernorm_modulate, reference.layernorm_modulate, 2 * act, 5 * act),
        "gated_residual": (lambda: [dev(B, N, C), dev(B, C), dev(B, N, C)],
                           kernels.gated_residual, reference.gated_residual, 3 * act, 6 * act),
        "layer_norm": (lambda: [dev(B, N, C), dev(C), dev(C)],
                       kernels.layer_norm, reference.layer_norm, 2 * act, 5 * act),
        "rms_norm": (lambda: [dev(B, heads, seq, head_dim), dev(head_dim)],
                     kernels.rms_norm, reference.rms_norm, 2 * qk, 5 * qk),
        "rope": (rope_inputs, kernels.apply_rope, reference.apply_rope, 2 * qk, 4 * qk),
    }


def rel_err(out, exact):
    return ((out.float() - exact).norm() / exact.norm().clamp_min(1e-30)).item()


def bench_case(name, case, impls, do_bench):
    """Rows (name, mode, impl, ms, bytes, rel_err) for one kernel."""
    make, _, ref, bytes_fwd, bytes_all = case
    inputs = make()
    leaves = [t for t in inputs if t.requires_grad]
    exact_in = [t.detach().float().requires_grad_(t.requires_grad) for t in inputs]
    exact = ref(*exact_in)
    dout = torch.randn_like(exact)
    exact_dx = torch.autograd.grad(exact, exact_in[0], dout)[0]
    dout = dout.to(inputs[0].dtype)
    rows = []
    for impl, fn in impls.items():
        out = fn(*inputs)
        err_fwd = rel_err(out, exact)
        err_bwd = rel_err(torch.autograd.grad(out, inputs[0], dout)[0], exact_dx)
        ms_fwd = do_bench(lambda: fn(*inputs), return_mode="median")
        ms_all = do_bench(lambda: torch.autograd.grad(fn(*inputs), leaves, dout), return_mode="median")
        rows.append((name, "fwd", impl, ms_fwd, bytes_fwd, err_fwd))
        rows.append((name, "fwd+bwd", impl, ms_all, bytes_all, err_bwd))
    return rows


def impls_for(case, compile_ref):
    _, public, ref, _, _ = case
    impls = {"triton": lambda *a: public(*a, use_kernel=True), "torch": ref}
    if compile_ref:
        impls["torch.compile"] = torch.compile(ref, dynamic=False)
    return impls


def copy_bandwidth(nbytes, do_bench):
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / ms / 1e6  # read + write, GB/s


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1152)
    p.add_argument("--heads", type=int, default=24, help="q/k norm and RoPE: [B_rope, heads, seq, head_dim]")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rope-batch", type=int, default=8)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--only", nargs="*", help="substrings of kernel names to run")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile(reference)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernel_speed.py needs a CUDA GPU; none found, nothing measured.")
        return 0
    import triton.testing
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | {kernels.kernel_status(True, 'cuda')}")
    cases = make_cases(args.batch, args.tokens, args.hidden, args.heads, args.seq, args.head_dim, dtype)
    rope_cases = make_cases(args.rope_batch, args.tokens, args.hidden, args.heads, args.seq, args.head_dim, dtype)
    cases["rms_norm"], cases["rope"] = rope_cases["rms_norm"], rope_cases["rope"]
    copy_gbs = copy_bandwidth(cases["layernorm_modulate"][3] // 2, triton.testing.do_bench)
    print(f"# x [{args.batch}, {args.tokens}, {args.hidden}], q/k [{args.rope_batch}, {args.heads}, "
          f"{args.seq}, {args.head_dim}], {args.dtype}; device copy: {copy_gbs:.0f} GB/s\n")
    print("| kernel | mode | impl | median ms | GB/s | % of copy | rel err vs fp32 |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name, case in cases.items():
        if args.only and not any(s in name for s in args.only):
            continue
        for n, mode, impl, ms, nbytes, err in bench_case(name, case, impls_for(case, not args.no_compile),
                                                        triton.testing.do_bench):
            gbs = nbytes / ms / 1e6
            print(f"| {n} | {mode} | {impl} | {ms:.3f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | {err:.2e} |",
                  flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
