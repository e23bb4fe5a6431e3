"""The flag reference, docs/flags.md: every flag of train.py, sample.py and preprocess.py with its default and
help, by section, and every --dataset, for the families registered now. Written from the options themselves:

    python -m opendit.flags_doc > docs/flags.md

(tests/test_docs.py checks that the committed file is current).
"""
import dataclasses

from opendit.config import config_class, flag_help
from opendit.config_files import section_tables
from opendit.families import FAMILIES, all_datasets
from opendit.options import choices_of, default_of

SCRIPTS = (("train.py", "TrainConfig"), ("sample.py", "SampleConfig"), ("preprocess.py", "PreprocessConfig"))
TABLE = ["| flag | default | meaning |", "|---|---|---|"]


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("%%", "%").replace("|", "\\|")


def _row(f) -> str:
    default, choices = default_of(f), choices_of(f)
    meaning = "the data (see Datasets below)" if f.name == "dataset" else \
        flag_help(f) + (f" (one of: {', '.join(map(str, choices))})" if choices else "")
    flags = ", ".join(f"`{flag}`" for flag in [f"--{f.name}", *f.metadata.get("aliases", ())])
    shown = "-" if default in (None, []) else f"`{default}`" if default != "" else '`""`'
    return f"| {flags} | {_cell(shown)} | {_cell(meaning)} |"


def flags_markdown() -> str:
    lines = ["# Flags", "", "Every flag of the entry scripts, by section, with its default. Written by "
             "`python -m opendit.flags_doc > docs/flags.md` from the options themselves (a test keeps it current). "
             "A family's own options are listed under it; another family's flag is refused (one error line naming both "
             "families). "
             "`--config FILE` (.toml or .yaml) sets the same options by name, in the tables named below "
             "([training.md](training.md#run-configs-as-files)); flags beside it override the file.",
             ""]
    for script, name in SCRIPTS:
        cls = config_class(name)
        lines += [f"## {script}"]
        tables = section_tables(cls)
        for i, f in enumerate(dataclasses.fields(cls)):
            if i == 0 or f.name in cls.SECTIONS:
                lines += ["", f"### {cls.SECTIONS.get(f.name, 'options')}", "",
                          f"In a `--config` file: `[{tables[f.name]}]` or the top level.", "", *TABLE]
            lines.append(_row(f))
        lines.append("")
    lines += ["## Datasets", "", "| `--dataset` | families | `--data_path` | what it is |", "|---|---|---|---|"]
    for name, spec in all_datasets().items():
        families = ", ".join(f.name for f in FAMILIES.values() if name in f.datasets)
        lines.append(f"| `{name}` | {families} | {_cell(spec.path or 'none: built in')} | {_cell(spec.help)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(flags_markdown(), end="")
