"""No file of the checkout may shadow an installed package or a standard-library module.

`python benchmarks/x.py` puts benchmarks/ first on `sys.path` (tests/ and the root likewise for their
scripts), so a `benchmarks/kernels.py` once replaced Hugging Face's `kernels` package, which transformers
imports, in every such process.
"""
import importlib
import importlib.metadata
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT_FOLDERS = ("benchmarks", "scripts", "tests")


def _module_names():
    """(path, the name it is imported by when its folder is first on sys.path)."""
    found = [(p, p.stem) for p in ROOT.glob("*.py")]
    found += [(p, p.name) for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    for folder in SCRIPT_FOLDERS:
        for p in (ROOT / folder).rglob("*"):
            if p.suffix == ".py" and p.stem != "__init__":
                found.append((p, p.stem))
            elif p.is_dir() and (p / "__init__.py").exists():
                found.append((p, p.name))
    return found


def test_no_file_shadows_an_installed_package_or_the_standard_library():
    installed = importlib.metadata.packages_distributions()  # top-level name -> distributions
    assert "torch" in installed and "transformers" in installed, "the distribution metadata could not be read"
    clashes = []
    for path, name in _module_names():
        owners = [d for d in installed.get(name, []) if d != "opendit"]
        if owners:
            clashes.append(f"{path.relative_to(ROOT)} shadows the package '{name}' of {sorted(set(owners))}")
        elif name in sys.stdlib_module_names:
            clashes.append(f"{path.relative_to(ROOT)} shadows the standard-library module '{name}'")
    assert not clashes, "rename these files:\n" + "\n".join(clashes)


def test_the_benchmark_folder_is_never_put_on_the_test_path():
    # every test module has been imported by now (collection comes first): none may have added it
    assert str(ROOT / "benchmarks") not in [str(Path(p).resolve()) for p in sys.path if p]
    from benchmarks import bench_common  # importable as a package instead

    assert Path(bench_common.__file__).parent == ROOT / "benchmarks"


def test_transformers_imports_the_real_kernels_package():
    # the import that failed when benchmarks/kernels.py shadowed it (transformers >= 5 imports `kernels` if installed)
    kernels = pytest.importorskip("kernels", reason="Hugging Face's kernels is not installed: nothing to shadow")
    assert ROOT not in Path(kernels.__file__).resolve().parents, kernels.__file__
    importlib.import_module("transformers.integrations.hub_kernels")
