"""The shared options merged with every model family's own into the configs of the entry scripts.

TrainConfig, SampleConfig and PreprocessConfig are dataclasses: the shared options (opendit.shared_options:
TrainOptions, SampleOptions, PreprocessOptions), then each registered family's `train_options`, `sample_options` or
`cache_options` (opendit.families.base.ModelFamily), made when first asked for and again when the registry changes
(a family registered later brings its flags). Every field is an `opendit.options.opt`: its help text, valid values
and range check. `build_parser` derives the argparse flags (help, defaults, choices, sections) from a config,
`from_args` builds one, `save_yaml` / `load_yaml` round-trip it (unknown keys in a yaml are an error naming the key
and the valid ones), and `check_config` refuses values no run can use. Only the entry scripts see flags; the
library takes these configs.
"""
import argparse
import dataclasses
import textwrap
import types
import typing
from pathlib import Path

import torch
import yaml

from opendit.config_files import DECIDED, settings_of  # noqa: F401 (readers of a run's settings use it)
from opendit.data.digits import parse_digits
from opendit.families import FAMILIES, all_models, family_of
from opendit.options import check_value, choices_of, default_of, help_of
from opendit.shared_options import PreprocessOptions, SampleOptions, TrainOptions


def flag_help(f) -> str:
    """A flag's help: its field's text, then each registered family's default of it in words (defaults_help)."""
    found = [fam.defaults_help[f.name] for fam in FAMILIES.values() if f.name in fam.defaults_help]
    return help_of(f) + (f" ({'; '.join(found)})" if found else "")



# ---- the merge ------------------------------------------------------------------------------------------------
_MERGED: dict[tuple, type] = {}
_PARTS = {"TrainConfig": (TrainOptions, "train_options"), "SampleConfig": (SampleOptions, "sample_options"),
          "PreprocessConfig": (PreprocessOptions, "cache_options")}


def _family_fields(part: str) -> tuple[list, dict]:
    """Every registered family's option fields of `part`, merged by name -> ([(name, type, field)], sections).
    A name two families share must have the same type and default; their help texts are joined. Fields are
    grouped by the families that have them, one help section per group ("dit and video family options")."""
    found: dict[str, list] = {}  # name -> [type, field, default, [(family, help)]]
    for family in FAMILIES.values():
        options = getattr(family, part)
        if options is None:
            continue
        hints = typing.get_type_hints(options)
        for f in dataclasses.fields(options):
            default = default_of(f)
            kind, first, first_default, helps = found.setdefault(f.name, [hints[f.name], f, default, []])
            if kind != hints[f.name] or first_default != default:
                raise TypeError(f"option --{f.name} of family {family.name!r} ({hints[f.name]}, default {default!r})"
                                f" differs from another family's ({kind}, default {first_default!r}); rename it")
            helps.append((family.name, help_of(f)))
    groups: dict[tuple, list] = {}  # the families that have a field -> its fields, in order of appearance
    for name, (kind, f, _, helps) in found.items():
        texts = list(dict.fromkeys(h for _, h in helps))
        text = texts[0] if len(texts) == 1 else "; ".join(f"{fam}: {h}" for fam, h in helps)
        new = dataclasses.field(default=f.default, default_factory=f.default_factory, metadata={**f.metadata,
                                                                                                "help": text})
        groups.setdefault(tuple(fam for fam, _ in helps), []).append((name, kind, new))
    fields = [f for group in groups.values() for f in group]
    sections = {group[0][0]: f"{' and '.join(sorted(owners))} family options" for owners, group in groups.items()}
    return fields, sections


def run_family(cfg_or_cls, values: dict):
    """(the run's family, the option that names it, the family options' part) of a train.py or preprocess.py config
    class given its --model / --family values; None where the family is not known when parsing (sample.py without
    --model: the checkpoint tells it; or a name that is not registered: the parser reports that)."""
    cls = cfg_or_cls if isinstance(cfg_or_cls, type) else type(cfg_or_cls)
    if issubclass(cls, (TrainOptions, SampleOptions)) and values.get("model") in all_models():
        part = _PARTS["TrainConfig" if issubclass(cls, TrainOptions) else "SampleConfig"][1]
        return family_of(values["model"]), f"--model {values['model']}", part
    if issubclass(cls, PreprocessOptions) and values.get("family") in FAMILIES:
        return FAMILIES[values["family"]], f"--family {values['family']}", _PARTS["PreprocessConfig"][1]
    return None


def option_owners(part: str) -> dict[str, list[str]]:
    """{family option name: the families whose `part` options have it}."""
    owners: dict[str, list[str]] = {}
    for family in FAMILIES.values():
        options = getattr(family, part)
        for f in dataclasses.fields(options) if options is not None else ():
            owners.setdefault(f.name, []).append(family.name)
    return owners


