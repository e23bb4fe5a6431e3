import json
import math
import os
from pathlib import Path

import pytest
import torch

# Triton kernels run on the CPU through the interpreter; set before any triton import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# README's command runs two pytest-xdist workers on the 2-core machines: one intra-op thread each, or their threads
# fight over the cores (tiny ops then run 100x slower)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture
def one_thread():
    """Run a test with one intra-op thread: two cores shared by several test processes make oversubscribed
    threads slow tiny ops down 100x."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# `-m quick`: the fastest tests, by the seconds each took in a full run (tests/durations.json), up to this sum (about
# two minutes under README's two workers); a test the file does not know yet is not quick. A full run with
# OPENDIT_RECORD_DURATIONS=1 writes the file anew.
DURATIONS = Path(__file__).with_name("durations.json")
QUICK_BUDGET_S = 240.0
RECORD = os.environ.get("OPENDIT_RECORD_DURATIONS") == "1"
_recorded: dict[str, float] = {}


def _shared_fixtures(item) -> list[tuple[str, str, str]]:
    """The module-, class- and session-scoped fixtures of our own (conftest and test files) that item uses. Each is
    set up once, and a full run records its cost on the first test that uses it: a quick test that shares it pays
    that cost too."""
    info = getattr(item, "_fixtureinfo", None)
    keys = []
    for name in item.fixturenames:
        defs = info.name2fixturedefs.get(name) if info else None
        if defs and defs[-1].scope != "function" and defs[-1].baseid:  # baseid "": pytest's own (tmp_path_factory)
            per_module = defs[-1].scope != "session"
            keys.append((name, defs[-1].baseid, item.nodeid.split("::")[0] if per_module else ""))
    return keys


def pytest_collection_modifyitems(config, items):
    known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    shared_by = {item.nodeid: _shared_fixtures(item) for item in items}
    set_up_by = {}  # shared fixture -> (the test whose recorded seconds hold its set-up, those seconds)
    for item in items:
        for key in shared_by[item.nodeid]:
            set_up_by.setdefault(key, (item.nodeid, known.get(item.nodeid, math.inf)))
    spent, paid = 0.0, set()
    for item in sorted(items, key=lambda i: known.get(i.nodeid, math.inf)):
        shared = shared_by[item.nodeid]
        seconds = known.get(item.nodeid, math.inf) + sum(
            set_up_by[k][1] for k in shared if k not in paid and set_up_by[k][0] != item.nodeid)
        if spent + seconds > QUICK_BUDGET_S:
            continue
        spent += seconds
        paid.update(shared)
        item.add_marker(pytest.mark.quick)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    if RECORD:  # setup, call and teardown together (a module fixture's cost lands on its first test)
        _recorded[report.nodeid] = _recorded.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    if RECORD and not hasattr(session.config, "workerinput"):  # the xdist controller (or a plain run) writes
        DURATIONS.write_text(json.dumps({k: round(v, 3) for k, v in sorted(_recorded.items())}, indent=0) + "\n")


@pytest.fixture(scope="session")
def family_runs(tmp_path_factory):
    """One training step of each family's tiny model (pixel space, 8 px; video 4 frames, Wan 5) -> the outputs root
    holding <family>/<run>; the sampling tests (non-square sizes, step caches) read these checkpoints."""
    from opendit.families.wan.tiny_umt5 import save_tiny_umt5
    from tests.families.test_flux import tiny_text_encoders
    from tests.test_train import run_trainer, tiny_cfg

    root = tmp_path_factory.mktemp("family_runs")
    t5, clip = tiny_text_encoders(root / "encoders")
    umt5 = save_tiny_umt5(root / "umt5", max_length=16)
    settings = {"dit": dict(model="DiT-debug"),
                "vdit": dict(model="VDiT-debug", dataset="moving_digits", num_frames=4),
                "latte": dict(model="Latte-debug", dataset="moving_digits", num_frames=4),
                "flux": dict(model="flux-debug", dataset="captioned_digits", t5=t5, clip=clip),
                "wan": dict(model="Wan-debug", dataset="moving_digits", num_frames=5, umt5=umt5)}
    for name, kw in settings.items():
        run_trainer(tiny_cfg(root / name, max_steps=1, batch_size=4, **kw))
    return root
