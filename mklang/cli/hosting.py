"""The host options of `run`, `resume`, `batch`, `worker` and `serve`, made from `host.settings`.

Typer reads a command's options from its signature, so options shared by
several commands would be spelled out in each. `hosted(...)` adds the host
options (provider, scripted answers, cassettes, plugins), one per setting a
caller chooses, to a command's signature in place of its `hosting`
parameter, and hands the command one `Hosting` value instead.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import typer

from mklang.host.settings import CHOSEN, Setting, given

Command = TypeVar("Command", bound=Callable[..., None])


def _option(setting: Setting) -> inspect.Parameter:
    """The command-line option of a host setting, as a parameter of a command's signature."""
    kind: Any = list[str] if setting.many else Path if setting.names_file else str
    declared = typer.Option(None, setting.option, metavar=setting.metavar, help=setting.help)
    return inspect.Parameter(
        setting.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=declared, annotation=kind | None
    )


@dataclass(frozen=True)
class Hosting:
    """How the command line asks a run to be hosted: `host.settings.given` of its host options."""

    settings: dict[str, Any] = field(default_factory=given)


def hosted(*left_out: str) -> Callable[[Command], Command]:
    """Give a command the host options but those of the settings `left_out`, passed to it as `hosting: Hosting`."""
    options = [_option(setting) for setting in CHOSEN if setting.name not in left_out]

    def decorate(command: Command) -> Command:
        hints = typing.get_type_hints(command)
        parameters: list[inspect.Parameter] = []
        for parameter in inspect.signature(command).parameters.values():
            if parameter.name == "hosting":
                parameters += options
            else:
                parameters.append(parameter.replace(annotation=hints[parameter.name]))

        @functools.wraps(command)
        def with_hosting(**values: Any) -> None:
            chosen = {option.name: values.pop(option.name) for option in options}
            command(**values, hosting=Hosting(given(**chosen)))

        with_hosting.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        with_hosting.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
        return typing.cast(Command, with_hosting)

    return decorate
