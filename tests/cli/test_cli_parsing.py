"""Every command line goes through the one typer application, whose values convert without pydantic
(ADR 0035): the conversions keep typer's rules, and `check` and `run` start without importing pydantic."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
from support import ROOT
from support.commands import cli_env
from typer._click.exceptions import BadParameter
from typer.models import ArgumentInfo, OptionInfo

from mklang.cli.coercion import PlainValue, runtime_param
from mklang.cli.run_cmds import OutputFormat

TRIAGE = ROOT / "examples" / "triage"


def convert(annotation: object, value: object, info: OptionInfo | ArgumentInfo | None = None) -> object:
    from typer._coercion import resolve_type_descriptor

    converting = runtime_param(resolve_type_descriptor(annotation, info or OptionInfo()))
    param = SimpleNamespace(multiple=isinstance(value, tuple), nargs=1)  # what `coerce` reads of the option
    return converting.coerce(value, param=param, ctx=None)  # type: ignore[arg-type]


def test_plain_kinds_convert_as_typer_does():
    assert convert(int, "7") == 7
    assert convert(float, "0.5") == 0.5
    assert convert(Path, "a.mk") == Path("a.mk")
    assert convert(list[str], ("a", "b")) == ["a", "b"]
    assert convert(OutputFormat, "json") is OutputFormat.json
    assert convert(int | None, None) is None
    assert convert(bool, True) is True


@pytest.mark.parametrize(
    ("annotation", "value", "info"),
    [
        (int, "abc", OptionInfo()),
        (int, "-1", OptionInfo(min=0)),
        (int, "70000", OptionInfo(max=65535)),
        (OutputFormat, "xml", OptionInfo()),
        (Path, "missing.mk", ArgumentInfo(exists=True)),
    ],
)
def test_a_value_the_declaration_refuses_is_a_bad_parameter(annotation, value, info):
    with pytest.raises(BadParameter):
        convert(annotation, value, info)


def test_other_kinds_keep_typers_conversion():
    from typer._coercion import resolve_type_descriptor

    descriptor = resolve_type_descriptor(datetime, OptionInfo())
    assert not isinstance(runtime_param(descriptor), PlainValue)
    assert convert(datetime, "2026-01-02") == datetime(2026, 1, 2)


@pytest.mark.parametrize(
    "args",
    [
        ["check", str(TRIAGE / "triage.mk")],
        [
            "run",
            str(TRIAGE / "triage.mk"),
            "--script",
            str(TRIAGE / "scenarios.yaml"),
            "--scenario",
            "small-refund-answered-directly",
        ],
    ],
    ids=["check", "run"],
)
def test_check_and_run_start_without_pydantic(args):
    code = (
        "import sys\nfrom mklang.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as done:\n"
        "    sys.stderr.write(f'exit {done.code}, pydantic loaded: {\"pydantic\" in sys.modules}')\n"
    )
    done = subprocess.run([sys.executable, "-c", code, *args], env=cli_env(), capture_output=True, text=True)
    assert done.stderr.endswith("exit 0, pydantic loaded: False"), done.stderr


def test_every_option_of_every_command_converts_without_pydantic():
    import importlib

    from typer.main import get_command

    from mklang.cli import app
    from mklang.cli.coercion import converter

    for module in set(app.COMMAND_MODULES.values()):
        importlib.import_module(f"mklang.cli.{module}")

    def typer_converted(command, path):
        for param in command.params:
            descriptor = param.type_descriptor
            if converter(descriptor.annotation, descriptor.parameter_info) is None:
                yield f"{path} {param.opts[0] if param.opts else param.name}"
        for name, subcommand in getattr(command, "commands", {}).items():
            yield from typer_converted(subcommand, f"{path} {name}")

    assert list(typer_converted(get_command(app.app), "mklang")) == []
