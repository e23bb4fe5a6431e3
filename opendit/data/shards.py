"""Write the built-in demo data as sharded streams, laid out as img2dataset lays out web data.

    python -m opendit.data.shards --out data/digit_shards                      # captioned digits, tar + Parquet
    python -m opendit.data.shards --out data/clip_shards --data moving_digits  # moving digits as mp4 members
    python -m opendit.data.shards --out data/digit_shards --formats hf --split train
    python -m opendit.data.shards --list '/data/cc12m/{00000..02175}.tar' --out /data/cc12m/dataset.json

--list counts the samples of existing tar shards (local paths or URLs) and writes their wids shard list, which a
run given as --data_path reads instead of indexing every shard at start.

WebDataset tars (written by webdataset's TarWriter): `{key}.png` (or `.mp4`), `{key}.txt` (the caption),
`{key}.cls` (the digit), `{key}.json` ({"key", "caption", "label", "width", "height"}), in `tar/{00000..}.tar`,
with `tar/dataset.json`, a wids shard list that spares a reader counting the samples. Parquet (pyarrow):
`parquet/{00000..}.parquet` with the columns key, image ({"bytes", "path"}: Hugging Face's Image layout), caption,
label, width, height. hf: a `datasets` table written by save_to_disk in `hf/`. Then train with e.g.
`--dataset webdataset --data_path data/digit_shards/tar/{00000..00003}.tar`.
"""
import argparse
import io
import json
import os
import tempfile

import numpy as np
from PIL import Image

FORMATS = ("webdataset", "parquet", "hf")
FOLDERS = {"webdataset": "tar", "parquet": "parquet", "hf": "hf"}


def _png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def _mp4(frames: np.ndarray) -> bytes:
    from opendit.data.video_io import write_mp4

    with tempfile.TemporaryDirectory() as tmp:
        path = write_mp4(os.path.join(tmp, "clip.mp4"), frames)
        with open(path, "rb") as f:
            return f.read()


def demo_records(data: str, image_size: int, split: str, num_frames: int = 16, limit: int | None = None):
    """The built-in demo's items as records {key, media bytes, extension, caption, label, width, height}."""
    from opendit.data import CaptionedDigitsDataset, MovingDigitsDataset

    if data == "captioned_digits":
        dataset = CaptionedDigitsDataset(image_size, channels=1, split=split)
    elif data == "moving_digits":
        dataset = MovingDigitsDataset(image_size, num_frames=num_frames, channels=1, split=split)
    else:
        raise ValueError(f"--data {data!r}: captioned_digits or moving_digits")
    count = len(dataset) if limit is None else min(limit, len(dataset))
    for i in range(count):
        item = dataset[i]
        pixels = ((item[0].numpy() + 1.0) * 127.5).round().clip(0, 255).astype(np.uint8)  # [1, (T,) S, S]
        label, caption = (item[1], item[2]) if data == "moving_digits" else (int(dataset.labels[i]), item[1])
        media, ext = (_mp4(pixels[0]), "mp4") if data == "moving_digits" else (_png(pixels[0]), "png")
        yield {"key": f"{i:06d}", "media": media, "ext": ext, "caption": caption, "label": int(label),
               "width": image_size, "height": image_size}


def write_tars(records, folder: str, shard_size: int) -> list[dict]:
    """-> the wids shard list written beside the shards."""
    import webdataset as wds

    os.makedirs(folder, exist_ok=True)
    shards, writer, count = [], None, 0
    for n, r in enumerate(records):
        if n % shard_size == 0:
            if writer is not None:
                writer.close()
                shards[-1]["nsamples"] = count
            name = f"{len(shards):05d}.tar"
            writer, count = wds.TarWriter(os.path.join(folder, name)), 0
            shards.append({"url": name, "nsamples": 0})
        meta = {k: r[k] for k in ("key", "caption", "label", "width", "height")}
        writer.write({"__key__": r["key"], r["ext"]: r["media"], "txt": r["caption"], "cls": r["label"],
                      "json": meta})
        count += 1
    if writer is not None:
        writer.close()
        shards[-1]["nsamples"] = count
    with open(os.path.join(folder, "dataset.json"), "w", encoding="utf-8") as f:
        json.dump({"wids_version": 1, "shardlist": shards}, f, indent=1)
    return shards


