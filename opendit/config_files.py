"""Run configs as files: `train.py --config run.toml` (or .yaml), also sample.py and preprocess.py.

A file sets the same options as the flags, by their names without the dashes, at its top level or in a table
named after the option's section in `--help` (`[optimizer]`, `[schedule]`, `[model_and_data]`; a model family's
own options in `[family]`). Flags given on the command line override the file. The `config.yaml` a run writes
is such a file: `train.py --config outputs/000-DiT-Ti-4/config.yaml` runs it again (its `decided` table, the
values the run's data and machine settled, is read by sample.py and skipped here: the rerun decides them again).

Every value is checked before anything is built: an unknown name is an error naming the file, the key and the
nearest valid name; a value of the wrong type names the key and the type it must have; a value outside an
option's choices lists them; a file that does not parse names the file and the line.
"""
import dataclasses
import difflib
import re
import tomllib
import types
import typing
from pathlib import Path

import yaml

from opendit.options import choices_of

FAMILY_TABLE = "family"
DECIDED = "decided"  # a run's config.yaml: what its data and machine decided (config.run_record), not options


def settings_of(record: dict) -> dict:
    """A run's recorded settings as it ran: its options with the values it decided (config.run_record) laid over;
    a ValueError when the record (or its decided table) is not a table."""
    decided = record.get(DECIDED) or {} if isinstance(record, dict) else None
    if not isinstance(decided, dict):
        raise ValueError(f"not a table of options (name: value, and a {DECIDED} table)")
    return {**{k: v for k, v in record.items() if k != DECIDED}, **decided}


def read_file(path) -> dict:
    """A .toml, .yaml or .yml file as a dict; a ValueError naming the file (and the line) when it cannot be."""
    path = Path(path)
    if path.suffix not in (".toml", ".yaml", ".yml"):
        raise ValueError(f"{path}: a config file is .toml, .yaml or .yml")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such config file") from None
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: not valid TOML: {e}") from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ValueError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a table of options (name = value), not a {type(data).__name__}")
    return data


def section_tables(cls) -> dict[str, str]:
    """Each option name of the config class `cls` -> the table it may sit in: the slug of its `--help` section
    ("model and data" -> model_and_data), or `family` for a model family's own options."""
    tables, table = {}, None
    for f in dataclasses.fields(cls):
        title = cls.SECTIONS.get(f.name)
        if title is not None:
            table = FAMILY_TABLE if title.endswith("family options") else table_name(title)
        tables[f.name] = table or "options"
    return tables


def table_name(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", re.sub(r"\(.*?\)", "", title.lower())).strip("_")


def nearest(name: str, names) -> str:
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def type_name(hint) -> str:
    return getattr(hint, "__name__", None) if typing.get_origin(hint) is None else str(hint).replace("typing.", "")


def fits(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(fits(v, item) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def _checked(f, hint, value, where: str):
    if hint in (float, float | None) and isinstance(value, str):  # YAML reads 1e-4 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if not fits(value, hint):
        raise ValueError(f"{where}: {value!r} is a {type(value).__name__}; {f.name} must be of type {type_name(hint)}")
    choices = choices_of(f)
    if choices and value is not None:
        for v in value if isinstance(value, list) else [value]:
            if v not in choices:
                raise ValueError(f"{where}: {v!r} is not one of: {', '.join(map(str, choices))}")
    return float(value) if hint in (float, float | None) and isinstance(value, int) else value


def config_values(cls, path) -> dict:
    """The option values a config file sets for the config class `cls` (TrainConfig, SampleConfig,
    PreprocessConfig), checked against its fields: {option name: value}."""
    data, fields = read_file(path), {f.name: f for f in dataclasses.fields(cls)}
    hints, tables = typing.get_type_hints(cls), section_tables(cls)
    values = {}

    def take(key, value, table):
        where = f"{path}: {f'[{table}] ' if table else ''}{key}"
        if key not in fields:
            raise ValueError(f"{where}: no such option{nearest(key, fields)} (options: {cls.__name__}'s flags "
                             "without the dashes, see --help)")
        if table is not None and tables[key] != table:
            raise ValueError(f"{where}: {key} belongs in [{tables[key]}] (or at the top level)")
        if key in values:
            raise ValueError(f"{where}: set twice in the file")
        values[key] = _checked(fields[key], hints[key], value, where)

    for key, value in data.items():
        if key == DECIDED:  # a rerun decides these again
            continue
        if isinstance(value, dict):
            if key not in set(tables.values()):
                raise ValueError(f"{path}: [{key}]: no such table{nearest(key, set(tables.values()))} (tables: "
                                 f"{', '.join(dict.fromkeys(tables.values()))})")
            for inner, v in value.items():
                take(inner, v, key)
        else:
            take(key, value, None)
    return values
