"""python -m opendit.eval {fid,is,pr,all,clip_score,stats}: sample-quality metrics of a samples .npz or image folder.

    python -m opendit.eval fid --samples samples/samples.npz --ref VIRTUAL_imagenet256_labeled.npz \\
        --inception_weights pt_inception-2015-12-05-6726825d.pth
    python -m opendit.eval all --samples samples/samples.npz --ref ref_images/ --inception_weights ...   # FID, IS, P/R
    python -m opendit.eval is --samples samples/samples.npz --inception_weights ...
    python -m opendit.eval pr --samples samples/samples.npz --ref VIRTUAL_imagenet256_labeled.npz \\
        --inception_weights ...
    python -m opendit.eval clip_score --samples samples/samples.npz --clip clip-vit-large-patch14/ --prompts_file p.txt
    python -m opendit.eval stats --images ref_images/ --inception_weights ... --out ref_stats.npz   # cache mu/sigma

--ref: an .npz with precomputed `mu` / `sigma` (ADM's reference batches, or what `stats` writes; used for FID as
is), with reference images `arr_0` (ADM's reference batches have both: precision/recall uses the images), or a
folder of images. Video samples ([N, T, H, W, 3]) are scored per frame (all frames pooled). Prints one line and
writes the results to a JSON next to the samples (samples.npz -> samples.eval.json; merged with what is there).
User errors (a missing file, a bad flag) are one `error:` line and exit status 2 (OPENDIT_TRACEBACK=1 shows the
traceback).
"""
import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from opendit.eval.data import UserError, open_images, open_ref_stats, save_stats
from opendit.eval.features import extract, load_inception
from opendit.eval.metrics import feature_stats, frechet_distance, inception_score, precision_recall

INCEPTION_METRICS = {"fid": ("fid",), "is": ("is",), "pr": ("pr",), "all": ("fid", "is", "pr")}


def _fail(text: str):
    print(f"error: {' '.join(str(text).split())}", file=sys.stderr, flush=True)
    sys.exit(2)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2 (argparse prints the usage too)
        _fail(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m opendit.eval", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{fid,is,pr,all,clip_score,stats}")

    def common(p, samples=True):
        if samples:
            p.add_argument("--samples", required=True, help="samples .npz (uint8 arr_0 [N,H,W,3] or [N,T,H,W,3]) "
                           "or a folder of images")
        p.add_argument("--batch_size", type=int, default=50)
        p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")

    def inception(p):
        p.add_argument("--inception_weights", required=True,
                       help="local pt_inception-2015-12-05-6726825d.pth (see docs/evaluation.md; never downloaded)")
        p.add_argument("--backend", default="auto", choices=("auto", "torch-fidelity", "copy"),
                       help="Inception code: torch-fidelity's if installed (auto), or opendit's copy of it")

    helps = {"fid": "Frechet Inception distance to --ref", "is": "Inception score of the samples",
             "pr": "precision / recall (k-NN manifolds) against --ref", "all": "FID, IS and precision/recall, "
             "one pass over the samples"}
    for name, text in helps.items():
        p = sub.add_parser(name, help=text, description=text)
        common(p)
        inception(p)
        if name != "is":
            p.add_argument("--ref", required=True, help="reference .npz (mu/sigma and/or arr_0) or image folder")
        if name in ("is", "all"):
            p.add_argument("--splits", type=int, default=10, help="Inception-score splits")
        if name in ("pr", "all"):
            p.add_argument("--k", type=int, default=3, help="neighbourhood size of the k-NN manifolds")
        p.add_argument("--out", help="JSON to write (default: next to the samples, <samples>.eval.json)")
    p = sub.add_parser("clip_score", help="CLIP score of text-conditioned samples against their prompts",
                       description="CLIP score: mean of 100 * max(cos(image, prompt), 0); sample i was made from "
                                   "prompt i % len(prompts), as sample.py assigns them")
    common(p)
    p.add_argument("--clip", required=True, help="local CLIP folder (transformers CLIPModel + tokenizer)")
    p.add_argument("--prompts", nargs="+", help="the prompts, in sample.py's order")
    p.add_argument("--prompts_file", help="one prompt a line (empty lines skipped)")
    p.add_argument("--out", help="JSON to write (default: next to the samples, <samples>.eval.json)")
    p = sub.add_parser("stats", help="write the Inception mu/sigma of images to an .npz usable as --ref",
                       description="Cache reference statistics: mu / sigma of the pool features, ADM's layout")
    p.add_argument("--images", required=True, help=".npz (arr_0) or folder of images")
    common(p, samples=False)
    inception(p)
    p.add_argument("--out", required=True, help="the .npz to write (keys mu, sigma)")
    return parser


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available here")
    return name


def default_json(samples) -> Path:
    samples = Path(samples)
    if samples.suffix == ".npz":
        return samples.with_suffix(".eval.json")
    return samples.parent / f"{samples.name}.eval.json"


