"""The package's shape: imports point one way (building blocks -> checkpoint -> families -> config -> lora ->
inference -> training -> plan -> cli -> programs), no import cycle (imports inside functions count), and
opendit/training/ names no family, model, dataset, encoder or sampler: it asks the family."""
import ast
import io
import tokenize
from pathlib import Path

from opendit.families import FAMILIES, all_datasets, all_models, all_samplers

PACKAGE = Path(__file__).resolve().parents[1] / "opendit"

# Low to high. A module may import its own layer's modules and lower layers', never a higher layer's. The top
# is ordered too: sampling below training (whose previews sample), the CLI's error handling above the library (which
# raises, opendit.errors, and never prints), and the modules run as programs (`python -m opendit.X`: every
# __main__, and prior) above everything.
LAYERS = (
    {"models", "booster", "parallel", "optim", "kernels", "diffusion", "data", "encoders", "ema", "distributed",
     "seeding", "options", "config_files", "images", "perf", "console", "errors"},
    {"checkpoint"},
    {"families"},
    {"shared_options", "config", "run_files"},
    {"lora", "eval", "plot", "flags_doc", "models_doc"},
    {"inference"},
    {"training"},
    {"plan"},
    {"cli"},
    {"prior"},
)
ENTRY = len(LAYERS)  # a package's __main__: a program, like the entry scripts


def modules() -> dict[str, Path]:
    """{dotted name: file} of every module of the package (a package is its __init__.py)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict) -> list[tuple[str, int]]:
    """(opendit module, line) of every import in the file, at any depth (inside functions too); `from pkg
    import sub` counts as importing pkg.sub when sub is a module."""
    def owner(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(owner(a.name), node.lineno) for a in node.names if a.name.startswith("opendit")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .adam import AdamW
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if not base.startswith("opendit"):
                continue
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.append((target if target in known else owner(base), node.lineno))
    return [(m, line) for m, line in found if m is not None and m != name]


def layer_of(module: str) -> int:
    if module.endswith(".__main__"):
        return ENTRY
    top = module.split(".")[1] if "." in module else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    return ENTRY  # the package's own __init__ (imports nothing)


def graph() -> dict[str, list[tuple[str, int]]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_module_has_a_layer():
    unplaced = sorted({m.split(".")[1] for m in modules() if "." in m} - set().union(*LAYERS))
    assert not unplaced, f"place {unplaced} in a layer of LAYERS (and in docs/architecture.md's layout)"


def test_no_module_imports_a_higher_layer():
    upward = [f"{name}:{line} imports {target}" for name, edges in graph().items() for target, line in edges
              if layer_of(target) > layer_of(name)]
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_no_import_cycles():
    edges = {name: sorted({t for t, _ in targets}) for name, targets in graph().items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checks_see_imports_inside_functions(tmp_path):
    (tmp_path / "opendit" / "models").mkdir(parents=True)
    (tmp_path / "opendit" / "families").mkdir()
    probe = tmp_path / "opendit" / "models" / "probe.py"
    probe.write_text("def f():\n    from opendit.families import base\n")
    known = {"opendit.models.probe": probe, "opendit.families": None, "opendit.families.base": None}
    assert imports("opendit.models.probe", probe, known) == [("opendit.families.base", 2)]
    assert layer_of("opendit.families.base") > layer_of("opendit.models.probe")
    probe.write_text('def f(enc):\n    return hasattr(enc, "t5") and enc.vae\n')
    assert {"t5", "vae"} <= code_names(probe)


def code_names(path: Path) -> set[str]:
    """The identifiers and the values of plain string literals of a file (prose in docstrings and comments aside)."""
    found = set()
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.NAME:
            found.add(tok.string)
        elif tok.type == tokenize.STRING and not tok.string.lstrip("rbuRBU").startswith(("f", "F")):
            value = ast.literal_eval(tok.string)
            if isinstance(value, str) and len(value) < 40:
                found.add(value)
    return found


def test_training_names_no_family_model_dataset_encoder_or_sampler():
    names = {*FAMILIES, *all_models(), *all_datasets(), *all_samplers(), "t5", "clip", "vae", "umt5"}
    found = {str(p.relative_to(PACKAGE)): sorted(code_names(p) & names) for p in (PACKAGE / "training").glob("*.py")}
    found = {k: v for k, v in found.items() if v}
    assert not found, f"opendit/training/ names {found}; ask the family instead (opendit.families.base)"
