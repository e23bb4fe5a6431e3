"""Memory budgets as tests: the planner's bytes by part (opendit.plan.account) for every registered family's debug
model and its flagship release at a typical size, per plugin and lean option, recorded in
tests/data/memory_budgets.json. tests/test_memory_budgets.py recomputes every row and fails when a part moves by more
than RELATIVE of its recorded bytes or ABSOLUTE bytes, whichever is larger. Everything is planned on the meta device
(no weights allocated), a few seconds per family.

    python -m opendit.plan.budgets --record          # re-record the table after an intended change of the planner
    python -m opendit.plan.budgets                   # check it: every part that moved, as the test reports it
    python -m opendit.plan.budgets --record --family flux2   # re-record one family's rows, keep the others

The table's "cases" name each family's two runs: "debug" (its debug model at a small latent size) and "release" (its
flagship at a typical resolution, with lora_rank where it is usually LoRA-tuned), batch_size per process. --record
keeps them and adds a new family's by rule (its first model named debug at 128 px; its largest model at 1024 px, a
video model's at 480 px x 81 frames; LoRA 16 from 8B parameters): edit them in the file and record again where the
rule picks wrong. Rows of a case: --plugin ddp on one process under each option of LEAN (a debug case: DEBUG_LEAN),
--plugin zero2 and zero3 on WORLD processes without one, and a LoRA case's adapters under LORA_LEAN with ddp. Every
run has bf16 compute, an EMA, and the family's usual VAE and text encoders (no latent cache); "gpu" is the device.
"""
import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from opendit import config as cfglib
from opendit.families import FAMILIES
from opendit.plan.account import account
from opendit.plan.planner import Options
from opendit.plan.report import build_run, planned_config
from opendit.training.run_checks import validate_run

TABLE = Path(__file__).resolve().parents[2] / "tests" / "data" / "memory_budgets.json"
RECORD = "python -m opendit.plan.budgets --record"
RELATIVE, ABSOLUTE = 0.02, 2 ** 14  # the planner is exact: the floor only spares tiny parts
MiB, KiB = 2 ** 20, 2 ** 10
WORLD = 8  # processes of the sharded plugins' rows
DEVICE = torch.device("cuda")  # the planner's split into device and host parts (nothing runs there)
SHARDED = ("zero2", "zero3")
# "half": --blocks_to_swap of half the model's blocks
LEAN = ({}, {"grad_checkpoint": 1}, {"optimizer_offload": True}, {"optimizer_state_dtype": "bf16"},
        {"optimizer_state_dtype": "u16"}, {"master_weights": "bf16_exact"}, {"fused_backward": True},
        {"blocks_to_swap": "half"})
DEBUG_LEAN = ({}, {"grad_checkpoint": 1}, {"optimizer_offload": True}, {"blocks_to_swap": "half"})
LORA_LEAN = ({}, {"grad_checkpoint": 1})
LORA_FROM = 8e9  # parameters from which a new family's release case is LoRA-tuned (the rule of default_cases)


def registered() -> list[str]:
    """The families opendit itself registers (not those a test or OPENDIT_FAMILIES adds), in registry order."""
    return [name for name, f in FAMILIES.items() if type(f).__module__.startswith("opendit.")]


def run_config(config: dict, plugin: str = "ddp", world: int = 1, options: dict | None = None):
    """A row's resolved TrainConfig: `config` (model, image_size, num_frames, batch_size per process, lora_rank)
    with `plugin` on `world` processes, bf16 compute, the family's usual encoders."""
    given = {**config, "batch_size": config["batch_size"] * world}
    cfg = planned_config(cfglib.TrainConfig(**given, plugin=plugin, mixed_precision="bf16", vae="auto",
                                            **(options or {})))
    return cfg if cfg.num_classes is not None else dataclasses.replace(cfg, num_classes=1000)  # as plan_config


class Planner:
    """Bytes by part of rows, each config's model measured once (its facts do not depend on the plugin)."""

    def __init__(self):
        self.runs = {}

    def run(self, config: dict):
        key = json.dumps(config, sort_keys=True)
        if key not in self.runs:
            self.runs[key] = build_run(run_config(config), 1, DEVICE)
        return self.runs[key]

    def parts(self, row: dict) -> dict:
        base = self.run(row["config"])
        run = dataclasses.replace(base, cfg=run_config(row["config"], row["plugin"], row["world"]),
                                  world=row["world"])
        return account(run, Options(**row["options"]))


def describe(row: dict) -> str:
    c = row["config"]
    frames = f" x {c['num_frames']} frames" if "num_frames" in c else ""
    lora = f", LoRA {c['lora_rank']}" if c.get("lora_rank") else ""
    return (f"{c['model']} ({row['family']} {row['case']}: {c['image_size']} px{frames}, batch {c['batch_size']} per "
            f"process{lora}; --plugin {row['plugin']} x {row['world']}, {Options(**row['options']).flags()})")


def compare(row: dict, parts: dict) -> list[str]:
    """A message for each part of `parts` that moved beyond the tolerance from the row's recorded bytes."""
    out = []
    for where in ("gpu", "host"):
        for part in [*row[where], *(p for p, v in parts[where].items() if v and p not in row[where])]:
            was, now = row[where].get(part, 0), parts[where].get(part, 0.0)
            if abs(now - was) > max(RELATIVE * was, ABSOLUTE):
                change = f"{now / was - 1:+.1%}" if was else "new"
                out.append(f"{describe(row)}: {where} {part} is {now / MiB:.3f} MiB, recorded {was / MiB:.3f} MiB "
                           f"({change}; the tolerance is {RELATIVE:.0%} or {ABSOLUTE / KiB:.0f} KiB). Find what "
                           f"moved it; if the change is intended, re-record: {RECORD}")
    return out


