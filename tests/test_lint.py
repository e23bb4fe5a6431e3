"""ruff (the rules in ruff.toml) finds nothing in the package, the entry scripts, the tests and the benchmarks; every
shell script parses (bash -n: a syntax error anywhere in a recipe script breaks all of its recipes)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed (pip install -e .[dev])")
def test_ruff_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"ruff check . found (fix them, or `ruff check --fix .`):\n{out.stdout}{out.stderr}"


@pytest.mark.parametrize("script", sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("**/*.sh")
                                          if ".git" not in p.parts and "outputs" not in p.parts))
def test_shell_scripts_parse(script):
    out = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
