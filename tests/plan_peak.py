"""Child of tests/test_plan.py (and benchmarks/plan_check.py --families --device cpu): two real training steps on the
CPU; prints the peak RSS growth (bytes) over the RSS just before the Trainer builds anything, and the planner's
prediction for the same config (device cpu). The JSON argument overrides BASE with any train.py options.

    python tests/plan_peak.py '{"model": "DiT-B/2", "optimizer_state_dtype": "bf16"}'
"""
import json
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opendit import config as cfglib  # noqa: E402
from opendit.families import family_of  # noqa: E402
from opendit.plan import account  # noqa: E402
from opendit.plan.report import build_run  # noqa: E402
from opendit.plan.planner import Options  # noqa: E402
from opendit.training.loop import Trainer  # noqa: E402

BASE = dict(dataset="digits", image_size=8, num_classes=10, batch_size=4, num_workers=0, max_steps=2, log_every=1,
            ckpt_every=1000, max_bad_steps=0, outputs="/tmp/plan_peak")


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def main():
    torch.set_num_threads(1)
    cfg = cfglib.TrainConfig(**{**BASE, **json.loads(sys.argv[1])})
    run = build_run(family_of(cfg.model).resolve_config(cfg), 1, torch.device("cpu"))
    before = rss()
    trainer = Trainer(cfg)
    batches = iter(trainer.loader)
    for _ in range(2):
        trainer.train_step(next(batches))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    options = Options(**{k: getattr(cfg, k) for k in Options.__dataclass_fields__})
    parts = account(run, options)
    predicted = sum(parts["gpu"].values()) + sum(parts["host"].values())
    print(json.dumps({"measured": peak - before, "predicted": predicted}))


if __name__ == "__main__":
    main()
