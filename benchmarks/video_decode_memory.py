"""Host memory while decoding the same small MP4 over and over through VideoCSVDataset (CPU).

    python benchmarks/video_decode_memory.py                     # 1,000 decodes, RSS every 100
    python benchmarks/video_decode_memory.py --decodes 20 --every 10   # smoke run (the tests run it)

A data loader decodes millions of clips; a PyAV container or frame that is not freed grows host memory by
its buffers on every clip until the job is killed. This writes one MP4 (--frames frames of --width x
--height moving colour bars) with opendit's write_mp4, lists it in a CSV, and reads item 0 --decodes times
with set_epoch(i) before read i, so each read draws a new start and decodes and crops a fresh clip of
--num_frames frames every --frame_interval. It prints the resident set size (psutil, else VmRSS from
/proc/self/status) after 0, every, 2 x every, ... decodes, and the least-squares slope over the
checkpoints after the first (the first reads warm up FFmpeg's and the allocator's pools), next to what
leaking one decoded clip per read would add. Flat = a slope within the allocator's noise (measured on 2 CPU
cores: +3 KiB per 100 decodes over 3,000 decodes), thousands of times below a leak of one clip per read.
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from opendit.data.video_csv import VideoCSVDataset  # noqa: E402
from opendit.data.video_io import default_mp4_codec, write_mp4  # noqa: E402


def rss_kib() -> int:
    """Resident set size of this process in KiB."""
    try:
        import psutil
    except ImportError:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])  # "VmRSS:   123456 kB"
        raise RuntimeError("no psutil and no VmRSS in /proc/self/status: cannot read this process's memory") from None
    return psutil.Process().memory_info().rss // 1024


def bars_video(frames: int, height: int, width: int) -> np.ndarray:
    """uint8 [frames, H, W, 3]: vertical colour bars scrolling 2 px per frame (real motion for the codec)."""
    x = (np.arange(width)[None, :] + 2 * np.arange(frames)[:, None]) % width  # [T, W]
    hue = x * 6 // width  # 6 bars
    palette = np.array([[255, 0, 0], [255, 255, 0], [0, 255, 0], [0, 255, 255], [0, 0, 255], [255, 0, 255]],
                       np.uint8)
    return np.broadcast_to(palette[hue][:, None], (frames, height, width, 3)).copy()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decodes", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100, help="print RSS after every this many decodes")
    parser.add_argument("--frames", type=int, default=48, help="frames in the test video")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--height", type=int, default=96)
    parser.add_argument("--num_frames", type=int, default=16)
    parser.add_argument("--frame_interval", type=int, default=2)
    parser.add_argument("--image_size", type=int, default=64)
    args = parser.parse_args(argv)
    if args.decodes < 1 or args.every < 1:
        parser.error("--decodes and --every must be >= 1")

    with tempfile.TemporaryDirectory() as folder:
        write_mp4(os.path.join(folder, "bars.mp4"), bars_video(args.frames, args.height, args.width))
        csv_path = os.path.join(folder, "videos.csv")
        with open(csv_path, "w") as f:
            f.write("path,caption\nbars.mp4,colour bars\n")
        dataset = VideoCSVDataset(csv_path, args.image_size, num_frames=args.num_frames,
                                  frame_interval=args.frame_interval)
        rss = [(0, rss_kib())]
        start = time.perf_counter()
        for i in range(1, args.decodes + 1):
            dataset.set_epoch(i)
            dataset[0]
            if i % args.every == 0:
                rss.append((i, rss_kib()))
        seconds = time.perf_counter() - start
        if dataset.num_skipped:
            raise RuntimeError("the benchmark's own video failed to decode; see the warning above")

    # slope by least squares over the checkpoints after the first (warm-up excluded), KiB per 100 decodes
    steady = rss[1:]
    slope = (float(np.polyfit([n for n, _ in steady], [k for _, k in steady], 1)[0]) * 100
             if len(steady) >= 2 else float("nan"))
    ms_per_clip = seconds / args.decodes * 1e3
    print(f"{args.decodes} decodes of a {args.frames}-frame {args.width}x{args.height} MP4 "
          f"({default_mp4_codec()}): {args.num_frames} frames every {args.frame_interval}, center-cropped to "
          f"{args.image_size} px; {ms_per_clip:.2f} ms per clip\n")
    print("| decodes | RSS MiB | change KiB |\n|---:|---:|---:|")
    for n, kib in rss:
        print(f"| {n} | {kib / 1024:.1f} | {kib - rss[0][1]:+d} |")
    clip_kib = args.num_frames * args.height * args.width * 3 / 1024  # the uint8 frames one read decodes
    print(f"\nslope after the first {args.every} decodes: {slope:+.1f} KiB per 100 decodes (leaking one "
          f"decoded clip per read would add {clip_kib * 100:.0f})")
    return {"rss": rss, "slope_kib_per_100": slope, "ms_per_clip": ms_per_clip}


if __name__ == "__main__":
    main()
