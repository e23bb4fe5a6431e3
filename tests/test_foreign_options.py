"""An option of another model family is refused in one line, for every registered family (train.py: --model's
family; preprocess.py: --family), on the command line and in a --config file; the family's own options and the
shared ones pass, and so does a config file that leaves other families' options at their defaults; `--help` with
--model lists that family's options only."""
import dataclasses
import re

import pytest

from opendit import config as cfglib
from opendit.cli import parse_config
from opendit.families import FAMILIES
from opendit.options import default_of

BUILT_IN = sorted(name for name, family in FAMILIES.items() if type(family).__module__.startswith("opendit."))


def _debug_model(family) -> str:
    return next((m for m in family.models if "debug" in m.lower()), next(iter(family.models)))


def _foreign(family, part: str):
    """An option of another family's `part` that this family lacks, with a default to pass as its value."""
    own = {f.name for f in dataclasses.fields(getattr(family, part))} if getattr(family, part) else set()
    for other in FAMILIES.values():
        options = getattr(other, part)
        for f in dataclasses.fields(options) if options is not None else ():
            default = default_of(f)
            if f.name not in own and default is not None and not isinstance(default, (list, bool)):
                return f.name, str(default), other.name
    return None


def _refusal(capsys, cls, argv) -> str:
    with pytest.raises(SystemExit) as stop:
        parse_config(cls, None, argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("name", BUILT_IN)
def test_another_familys_train_option_is_refused(name, capsys, tmp_path):
    family = FAMILIES[name]
    found = _foreign(family, "train_options")
    if found is None:
        pytest.skip(f"no other family has a train option {name} lacks")
    option, value, owner = found
    model = _debug_model(family)
    line = _refusal(capsys, cfglib.TrainConfig, ["--model", model, f"--{option}", value])
    assert f"--{option} is an option of the" in line and owner in line and f"--model {model}" in line
    config = tmp_path / "run.toml"
    default = default_of(next(f for f in dataclasses.fields(cfglib.TrainConfig) if f.name == option))
    literal = repr(value) if isinstance(default, str) else value
    config.write_text(f'model = "{model}"\n{option} = {literal}\n')
    parse_config(cfglib.TrainConfig, None, ["--config", str(config)])  # left at its default: not a choice
    if isinstance(default, (int, float)):  # another valid value: a choice the file makes
        chosen = default / 2 if isinstance(default, float) and default else default + 1
        config.write_text(f'model = "{model}"\n{option} = {chosen}\n')
        assert f"--{option} is an option of the" in _refusal(capsys, cfglib.TrainConfig, ["--config", str(config)])


@pytest.mark.parametrize("name", BUILT_IN)
def test_the_familys_own_and_shared_train_options_pass(name):
    family = FAMILIES[name]
    own = family.train_options
    argv = ["--model", _debug_model(family), "--lr", "1e-3"]
    for f in dataclasses.fields(own) if own is not None else ():
        default = default_of(f)
        if default is not None and not isinstance(default, (list, bool)):
            argv += [f"--{f.name}", str(default)]
    parse_config(cfglib.TrainConfig, None, argv)


@pytest.mark.parametrize("name", BUILT_IN)
def test_another_familys_cache_option_is_refused_by_preprocess(name, capsys):
    found = _foreign(FAMILIES[name], "cache_options")
    if found is None:
        pytest.skip(f"no other family has a cache option {name} lacks")
    option, value, owner = found
    line = _refusal(capsys, cfglib.PreprocessConfig, ["--family", name, "--out", "x", f"--{option}", value])
    assert f"--{option} is an option of the" in line and f"--family {name}" in line


@pytest.mark.parametrize("name", BUILT_IN)
def test_help_with_a_model_shows_its_familys_options_only(name, capsys):
    family = FAMILIES[name]
    with pytest.raises(SystemExit):
        parse_config(cfglib.TrainConfig, None, ["--model", _debug_model(family), "--help"])
    out = capsys.readouterr().out
    own = [f.name for f in dataclasses.fields(family.train_options)] if family.train_options else []
    assert all(_flag_in(out, option) for option in own) and _flag_in(out, "lr") and _flag_in(out, "image_key")
    assert not [option for option in cfglib.foreign_names(family, "train_options") if _flag_in(out, option)]
    with pytest.raises(SystemExit):
        parse_config(cfglib.TrainConfig, None, ["--help"])  # without --model: every family's options
    everything = capsys.readouterr().out
    assert all(_flag_in(everything, option) for option in cfglib.option_owners("train_options"))


def _flag_in(help_text: str, option: str) -> bool:
    """Whether --help lists the flag (a line of its own, not a mention in another flag's text)."""
    return re.search(rf"^  --{re.escape(option)}[ ,\n]", help_text, re.M) is not None


@pytest.mark.parametrize("name", BUILT_IN)
def test_sample_py_refuses_another_familys_option_and_helps_with_its_own(name, capsys):
    family, found = FAMILIES[name], _foreign(FAMILIES[name], "sample_options")
    model = _debug_model(family)
    if found is not None:
        option, value, owner = found
        line = _refusal(capsys, cfglib.SampleConfig, ["--model", model, "--ckpt", "x", f"--{option}", value])
        assert f"--{option} is an option of the" in line and owner in line and f"--model {model}" in line
    with pytest.raises(SystemExit):
        parse_config(cfglib.SampleConfig, None, ["--model", model, "--help"])
    out = capsys.readouterr().out
    own = [f.name for f in dataclasses.fields(family.sample_options)] if family.sample_options else []
    assert all(_flag_in(out, option) for option in own) and _flag_in(out, "cfg_scale")
    assert not [option for option in cfglib.foreign_names(family, "sample_options") if _flag_in(out, option)]


def test_sample_py_without_model_refuses_another_familys_option_once_the_checkpoint_tells_the_family(tmp_path):
    from opendit.distributed import cleanup
    from opendit.inference import sample_to_folder
    from tests.test_train import run_trainer, tiny_cfg

    run_trainer(tiny_cfg(tmp_path, max_steps=1, ckpt_every=1))
    cfg = cfglib.SampleConfig(ckpt="latest", outputs=str(tmp_path), guidance=5.0, out=str(tmp_path / "s"))
    with pytest.raises(SystemExit, match=r"sample.py: --guidance is an option of the flux family, not of the dit "
                                         r"family that the checkpoint's model DiT-debug belongs to"):
        try:
            sample_to_folder(cfg)
        finally:
            cleanup()  # the process group sample.py's exit would end
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("name", BUILT_IN)
def test_a_runs_config_is_its_familys_own_frozen_class(name):
    family = FAMILIES[name]
    for part, cfg, which in (("train_options", cfglib.TrainConfig(model=_debug_model(family)), None),
                             ("sample_options", cfglib.SampleConfig(ckpt="x"), "the checkpoint's model"),
                             ("cache_options", cfglib.PreprocessConfig(family=name, out="x"), None)):
        typed = cfglib.for_family(cfg, family if which else None, which)
        options = getattr(family, part)
        assert options is None or isinstance(typed, options), part  # what the family's hooks annotate
        assert not [n for n in cfglib.foreign_names(family, part) if hasattr(typed, n)], part
        assert dataclasses.asdict(typed).items() <= dataclasses.asdict(cfg).items()  # the same values, its own
        with pytest.raises(dataclasses.FrozenInstanceError):
            typed.out = "elsewhere"


def test_the_trainer_refuses_another_familys_option_set_in_code():
    from opendit.training.loop import Trainer

    with pytest.raises(ValueError, match=r"--umt5 is an option of the wan family, not of the dit family that "
                                         r"--model DiT-debug belongs to"):
        Trainer(cfglib.TrainConfig(model="DiT-debug", umt5="umt5-folder"))


def test_a_family_whose_options_class_is_not_frozen_still_gets_a_frozen_config_of_its_own():
    from types import SimpleNamespace

    from opendit.options import opt

    @dataclasses.dataclass
    class Loose:  # a family from outside that did not declare frozen=True
        width: int = opt(16, "a width")

    family = SimpleNamespace(name="loose", train_options=Loose)
    typed = cfglib.family_class(family, "TrainConfig")(model="DiT-debug", width=8)
    assert typed.width == 8 and not hasattr(typed, "t5") and not isinstance(typed, Loose)
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.width = 4
