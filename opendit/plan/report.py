"""The planner's entry: a run's config and --memory_budget -> the chosen options applied to the config, and the
plan as a table of bytes per part against the budget (what train.py logs and `python -m opendit.plan` prints)."""
import dataclasses
import os
from pathlib import Path

import torch

from opendit import config as cfglib
from opendit.booster.precision import compute_dtype
from opendit.families import family_of
from opendit.plan.account import PARTS, Run
from opendit.plan.measure import model_facts
from opendit.plan.planner import Choice, choose, totals
from opendit.training.run_checks import validate_run

GiB = 2 ** 30
MARGIN = 0.9  # `auto` plans within 90% of the free device memory and of the host's available memory


def host_available() -> float:
    """Bytes of host memory available now (/proc/meminfo's MemAvailable)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError("--memory_budget auto: cannot read the host's available memory (/proc/meminfo); give "
                     "--memory_budget GPU_GiB,HOST_GiB")


def parse_budget(text: str, on_cpu: bool) -> tuple[float, float]:
    """'GPU_GiB[,HOST_GiB]' or 'auto' -> (device bytes, host bytes). On a CPU the one number is host memory."""
    if text == "auto":
        host = MARGIN * host_available()
        return (host, host) if on_cpu else (MARGIN * torch.cuda.mem_get_info()[0], host)
    try:
        values = [float(v) * GiB for v in text.split(",")]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 2 or min(values) <= 0:
        raise ValueError(f"--memory_budget {text!r}: expected GPU_GiB[,HOST_GiB] (e.g. 24 or 24,64) or auto")
    if on_cpu:  # one memory: the device's parts and the host's share it
        return values[-1], values[-1]
    return values[0], values[1] if len(values) == 2 else MARGIN * host_available()


def planned_config(cfg, latent_cache: bool = False):
    """A config as `python -m opendit.plan` resolves it: the family's first dataset that is (with latent_cache) or is
    not a latent cache, its usual VAE unless --vae none, the family's defaults."""
    family = family_of(cfg.model)
    data = [name for name, spec in family.datasets.items() if spec.cache == latent_cache]
    cfg = dataclasses.replace(cfg, dataset=data[0], vae="none" if cfg.vae == "none" else "usual")
    return family.fill_defaults(cfg) if hasattr(family, "fill_defaults") else family.resolve_config(cfg)


def build_run(cfg, world: int, device: torch.device) -> Run:
    """The model's facts (meta device, measured activations) and frozen encoders of a resolved config."""
    family = family_of(cfg.model)
    probe = family.memory_probe(cfg, device)
    cached = family.datasets[cfg.dataset].cache if cfg.dataset in family.datasets else False
    facts = model_facts(family, cfg, probe.latent_shape, compute_dtype(cfg.mixed_precision))
    return Run(facts, {} if cached else dict(probe.encoders), cfg, world)


def plan_config(cfg, budget_text: str, world: int = 1, device: torch.device | None = None):
    """-> (cfg with the chosen options, the Choice, the table). ValueError when nothing fits."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_cpu = device.type == "cpu"
    if cfg.num_classes is None:
        cfg = dataclasses.replace(cfg, num_classes=1000)  # before the data says: ImageNet's (a small embedding)
    budget = parse_budget(budget_text, on_cpu)
    run = build_run(cfg, world, device)
    spec = family_of(cfg.model).models[cfg.model]

    def validate(o):
        validate_run(dataclasses.replace(cfg, **dataclasses.asdict(o)), spec, world, device)

    choice = choose(run, budget, validate, on_cpu)
    planned = dataclasses.replace(cfg, **dataclasses.asdict(choice.options))
    return planned, choice, table(cfg, choice, budget, on_cpu)


def table(cfg, choice: Choice, budget: tuple[float, float], on_cpu: bool) -> str:
    """Markdown: bytes per part on the device and the host, the totals against the budget, the next option."""
    gpu_head = "device (CPU: host)" if on_cpu else "GPU"
    lines = [f"memory plan for {cfg.model}, {cfg.image_size} px, batch {cfg.batch_size}, {cfg.mixed_precision}: "
             f"{choice.options.flags()}", "", f"| part | {gpu_head} GiB | host GiB |", "|---|---:|---:|"]
    for part in PARTS:
        lines.append(f"| {part} | {choice.parts['gpu'][part] / GiB:.2f} | {choice.parts['host'][part] / GiB:.2f} |")
    gpu, host = (sum(choice.parts[k].values()) for k in ("gpu", "host"))
    lines.append(f"| **total** | **{gpu / GiB:.2f}** | **{host / GiB:.2f}** |")
    if on_cpu:
        lines.append(f"| budget | | {budget[1] / GiB:.2f} (device and host together: {(gpu + host) / GiB:.2f}) |")
    else:
        lines.append(f"| budget | {budget[0] / GiB:.2f} | {budget[1] / GiB:.2f} |")
    lines.append("")
    lines.append(f"estimated step: {choice.seconds:.2f} s (cost model of docs/memory_planner.md)")
    nxt = choice.next_smaller
    if nxt is None:
        lines.append("with a smaller budget: no plan with less device memory")
    else:
        saved = totals(choice.parts, on_cpu)[0] - totals(nxt.parts, on_cpu)[0]
        lines.append(f"with a smaller budget it would next use {nxt.options.flags(choice.options)} "
                     f"({saved / GiB:.2f} GiB less, {nxt.seconds / choice.seconds - 1:+.0%} time)")
    return "\n".join(lines)


def apply_memory_budget(cfg):
    """train.py --memory_budget: the config with the planned options (rank 0 prints the table); the
    options land in the run's config.yaml with the rest."""
    _, choice, text = plan_config(family_of(cfg.model).resolve_config(cfglib.for_family(cfg)), cfg.memory_budget,
                                  int(os.environ.get("WORLD_SIZE", "1")))
    if os.environ.get("RANK", "0") == "0":
        print(text, flush=True)
    return dataclasses.replace(cfg, **dataclasses.asdict(choice.options))  # the rest as given: the data decides