def _columns(records) -> dict:
    rows = list(records)
    return {"key": [r["key"] for r in rows],
            "image": [{"bytes": r["media"], "path": f"{r['key']}.{r['ext']}"} for r in rows],
            "caption": [r["caption"] for r in rows], "label": [r["label"] for r in rows],
            "width": [r["width"] for r in rows], "height": [r["height"] for r in rows]}


def write_parquet(records, folder: str, shard_size: int, row_group: int = 256) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    rows, shard = list(records), 0
    for shard, start in enumerate(range(0, len(rows), shard_size)):
        table = pa.table(_columns(rows[start:start + shard_size]))
        pq.write_table(table, os.path.join(folder, f"{shard:05d}.parquet"), row_group_size=row_group)
    return shard + 1


def write_hf(records, folder: str) -> None:
    import datasets

    datasets.Dataset.from_dict(_columns(records)).save_to_disk(folder)


def write(out: str, data: str = "captioned_digits", formats=FORMATS, image_size: int = 16, split: str = "all",
          shard_size: int = 500, num_frames: int = 16, limit: int | None = None) -> dict[str, str]:
    """Write the demo data in each of `formats` under `out` -> {format: the --data_path to train on}."""
    records = list(demo_records(data, image_size, split, num_frames, limit))
    paths = {}
    for fmt in formats:
        folder = os.path.join(out, FOLDERS[fmt])
        if fmt == "webdataset":
            shards = write_tars(records, folder, shard_size)
            paths[fmt] = os.path.join(folder, f"{{00000..{len(shards) - 1:05d}}}.tar")
        elif fmt == "parquet":
            write_parquet(records, folder, shard_size)
            paths[fmt] = folder
        else:
            write_hf(records, folder)
            paths[fmt] = folder
    return paths


def write_shard_list(pattern: str, out: str, cache_dir: str | None = None) -> int:
    """Count the samples of each shard of `pattern` (as a run would) -> the wids shard list at `out`; total samples.
    Shard URLs are written relative to `out`'s folder where they lie under it."""
    from opendit.data.shard_sources import TarShards

    shards = TarShards(pattern, cache_dir)
    folder = os.path.dirname(os.path.abspath(out))
    entries = []
    for name, count in zip(shards.names, shards.sizes):
        local = os.path.abspath(name) if "://" not in name else None
        url = os.path.relpath(local, folder) if local and local.startswith(folder + os.sep) else name
        entries.append({"url": url, "nsamples": int(count)})
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"wids_version": 1, "shardlist": entries}, f, indent=1)
    os.replace(out + ".tmp", out)
    return len(shards)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the folder to write (tar/, parquet/, hf/ inside); with --list: "
                                                     "the shard list's .json")
    parser.add_argument("--list", default=None, metavar="PATTERN",
                        help="write the wids shard list of these existing tar shards instead of demo data")
    parser.add_argument("--data", default="captioned_digits", choices=("captioned_digits", "moving_digits"))
    parser.add_argument("--formats", nargs="+", default=["webdataset", "parquet"], choices=FORMATS)
    parser.add_argument("--image_size", type=int, default=16, help="pixels of the stored images (or frames)")
    parser.add_argument("--split", default="all", choices=("all", "train", "test"),
                        help="the digits split (test: the held-out fifth the quality benchmarks score on)")
    parser.add_argument("--shard_size", type=int, default=500, help="samples per shard")
    parser.add_argument("--num_frames", type=int, default=16, help="moving digits: frames per clip")
    parser.add_argument("--limit", type=int, default=None, help="write only the first N samples")
    args = parser.parse_args(argv)
    if args.list:
        total = write_shard_list(args.list, args.out)
        print(f"{args.out}: {total} samples; train with --dataset webdataset --data_path {args.out}")
        return
    if args.shard_size <= 0:
        parser.error(f"--shard_size {args.shard_size}: must be > 0")
    paths = write(args.out, args.data, args.formats, args.image_size, args.split, args.shard_size, args.num_frames,
                  args.limit)
    for fmt, path in paths.items():
        print(f"{fmt}: --dataset {fmt} --data_path {path}")


if __name__ == "__main__":
    main()
