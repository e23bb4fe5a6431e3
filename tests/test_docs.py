"""The docs a newcomer reads stay true: the README fits a screen, docs/architecture.md's layout names every
module of opendit/, and docs/flags.md lists every flag the entry scripts take (it is generated from the options)."""
import os
import subprocess
import sys

from tests.test_layers import PACKAGE, modules
from tests.test_train import ROOT


def layout_paths(text: str) -> set[str]:
    """The files and folders of the fenced layout block after "## Layout", as paths ("opendit/checkpoint/save.py"),
    read from their indentation (two spaces a level)."""
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    paths, stack = set(), []
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        name = line.split()[0]
        stack = stack[:depth] + [name.rstrip("/")]
        paths.add("/".join(stack))
    return paths


def test_architecture_layout_names_every_module():
    documented = layout_paths((ROOT / "docs" / "architecture.md").read_text())
    actual = {str((path.parent if path.name == "__init__.py" else path).relative_to(PACKAGE.parent))
              for path in modules().values()}  # a package is named by its folder
    missing = sorted(actual - documented)
    stale = sorted(p for p in documented - actual if p.startswith("opendit/") and p.endswith(".py"))
    assert not missing, f"docs/architecture.md's layout lacks {missing}"
    assert not stale, f"docs/architecture.md's layout names modules that do not exist: {stale}"


def test_flag_reference_is_current():
    env = {k: v for k, v in os.environ.items() if k != "OPENDIT_FAMILIES"}  # the built-in families only
    out = subprocess.run([sys.executable, "-m", "opendit.flags_doc"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert (ROOT / "docs" / "flags.md").read_text() == out.stdout, \
        "docs/flags.md is stale: python -m opendit.flags_doc > docs/flags.md"


def test_readme_fits_a_screen_and_links_what_moved():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 160
    for doc in ("training", "sampling", "video", "flux", "flags", "architecture"):
        assert f"docs/{doc}.md" in readme


def test_readme_models_table_is_the_registrys():
    """README's table of models is `python -m opendit.models_doc` for the built-in families: every registered family,
    none that is gone."""
    env = {k: v for k, v in os.environ.items() if k != "OPENDIT_FAMILIES"}  # the built-in families only
    out = subprocess.run([sys.executable, "-m", "opendit.models_doc"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in (ROOT / "README.md").read_text(), \
        "README.md's models table is stale: paste `python -m opendit.models_doc` under ## Models"
