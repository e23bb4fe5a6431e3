"""README's table of models, written from the registry so that it cannot drift: every registered family, its models,
how its model is built, its sequence parallelism and the weights it loads.

    python -m opendit.models_doc     # the table README.md holds under "## Models"

(tests/test_docs.py checks that README's table is current).
"""
from opendit.families import FAMILIES

HEADER = ["| family | models | model (pipeline) | SP | loads |", "|---|---|---|---|---|"]


def _models(names: list[str]) -> str:
    shown = [f"`{n}`" for n in names if "debug" not in n]
    return ", ".join(shown) if len(shown) <= 4 else f"{shown[0]} ... {shown[-1]} ({len(shown)})"


def models_table() -> str:
    rows = []
    for family in FAMILIES.values():
        kinds = sorted({k for spec in family.models.values() for k in spec.sp_kinds})
        rows.append(f"| {family.title or family.name} | {_models(list(family.models))} | {family.built_from} | "
                    f"{', '.join(kinds) or 'no'} | {family.weight_formats or '-'} |")
    return "\n".join([*HEADER, *rows])


if __name__ == "__main__":
    print(models_table())
