"""Typed options: a dataclass field that carries its flag's help text, its valid values and its range check.

The shared options (opendit.config) and every model family's own (its `train_options`, `sample_options` and
`cache_options` dataclasses) are declared with `opt`, so one declaration gives the default, the `--help` line,
the argparse choices, the check that refuses a bad value before any work starts, and the flag docs.
"""
import dataclasses
import math
import typing
from collections.abc import Callable, Sequence
from dataclasses import field

# Range checks by name: (test, what the value must be; "{a}" becomes "an integer " for integers).
CHECKS: dict[str, tuple[Callable[[float], bool], str]] = {
    "positive": (lambda v: v > 0, "must be {a}> 0"),
    "nonneg": (lambda v: v >= 0, "must be {a}>= 0"),
    "prob": (lambda v: 0 <= v <= 1, "must be a probability in [0, 1]"),
    "fraction": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
}


def opt(default=None, help: str | Callable[[], str] = "", choices: Sequence | Callable[[], Sequence] | None = None,
        factory=None, check: str | None = None, fix: str = "", aliases: tuple[str, ...] = (),
        from_checkpoint: bool = False):
    """A config field.

    help, choices: the text and the valid values, or functions giving them (called when a parser is built:
    registries fill up on import). check: a key of CHECKS, tested by `check_value`; fix: what to do instead,
    added to its error. aliases: more flag spellings (e.g. "--prompt" for --prompts). from_checkpoint (sampling
    options): the value defaults to what the checkpoint was trained with, and a value given replaces it."""
    if check is not None and check not in CHECKS:
        raise ValueError(f"unknown check {check!r}; valid: {', '.join(CHECKS)}")
    meta = {"help": help, "choices": choices, "check": check, "fix": fix, "aliases": tuple(aliases),
            "from_checkpoint": from_checkpoint}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def default_of(f):
    """A field's default value (its factory's product for list fields)."""
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def help_of(f) -> str:
    text = f.metadata.get("help", "")
    return text() if callable(text) else text


def choices_of(f) -> list | None:
    """A field's valid values (None: any)."""
    found = f.metadata.get("choices")
    if found is None:
        return None
    return list(found() if callable(found) else found)


def check_value(f, value) -> None:
    """ValueError "--name value: what it must be; the fix" when a set number breaks the field's check."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return  # None: the default decides; strings are checked by their choices
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"--{f.name} {value}: must be a finite number")
    check = f.metadata.get("check")
    if check is None:
        return
    test, what = CHECKS[check]
    if not test(value):
        fix = f.metadata.get("fix")
        raise ValueError(f"--{f.name} {value}: {what.format(a='an integer ' if isinstance(value, int) else '')}"
                         f"{'; ' + fix if fix else ''}")


def grouped(name: str, *sections: tuple) -> type:
    """One flat options dataclass (cfg.lr, cfg.plugin, ...) of named sections, each (title, option dataclasses...):
    the fields in that order, and SECTIONS {first field: title}, which `--help` and docs/flags.md show. A section
    dataclass used in two (e.g. the speed flags of train.py and sample.py) is declared once. Frozen: a run's settings
    change only into a new object (dataclasses.replace), never under a holder's feet."""
    fields, titles = [], {}
    for title, *parts in sections:
        own = [(f, typing.get_type_hints(part)[f.name]) for part in parts for f in dataclasses.fields(part)]
        titles[own[0][0].name] = title
        fields += [(f.name, hint, field(default=f.default, default_factory=f.default_factory, metadata=f.metadata))
                   for f, hint in own]
    return dataclasses.make_dataclass(name, fields, namespace={"SECTIONS": titles}, frozen=True)