def foreign_names(family, part: str) -> set[str]:
    """The family options of other families that `family` does not have."""
    return {name for name, families in option_owners(part).items() if family.name not in families}


def foreign_options(cfg, given, run=None) -> str | None:
    """The error for options among `given` (names set on the command line or in a --config file) that belong to
    other model families than the run's, None when there are none. `run`: (family, what names it, options part);
    default run_family's (train.py: --model's; preprocess.py: --family; sample.py: --model's, else the
    checkpoint's, which sample.py asks once it has read it)."""
    run = run or run_family(cfg, dataclasses.asdict(cfg))
    if run is None:
        return None
    family, which, part = run
    foreign = sorted(set(given) & foreign_names(family, part))
    if not foreign:
        return None
    owners = option_owners(part)
    told = "; ".join(f"--{name} is an option of the {' and '.join(owners[name])} family" for name in foreign)
    return (f"{told}, not of the {family.name} family that {which} belongs to; leave "
            f"{'it' if len(foreign) == 1 else 'them'} out (or pick a model of that family)")


def config_class(name: str) -> type:
    """The config dataclass `name` (TrainConfig, SampleConfig, PreprocessConfig) of the registry as it is now."""
    base, part = _PARTS[name]
    key = (name, tuple((f.name, getattr(f, part)) for f in FAMILIES.values()))
    if key not in _MERGED:
        fields, sections = _family_fields(part)
        shared = {f.name for f in dataclasses.fields(base)}
        clash = sorted(shared & {f[0] for f in fields})
        if clash:
            raise TypeError(f"family options {clash} clash with the shared options of {name}; rename them")
        cls = dataclasses.make_dataclass(name, fields, bases=(base,), frozen=True,
                                         namespace={"SECTIONS": {**base.SECTIONS, **sections}, "__module__": __name__})
        _MERGED[key] = cls
    return _MERGED[key]


_FAMILY_CLASSES: dict[tuple, type] = {}


def family_class(family, name: str) -> type:
    """The config class of one family's runs: the shared options of `name` (TrainConfig, SampleConfig,
    PreprocessConfig) and that family's own only, frozen. It subclasses the family's options class when that is a
    frozen dataclass (the built-in ones are), so the family's hooks take `cfg: FluxTrainOptions` and mean it;
    another family's option is not an attribute of it."""
    base, part = _PARTS[name]
    options = getattr(family, part)
    key = (name, family.name, options)
    if key not in _FAMILY_CLASSES:
        own = [] if options is None else dataclasses.fields(options)
        inherit = options is not None and options.__dataclass_params__.frozen
        fields = [] if inherit or options is None else [
            (f.name, typing.get_type_hints(options)[f.name],
             dataclasses.field(default=f.default, default_factory=f.default_factory, metadata=f.metadata))
            for f in own]
        sections = {**base.SECTIONS, **({own[0].name: f"{family.name} family options"} if own else {})}
        title = "".join(word.capitalize() for word in family.name.replace(".", "_").split("_"))
        _FAMILY_CLASSES[key] = dataclasses.make_dataclass(
            f"{title}{name}", fields, bases=(options, base) if inherit else (base,), frozen=True,
            namespace={"SECTIONS": sections, "__module__": __name__})
    return _FAMILY_CLASSES[key]


def for_family(cfg, family=None, which: str | None = None):
    """`cfg` (any config: the merged one the flags make, or one of family_class's) as its family's own config
    (train.py, preprocess.py: the family that --model / --family names; else `family`, e.g. the checkpoint's, named
    by `which` in words). A value other than the default of an option of another family is the one-line refusal of
    foreign_options, as a ValueError."""
    name = next(n for n, (base, _) in _PARTS.items() if isinstance(cfg, base))
    if family is None:
        run = run_family(cfg, {"model": getattr(cfg, "model", None), "family": getattr(cfg, "family", None)})
        if run is None:  # a model that is not registered: the caller's checks name it
            return cfg
        family, which, _ = run
    cls = family_class(family, name)
    if type(cfg) is cls:
        return cfg
    keep = {f.name for f in dataclasses.fields(cls)}
    given = {f.name for f in dataclasses.fields(cfg) if f.name not in keep and getattr(cfg, f.name) != default_of(f)}
    refusal = foreign_options(cfg, given, (family, which, _PARTS[name][1]))
    if refusal:
        raise ValueError(refusal)
    return cls(**{k: getattr(cfg, k) for k in keep})


def __getattr__(name: str):
    if name in _PARTS:
        return config_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- flags ----------------------------------------------------------------------------------------------------