def write_json(path, results: dict) -> Path:
    """Merge `results` into the JSON at `path` (each metric's entry replaced), atomically."""
    path = Path(path)
    merged = {}
    if path.is_file():
        try:
            merged = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            merged = {}
    merged.update(results)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(merged, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def _samples_info(images) -> dict:
    info = {"samples": str(images.path), "num_samples": images.num_samples, "num_images": images.count}
    if images.frames:
        info["frames_per_sample"] = images.frames
        info["video"] = "per-frame metrics: every frame of every clip is one image"
    return info


def run_inception(args, extractor=None, label=None) -> tuple[dict, str]:
    """The Inception metrics of args.command; (results for the JSON, the one line to print)."""
    device = _device(args.device)
    metrics = INCEPTION_METRICS[args.command]
    samples = open_images(args.samples)
    ref_stats = open_ref_stats(args.ref) if "fid" in metrics else None
    ref_images = None
    if "pr" in metrics or ("fid" in metrics and ref_stats is None):
        try:
            ref_images = open_images(args.ref, what="--ref")
        except UserError:
            if open_ref_stats(args.ref) is not None:  # stats serve FID; precision/recall needs images
                raise UserError(f"--ref {args.ref} holds only mu/sigma; precision/recall needs reference images "
                                "(an .npz with arr_0, such as ADM's reference batches, or a folder)") from None
            raise
    if extractor is None:
        extractor, label = load_inception(args.inception_weights, device=device, backend=args.backend)
    progress = sys.stderr.isatty()
    pool, logits = extract(samples, extractor, args.batch_size, device, progress)
    ref_pool = extract(ref_images, extractor, args.batch_size, device, progress)[0] if ref_images else None
    results, line = {}, []
    common = {"feature_extractor": label or "injected", "inception_weights": str(args.inception_weights)}
    if "fid" in metrics:
        if ref_stats is not None:
            mu2, sigma2, source = ref_stats.mu, ref_stats.sigma, "mu/sigma stored in the file"
        else:
            (mu2, sigma2), source = feature_stats(ref_pool), f"computed from {len(ref_pool)} reference images"
        if len(mu2) != pool.shape[1]:
            raise UserError(f"--ref {args.ref}: its statistics are {len(mu2)}-d but the features are "
                            f"{pool.shape[1]}-d (made with another feature extractor?)")
        fid = frechet_distance(*feature_stats(pool), mu2, sigma2)
        results["fid"] = {"value": fid, "ref": str(args.ref), "ref_statistics": source, **common}
        line.append(f"FID {fid:.4f}")
    if "is" in metrics:
        mean, std = inception_score(logits, args.splits)
        results["inception_score"] = {"value": mean, "std": std, "splits": args.splits, **common}
        line.append(f"IS {mean:.3f} ± {std:.3f}")
    if "pr" in metrics:
        precision, recall = precision_recall(ref_pool, pool, k=args.k, device=device)
        results["precision_recall"] = {"precision": precision, "recall": recall, "k": args.k, "ref": str(args.ref),
                                       "ref_num_images": len(ref_pool), **common}
        line.append(f"precision {precision:.4f} recall {recall:.4f}")
    return results, "  ".join(line)


def run_clip(args) -> tuple[dict, str]:
    from opendit.eval.clip_score import clip_score, load_clip, read_prompts

    device = _device(args.device)
    prompts = read_prompts(args.prompts, args.prompts_file)
    samples = open_images(args.samples)
    value, count = clip_score(samples, prompts, load_clip(args.clip, device), args.batch_size, device)
    return ({"clip_score": {"value": value, "clip": str(args.clip), "num_prompts": len(prompts),
                            "num_images": count}}, f"CLIP score {value:.4f}")


def run_stats(args, extractor=None) -> str:
    device = _device(args.device)
    images = open_images(args.images, what="--images")
    if extractor is None:
        extractor = load_inception(args.inception_weights, device=device, backend=args.backend)[0]
    pool = extract(images, extractor, args.batch_size, device, sys.stderr.isatty())[0]
    mu, sigma = feature_stats(pool)
    save_stats(args.out, mu, sigma, num_images=np.array(len(pool)))
    return f"mu/sigma of {len(pool)} images ({pool.shape[1]}-d features) -> {args.out}"


def main(argv=None, extractor=None, label=None) -> dict:
    """The CLI; `extractor` replaces the Inception (tests). Returns what was written to the JSON."""
    args = build_parser().parse_args(argv)
    try:
        if args.batch_size < 1:
            raise UserError(f"--batch_size must be >= 1, got {args.batch_size}")
        if args.command == "stats":
            print(run_stats(args, extractor))
            return {}
        if args.command == "clip_score":
            results, line = run_clip(args)
        else:
            results, line = run_inception(args, extractor, label)
        samples = open_images(args.samples)
        results = {**_samples_info(samples), **results}
        out = write_json(args.out or default_json(args.samples), results)
        video = f", {samples.count} frames" if samples.frames else ""
        print(f"{line}  ({samples.num_samples} samples{video} of {samples.path.name}; -> {out})", flush=True)
        return results
    except UserError as e:
        if os.environ.get("OPENDIT_TRACEBACK", "") not in ("", "0"):
            raise
        _fail(e)


if __name__ == "__main__":
    main()
