"""Peak memory of decoding one large sample with and without the VAE's tiling: a 1024² image through FLUX.1's VAE
and a 480x832 clip of 81 frames through Wan2.1's (random weights, built from the published configs: nothing is
downloaded), through opendit's decode / wan_decode (what sample.py --vae_tiling runs).

    python benchmarks/vae_decode_memory.py                        # full size (CPU: minutes a run, see below)
    python benchmarks/vae_decode_memory.py --frames 9 --only wan  # Wan at 480x832 x 9 frames
    python benchmarks/vae_decode_memory.py --small --in_process   # smoke run: narrow VAEs, small sizes (tests)

Each (VAE, mode) runs in a fresh child process, which builds the VAE and the latents, then decodes once: on CUDA
(when present) the peak of torch.cuda.max_memory_allocated() above what was allocated before the decode; on the
CPU the peak resident set above the resident set before the decode (Linux: the peak is reset through
/proc/self/clear_refs first; elsewhere it is the process's lifetime peak). Both count the decoder's activations
and the output, not the weights. Tiles: FLUX 512 px (its config's own 1024 px would leave a 1024² image whole), Wan
256 px (diffusers' default), each overlapping its neighbours by a quarter. Rows are printed as the runs finish.
--in_process runs them all in this process instead (no child's start-up: seconds, but a run's baseline then holds
what the runs before it left in the allocator's pools, so its peak is a lower bound).
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from opendit.encoders.vae import decode  # noqa: E402
from opendit.families.flux.family import FLUX_VAE_SCALE, FLUX_VAE_SHIFT  # noqa: E402
from opendit.encoders.vae_decode import DecodeOptions  # noqa: E402
from opendit.families.wan.vae import wan_decode  # noqa: E402

# black-forest-labs/FLUX.1-dev vae/config.json (diffusers' AutoencoderKL): 16 latent channels, no quant convs
FLUX_VAE = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16, norm_num_groups=32,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                sample_size=1024, scaling_factor=FLUX_VAE_SCALE, shift_factor=FLUX_VAE_SHIFT, use_quant_conv=False,
                use_post_quant_conv=False, mid_block_add_attention=True)
FLUX_SMALL = {**FLUX_VAE, "block_out_channels": (16,) * 4, "layers_per_block": 1, "norm_num_groups": 8}
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers vae/config.json: diffusers' AutoencoderKLWan defaults (base_dim 96, dim_mult
# 1, 2, 4, 4, two residual blocks a level, 8x in space and 4x in time)
WAN_VAE = {}
WAN_SMALL = dict(base_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1)


def resident_kib(key: str = "VmRSS") -> int:
    """This process's resident set (VmRSS) or its peak (VmHWM) in KiB; the lifetime peak where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux; a lifetime peak


def reset_peak() -> None:
    """Start the peak resident set (VmHWM) from the current one (Linux >= 4.0); a no-op elsewhere."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def build(case: str, small: bool, args):
    """(vae, latents, decode function, tile size in pixels) of a case, on the CPU in fp32."""
    from diffusers import AutoencoderKL, AutoencoderKLWan

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if case == "flux":
        vae = AutoencoderKL(**(FLUX_SMALL if small else FLUX_VAE)).eval()
        side = args.size // 8
        z = torch.randn(1, 16, side, side, generator=gen)
        return vae, z, lambda v, x, o: decode(v, x, FLUX_VAE_SCALE, FLUX_VAE_SHIFT, o), args.flux_tile
    vae = AutoencoderKLWan(**(WAN_SMALL if small else WAN_VAE)).eval()
    z = torch.randn(1, 16, 1 + (args.frames - 1) // 4, args.height // 8, args.width // 8, generator=gen)
    return vae, z, wan_decode, args.wan_tile


def child(case: str, tiled: bool, args) -> dict:
    """Decode one sample; its peak memory above the state before the decode."""
    vae, z, run, tile = build(case, args.small, args)
    cuda = torch.cuda.is_available()
    if cuda:
        vae, z = vae.cuda(), z.cuda()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    before_kib = resident_kib()
    reset_peak()
    start = time.perf_counter()
    with torch.no_grad():
        out = run(vae, z, DecodeOptions(tiling=tiled, tile_size=tile))
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak_mib = ((torch.cuda.max_memory_allocated() - before) / 2 ** 20 if cuda
                else (resident_kib("VmHWM") - before_kib) / 1024)
    return {"peak_mib": peak_mib, "out_mib": out.numel() * 4 / 2 ** 20, "seconds": seconds,
            "shape": list(out.shape), "device": "cuda" if cuda else "cpu", "tile": tile if tiled else None}


def spawn(case: str, tiled: bool, argv: list[str]) -> dict:
    """child() in a fresh process (a peak of its own, and no allocator pools left by the runs before)."""
    out = subprocess.run([sys.executable, __file__, *argv, "--child", case, "--tiled" if tiled else "--plain"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the {case} {'tiled' if tiled else 'plain'} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="narrow VAEs, a 128² image and a 128² 5-frame clip")
    parser.add_argument("--only", choices=["flux", "wan"], help="one VAE")
    parser.add_argument("--size", type=int, default=1024, help="FLUX image side in pixels")
    parser.add_argument("--frames", type=int, default=81, help="Wan clip frames (1 + 4k)")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--flux_tile", type=int, default=512)
    parser.add_argument("--wan_tile", type=int, default=256)
    parser.add_argument("--in_process", action="store_true", help="no child processes (peaks: lower bounds)")
    parser.add_argument("--child", choices=["flux", "wan"], help=argparse.SUPPRESS)
    parser.add_argument("--tiled", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.small:
        args.size, args.frames, args.height, args.width, args.flux_tile, args.wan_tile = 128, 5, 128, 128, 64, 64
    if args.child:
        print(json.dumps(child(args.child, args.tiled, args)))
        return []
    names = {"flux": f"FLUX image {args.size}²", "wan": f"Wan video {args.frames} x {args.height}x{args.width}"}
    print(f"{'small (narrow) VAEs' if args.small else 'FLUX.1 and Wan2.1 VAE configs'}, random weights, fp32, "
          f"{'CUDA' if torch.cuda.is_available() else f'CPU ({os.cpu_count()} cores)'}\n")
    print("| sample | decode | peak MiB | output MiB | s |\n|---|---|---:|---:|---:|", flush=True)
    rows = []
    for case in [args.only] if args.only else ["flux", "wan"]:
        for tiled in (False, True):
            row = child(case, tiled, args) if args.in_process else spawn(case, tiled, argv)
            mode = f"tiled ({row['tile']} px tiles)" if tiled else "plain"
            print(f"| {names[case]} | {mode} | {row['peak_mib']:.0f} | {row['out_mib']:.0f} | {row['seconds']:.1f} |",
                  flush=True)
            rows.append({"case": case, "tiled": tiled, **row})
    return rows


if __name__ == "__main__":
    main()
