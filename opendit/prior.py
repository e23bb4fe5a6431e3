"""Class images for prior preservation, sampled from the base model itself (DreamBooth):

    python -m opendit.prior --ckpt BASE --prompts "a photo of a dog" ... --num 200 --out data/prior
    python -m opendit.prior --ckpt BASE --prompts_file classes.txt --num 50 --out data/prior --cfg_scale 4

writes `--num` images per prompt into `--out` as a captioned folder: NNNNNN.png with NNNNNN.txt beside it holding
the prompt it was sampled from. List that folder in a --dataset_config with `prior = true`, and train.py weights
the loss of its batches by --prior_loss_weight, so the adapter or fine-tune learns the new subject while the
model keeps making what the base made for the class. Every other flag is sample.py's (sampler, steps, guidance,
seed, size, --lora, torchrun); `--out` must not hold files yet (nothing already there is touched).
"""
import argparse
import os
import shutil
import sys
from pathlib import Path

from opendit import config as cfglib
from opendit.cli import fail, parse_config, run_entry
from opendit.families.base import prompt_conditions
from opendit.inference import sample_to_folder

SAMPLES = ".samples"  # sample.py's own output, inside --out while it runs


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} already holds files; pass a new or empty folder (nothing in it is "
                              "changed)")


def write_prior(cfg, num: int, out: Path) -> int:
    """Sample `num` images per prompt of the sample config `cfg` into the captioned folder `out` -> images."""
    prompts = prompt_conditions(cfg, cfg.model or "the model")
    check_out(out)
    work = out / SAMPLES
    total = num * len(prompts)
    sample_to_folder(cfglib.SampleConfig(**{**vars(cfg), "out": str(work), "num_samples": total}))
    if os.environ.get("RANK", "0") != "0":
        return total
    images = sorted((work / "images").glob("*.png"))
    if len(images) != total:
        raise RuntimeError(f"sample.py wrote {len(images)} images into {work / 'images'}, not {total}")
    for i, image in enumerate(images):  # sample i was made from prompts[i % len(prompts)] (sample.py's rule)
        image.rename(out / image.name)
        (out / image.with_suffix(".txt").name).write_text(prompts[i % len(prompts)] + "\n", encoding="utf-8")
    shutil.rmtree(work)
    return total


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    own = argparse.ArgumentParser(prog="python -m opendit.prior", description=__doc__, add_help=False,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    own.add_argument("--num", type=int, required=True, help="images per prompt")
    own.add_argument("--out", required=True, help="the captioned folder to write (new or empty)")
    own.error = lambda text: fail(f"{text} (python -m opendit.prior --num N --out DIR plus sample.py's flags)",
                                  hint=False)
    if "-h" in argv or "--help" in argv:
        own.print_help()
        return
    mine, rest = own.parse_known_args(argv)
    if mine.num < 1:
        fail(f"--num {mine.num}: must be an integer >= 1 (images per prompt)", hint=False)
    cfg = parse_config(cfglib.SampleConfig, __doc__, rest)
    try:
        check_out(Path(mine.out))
    except FileExistsError as e:
        fail(str(e), hint=False)
    total = run_entry(lambda c: write_prior(c, mine.num, Path(mine.out)), cfg, check=cfglib.check_config)
    if os.environ.get("RANK", "0") == "0":
        print(f"wrote {total} prior images with their captions into {mine.out}")


if __name__ == "__main__":
    main()
