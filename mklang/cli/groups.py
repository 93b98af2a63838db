"""Options shared by several commands, declared once (`hosting.hosted`, `run_cmds.reported`).

Typer reads a command's options from its signature, so options shared by
several commands would be spelled out in each. `grouped(...)` puts a group's
options in a command's signature in place of one of its parameters, and
hands the command one value made of them instead.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

Command = TypeVar("Command", bound=Callable[..., None])


def option(name: str, kind: Any, declared: Any) -> inspect.Parameter:
    """An option of a group: its parameter name, type and typer declaration."""
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=declared, annotation=kind)


def grouped(
    parameter: str, options: Sequence[inspect.Parameter], make: Callable[..., Any]
) -> Callable[[Command], Command]:
    """Give a command `options` in place of its `parameter`, passed to it as `make(**their values)`."""

    def decorate(command: Command) -> Command:
        hints = typing.get_type_hints(command)
        parameters: list[inspect.Parameter] = []
        for each in inspect.signature(command).parameters.values():
            if each.name == parameter:
                parameters += options
            else:
                parameters.append(each.replace(annotation=hints[each.name]))

        @functools.wraps(command)
        def with_group(**values: Any) -> None:
            chosen = {option.name: values.pop(option.name) for option in options}
            command(**values, **{parameter: make(**chosen)})

        with_group.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        with_group.__annotations__ = {each.name: each.annotation for each in parameters}
        return typing.cast(Command, with_group)

    return decorate
