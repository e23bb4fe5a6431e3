"""Memory budgets (opendit.plan.budgets): every family opendit registers has its debug and release rows in
tests/data/memory_budgets.json; every row's planned bytes by part are the recorded ones within 2% or 16 KiB; and a
change that breaks a budget fails naming the run, its options, the part and both figures (re-record an intended
change with `python -m opendit.plan.budgets --record`)."""
import importlib

import pytest

from opendit.plan import budgets

accounting = importlib.import_module("opendit.plan.account")  # the module (opendit.plan.account is its function)

MiB = 2 ** 20


@pytest.fixture(scope="module")
def table():
    return budgets.load()


def test_every_registered_family_has_debug_and_release_rows(table):
    assert not budgets.missing(table), "\n".join(budgets.missing(table))
    trimmed = dict(table, rows=[r for r in table["rows"] if r["family"] != "flux"])  # as a new family would be
    assert budgets.missing(trimmed) == [
        f"family 'flux' has no {case} row in memory_budgets.json: add it with {budgets.RECORD} --family flux"
        for case in ("debug", "release")]


def test_every_recorded_budget_holds(table):
    problems = budgets.check(table["rows"])
    assert not problems, "\n".join(problems)


def test_a_broken_budget_fails_naming_the_run_the_part_and_both_figures(table, monkeypatch):
    [row] = [r for r in table["rows"] if r["config"]["model"] == "DiT-XL/2" and r["plugin"] == "ddp"
             and r["options"] == {"grad_checkpoint": 1}]
    real = accounting._block_bytes
    monkeypatch.setattr(accounting, "_block_bytes", lambda f, every: (1.5 * real(f, every)[0], *real(f, every)[1:]))
    [message] = budgets.check([row])
    was = row["gpu"]["activations"]
    assert message.startswith("DiT-XL/2 (dit release: 256 px, batch 32 per process; --plugin ddp x 1, "
                              "--grad_checkpoint 1): gpu activations is ")
    assert f"is {1.5 * was / MiB:.3f} MiB, recorded {was / MiB:.3f} MiB (+50.0%" in message
    assert "the tolerance is 2% or 16 KiB" in message and message.endswith(budgets.RECORD)