def _str2bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if v.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {v!r}")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the module docstring's layout; appends "(default: X)" where a default is set; never breaks a
    line inside a hyphenated name (DiT-XL/2)."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and action.default not in (None, [], argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One --flag per field, grouped by the class's SECTIONS; bools take an optional value (`--compile` or
    `--compile false`); long lists of choices are shown in the help instead of the usage line."""
    hints, sections, group = typing.get_type_hints(cls), getattr(cls, "SECTIONS", {}), parser
    for f in dataclasses.fields(cls):
        if f.name in sections:
            group = parser.add_argument_group(sections[f.name])
        hint, default = hints[f.name], default_of(f)
        kind = hint
        if typing.get_origin(hint) in (typing.Union, types.UnionType):  # "X | None" -> X
            kind = next(a for a in typing.get_args(hint) if a is not type(None))
        kw = {"default": default, "help": flag_help(f), "dest": f.name}
        choices = choices_of(f)
        if choices:
            kw["choices"] = choices
            if len(choices) > 8:
                kw["metavar"] = "NAME"
                kw["help"] += "; one of: " + ", ".join(choices)
        flags = [f"--{f.name}", *f.metadata.get("aliases", ())]
        if kind is bool:
            group.add_argument(*flags, type=_str2bool, nargs="?", const=True, metavar="BOOL", **kw)
        elif typing.get_origin(kind) is list:
            group.add_argument(*flags, type=typing.get_args(kind)[0], nargs="*", **kw)
        else:
            group.add_argument(*flags, type=kind, **kw)


def build_parser(cls, description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    add_arguments(parser, cls)
    return parser


def from_args(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def run_record(chosen, resolved=None, family=None) -> dict:
    """A run of an entry script as it records itself (train.py: config.yaml, the checkpoint, the EMA export's
    sidecar; sample.py beside its samples; preprocess.py in its cache): the options it was given (the shared ones and
    its model family's own only, so a process that lacks another family's module reads it; `family` where the
    config does not name it, sample.py), then in a `decided` table the values that its data, cache, checkpoint or
    machine settled and that differ from them (a captioned set's 0 classes, a cache's image size, the worker count).
    Without that table the record is the run's options, so the file is always a valid --config (the rerun decides
    the same values again); `settings_of` lays the table over the options for what reads how the run ran."""
    base, part = next(_PARTS[name] for name in _PARTS if isinstance(chosen, _PARTS[name][0]))
    if family is None:
        family = family_of(chosen.model) if isinstance(chosen, TrainOptions) else FAMILIES[chosen.family]
    options = getattr(family, part)
    names = {f.name for f in dataclasses.fields(base)} | \
        ({f.name for f in dataclasses.fields(options)} if options is not None else set())
    record = {k: v for k, v in dataclasses.asdict(chosen).items() if k in names}
    final = dataclasses.asdict(resolved) if resolved is not None else record
    decided = {k: final[k] for k in record if k in final and final[k] != record[k]}
    return {**record, DECIDED: decided} if decided else record


def save_yaml(cfg, path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg) if dataclasses.is_dataclass(cfg) else cfg, sort_keys=False))


def load_yaml(cls, path):
    """A config.yaml as the run it records ran (the values it decided laid over its options: settings_of)."""
    data = settings_of(yaml.safe_load(Path(path).read_text()) or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{path}: unknown config keys {unknown}; valid keys: {sorted(names)}")
    return cls(**data)


def check_config(cfg) -> list[str]:
    """Refuse the flag values no run can use, before anything is built (no process group, folder or model):
    a ValueError "--flag value: what it must be; the fix", which the entry scripts print as one line
    (opendit/cli.py). Returns warnings for values that work but are likely a mistake. Any config class."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    for name in sorted(fields):
        check_value(fields[name], getattr(cfg, name))
    if isinstance(cfg, TrainOptions) and cfg.max_steps == 0 and cfg.epochs < 1:
        raise ValueError(f"--epochs {cfg.epochs}: must be >= 1 when --max_steps is 0; set one of them")
    if isinstance(cfg, TrainOptions) and cfg.digits is not None:
        parse_digits(cfg.digits)
    if isinstance(cfg, SampleOptions) and not cfg.ckpt:
        raise ValueError("--ckpt is required: an EMA .safetensors, a checkpoint folder, an official DiT .pt, "
                         "or latest (the newest checkpoint under --outputs)")
    if isinstance(cfg, PreprocessOptions) and not cfg.out:
        raise ValueError("--out is required: the cache folder to write")
    warnings = []
    if getattr(cfg, "mixed_precision", None) == "fp16" and not torch.cuda.is_available():
        warnings.append("--mixed_precision fp16 without a CUDA GPU runs under CPU autocast, slower than fp32; on a "
                        "CPU use fp32 (or bf16)")
    return warnings
