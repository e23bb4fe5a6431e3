"""LoRA quality benchmark: does the adapter learn something new? `RECIPE=lora_digits bash train_flux.sh` trains a
flux-debug base on the captioned digits 0-4 only, samples prior images of 0-4 from it (python -m opendit.prior),
then a rank-8 LoRA on the digits 5-9 with their captions beside those prior images (prior preservation); this
samples prompts naming each digit ("a handwritten seven") from the base with the adapter (0-9) and without it,
and has the independent classifier of flux_quality.py / digits_quality.py (an RBF SVM trained on real digits
only) name each sample's digit.

    python benchmarks/lora_quality.py                       # runs the recipe (at most 15 min on 2 CPU cores)
    python benchmarks/lora_quality.py --check               # exit 1 when a target is missed
    python benchmarks/lora_quality.py --base B/ema.safetensors --lora L/step-001500   # score a finished run
    python benchmarks/lora_quality.py --base_steps 3 --lora_steps 3 --batch_size 8 --samples_per_digit 1 \\
        --sampling_steps 2                                  # smoke run
    python benchmarks/lora_quality.py -- --lora_alpha 16   # flags after -- go to the recipe's LoRA stage

--lora is a LoRA run's checkpoint folder (its lora.safetensors on the base it names) or a LoRA file applied to
--base. Targets: >= 80% of the 5-9 samples with the adapter, >= 90% of the 0-4 ones with it (it forgets
nothing); the base alone on 5-9 (never trained on them) and on 0-4 is reported.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.digits_quality import train_classifier  # noqa: E402
from benchmarks.flux_quality import encoders  # noqa: E402
from opendit import config as cfglib  # noqa: E402
from opendit.data.captions import DIGIT_WORDS  # noqa: E402
from benchmarks.bench_common import sample_checkpoint  # noqa: E402

OLD, NEW = (0, 1, 2, 3, 4), (5, 6, 7, 8, 9)
# (row, adapter?, digits, target): what the table reports; a target of None is reported only
ROWS = (("base + adapter", True, NEW, 0.80), ("base + adapter", True, OLD, 0.90),
        ("base alone", False, NEW, None), ("base alone", False, OLD, None))


def run_recipe(a, extra: list[str]) -> tuple[str, str, dict]:
    """RECIPE=lora_digits bash train_flux.sh into --outputs -> (base weights, LoRA checkpoint, seconds), as the
    recipe prints them."""
    out = Path(a.outputs).resolve()
    encoders(out / "encoders", "flux-debug")  # made here, in this process (the recipe would start two more)
    env = {**os.environ, "RECIPE": "lora_digits", "OUT": str(out), "ENC": str(out / "encoders")}
    for name, value in (("BASE_STEPS", a.base_steps), ("LORA_STEPS", a.lora_steps), ("BATCH", a.batch_size),
                        ("PRIOR", a.prior), ("PRIOR_REPEATS", a.prior_repeats), ("PRIOR_WEIGHT", a.prior_weight)):
        if value is not None:
            env[name] = str(value)
    t0 = time.time()
    proc = subprocess.run(["bash", "train_flux.sh", *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    seconds = {"recipe": round(time.time() - t0, 1)}
    sys.stderr.write(proc.stdout)
    if proc.returncode:
        raise SystemExit(f"the recipe failed (exit {proc.returncode}); its output is above")
    found = dict(re.findall(r"^(base|LoRA checkpoint) \(.*?\): (\S+)$", proc.stdout, re.M))
    seconds.update({f"stage_{k}": int(v) for k, v in re.findall(r"^== stage (\w+) took (\d+) s", proc.stdout, re.M)})
    return found["base"], found["LoRA checkpoint"], seconds


def score(clf, a, ckpt: str, lora: list[str], digits: tuple[int, ...]) -> tuple[float, list[float], float]:
    """(share of samples the classifier names right, per digit, sampling seconds) of prompts naming `digits`."""
    prompts = [f"a handwritten {DIGIT_WORDS[d]}" for d in digits]
    sample_cfg = cfglib.SampleConfig(ckpt=ckpt, lora=lora, cfg_scale=a.cfg_scale, num_sampling_steps=a.sampling_steps,
                                     seed=a.seed, prompts=prompts)
    n = len(digits) * a.samples_per_digit
    images, seconds = sample_checkpoint(sample_cfg, prompts, n)
    wanted = np.array([digits[i % len(digits)] for i in range(n)])
    hit = clf.predict(images.reshape(n, -1).astype(np.float32) / 127.5 - 1.0) == wanted  # the real digits' scale
    return float(hit.mean()), [float(hit[wanted == d].mean()) for d in digits], seconds


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=None, help="the base weights (an EMA export); with --lora: score, no training")
    p.add_argument("--lora", default=None, help="a LoRA run's checkpoint folder, or a LoRA file on --base")
    p.add_argument("--base_steps", type=int, default=None, help="default: the recipe's")
    p.add_argument("--lora_steps", type=int, default=None, help="default: the recipe's")
    p.add_argument("--batch_size", type=int, default=None, help="both stages; default: the recipe's")
    p.add_argument("--prior", type=int, default=None, help="prior images per 0-4 caption (0: none); default: the "
                   "recipe's")
    p.add_argument("--prior_repeats", type=int, default=None, help="default: the recipe's")
    p.add_argument("--prior_weight", type=float, default=None, help="--prior_loss_weight; default: the recipe's")
    p.add_argument("--samples_per_digit", type=int, default=20)
    p.add_argument("--cfg_scale", type=float, default=4.0, help="true classifier-free guidance (empty negative)")
    p.add_argument("--sampling_steps", type=int, default=50)
    p.add_argument("--outputs", default="outputs/lora_quality", help="the recipe's OUT (and its encoders)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    a = p.parse_args(argv)
    if (a.base is None) != (a.lora is None):
        p.error("--base and --lora go together (score a finished run), or neither (run the recipe)")

    seconds = {}
    if a.base is None:
        base, lora_ckpt, seconds = run_recipe(a, extra)
    else:
        base, lora_ckpt = a.base, a.lora
    # with the adapter: a LoRA run's checkpoint folder samples its base + its lora.safetensors; a file: on --base
    adapted = (lora_ckpt, []) if Path(lora_ckpt).is_dir() else (base, [lora_ckpt])

    clf, real_acc = train_classifier(16)
    rows, sample_s = [], 0.0
    for name, with_adapter, digits, target in ROWS:
        ckpt, lora = adapted if with_adapter else (base, [])
        acc, per_digit, s = score(clf, a, ckpt, lora, digits)
        sample_s += s
        rows.append(dict(samples=name, digits=f"{digits[0]}-{digits[-1]}", accuracy=round(acc, 4),
                         per_digit=[round(v, 3) for v in per_digit], target=target,
                         met=None if target is None else acc >= target))
    result = dict(base=base, lora=lora_ckpt, cfg_scale=a.cfg_scale, sampling_steps=a.sampling_steps,
                  samples_per_digit=a.samples_per_digit, seconds={**seconds, "sampling": round(sample_s, 1)},
                  classifier_accuracy_real_held_out=round(real_acc, 4), rows=rows)
    print(json.dumps(result, indent=1))
    print(f"\nclassifier on real held-out digits: {real_acc:.1%}; {a.samples_per_digit} samples per digit, "
          f"CFG {a.cfg_scale:g}, {a.sampling_steps} Euler steps\n")
    print("| samples | prompted digits | classifier names the prompted digit | target |")
    print("|---|---|---:|---|")
    for r in rows:
        target = "report" if r["target"] is None else f">= {r['target']:.0%} ({'met' if r['met'] else 'MISSED'})"
        print(f"| {r['samples']} | {r['digits']} | {r['accuracy']:.1%} | {target} |")
    missed = [r for r in rows if r["met"] is False]
    if a.check and missed:
        names = ", ".join(f"{r['samples']} on {r['digits']}" for r in missed)
        sys.exit(f"targets missed: {names}")


if __name__ == "__main__":
    main()