def check(rows: list[dict], planner: Planner | None = None) -> list[str]:
    """Every part of `rows` that moved beyond the tolerance, as messages (none: every budget holds)."""
    planner = planner or Planner()
    return [m for row in rows for m in compare(row, planner.parts(row))]


def missing(table: dict, families: list[str] | None = None) -> list[str]:
    """A message for each registered family without a debug or a release row."""
    have = {(r["family"], r["case"]) for r in table["rows"]}
    return [f"family {name!r} has no {case} row in {TABLE.name}: add it with {RECORD} --family {name}"
            for name in families or registered() for case in ("debug", "release") if (name, case) not in have]


def load(path: Path = TABLE) -> dict:
    if not path.is_file():
        raise ValueError(f"no memory budget table at {path}: record it with {RECORD}")
    return json.loads(path.read_text())


def default_cases(name: str) -> dict:
    """A new family's cases by the rule of the module docstring."""
    family = FAMILIES[name]
    debug = next((m for m in family.models if "debug" in m), next(iter(family.models)))
    video = len(family.memory_probe(run_config(dict(model=debug, image_size=128, batch_size=1)), DEVICE)
                .latent_shape) == 4
    frames = lambda n: dict(num_frames=n) if video else {}  # noqa: E731
    sizes = {}
    for model in family.models:
        cfg = run_config(dict(model=model, image_size=128, batch_size=1, **frames(9)))
        with torch.device("meta"):
            built = family.memory_model(cfg, family.memory_probe(cfg, DEVICE).latent_shape)
        sizes[model] = sum(p.numel() for p in built.parameters())
    largest = max(sizes, key=sizes.get)
    release = dict(model=largest, image_size=480 if video else 1024, **frames(81), batch_size=1)
    return dict(debug=dict(model=debug, image_size=128, **frames(9), batch_size=2),
                release=dict(release, lora_rank=16) if sizes[largest] >= LORA_FROM else release)


def case_rows(name: str, kind: str, case: dict, planner: Planner) -> list[dict]:
    """The rows of one case (module docstring), each validated as the Trainer would."""
    config = {k: v for k, v in case.items() if k != "lora_rank"}
    plans = [(config, "ddp", 1, o) for o in (LEAN if kind == "release" else DEBUG_LEAN)]
    plans += [(config, plugin, WORLD, {}) for plugin in SHARDED]
    if case.get("lora_rank"):
        plans += [({**config, "lora_rank": case["lora_rank"]}, "ddp", 1, o) for o in LORA_LEAN]
    rows = []
    for config, plugin, world, options in plans:
        half = len(planner.run(config).facts.blocks) // 2
        options = {k: half if v == "half" else v for k, v in options.items()}
        cfg = run_config(config, plugin, world, options)
        validate_run(cfg, FAMILIES[name].models[config["model"]], world, DEVICE)
        row = dict(family=name, case=kind, config=config, plugin=plugin, world=world, options=options)
        parts = planner.parts(row)
        rows.append(dict(row, **{w: {p: round(v) for p, v in parts[w].items() if v} for w in ("gpu", "host")}))
    return rows


def record(path: Path = TABLE, families: list[str] | None = None) -> dict:
    """Recompute the rows of `families` (default: every registered one) and write the table, keeping the other
    families' rows and every case."""
    table = load(path) if path.is_file() else dict(cases={}, rows=[])
    names = families or registered()
    cases, planner, rows = table["cases"], Planner(), [r for r in table["rows"] if r["family"] not in names]
    for name in names:
        start = time.perf_counter()
        if name not in cases:
            cases[name] = default_cases(name)
            print(f"{name}: new cases by rule {json.dumps(cases[name])}; edit them in {path} if they are not the "
                  f"family's debug model and flagship", flush=True)
        mine = [row for kind, case in cases[name].items() for row in case_rows(name, kind, case, planner)]
        rows += mine
        print(f"{name}: {len(mine)} rows, {time.perf_counter() - start:.1f} s", flush=True)
    order = {name: i for i, name in enumerate(registered())}
    rows.sort(key=lambda r: order.get(r["family"], len(order)))  # stable: a family's rows keep their order
    head = dict(about=f"opendit.plan.budgets: the planner's bytes by part; re-record with {RECORD}",
                tolerance=dict(relative=RELATIVE, bytes=ABSOLUTE), world=WORLD,
                cases={name: cases[name] for name in sorted(cases, key=lambda n: order.get(n, len(order)))})
    text = json.dumps(head, indent=1)[:-2] + ',\n "rows": [\n' + ",\n".join("  " + json.dumps(r) for r in rows)
    path.write_text(text + "\n ]\n}\n")
    return load(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record", action="store_true", help="recompute the rows and write the table")
    p.add_argument("--family", action="append", help="only this family (repeat for more); default: every one")
    p.add_argument("--table", type=Path, default=TABLE, help="the table (default: %(default)s)")
    a = p.parse_args(argv)
    unknown = sorted(set(a.family or ()) - set(registered()))
    if unknown:
        raise ValueError(f"--family {unknown[0]}: not a family opendit registers; valid: {', '.join(registered())}")
    if a.record:
        start = time.perf_counter()
        table = record(a.table, a.family)
        print(f"{len(table['rows'])} rows in {a.table} ({time.perf_counter() - start:.1f} s)")
        return 0
    table = load(a.table)
    rows = [r for r in table["rows"] if not a.family or r["family"] in a.family]
    problems = missing(table, a.family) + check(rows)
    print("\n".join(problems) or f"{len(rows)} rows within {RELATIVE:.0%} or {ABSOLUTE / KiB:.0f} KiB")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
