"""Plain command lines of `run`, `test` and `resume`, read without typer's coercion.

Typer builds a pydantic adapter for every parameter of the command it runs,
which costs more than running a small machine. A command line made only of
the command's own options with ordinary values is read here, from the typer
declarations of the command itself (so there is no second list of options),
and the command function is called directly. Anything else (`--help`, an
unknown option, a value typer would refuse) returns None and goes through
typer, which gives its usual help and errors.
"""

from __future__ import annotations

import enum
import inspect
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from typer.models import ArgumentInfo, OptionInfo


class _NotPlain(Exception):
    """The command line needs typer."""


def main(args: list[str]) -> int | None:
    """The exit code of `mklang ARGS` when the command line is plain, else None."""
    from mklang.cli import run_cmds

    command: Callable[..., None] = getattr(run_cmds, args[0])
    try:
        values = read(command, args[1:])
    except _NotPlain:
        return None
    try:
        command(**values)
    except typer.Exit as done:
        return done.exit_code
    return 0


def read(command: Callable[..., None], args: list[str]) -> dict[str, Any]:
    """The keyword arguments of `command` for `args`, as typer would pass them."""
    hints = typing.get_type_hints(command)
    values: dict[str, Any] = {}
    positional: list[str] = []
    options: dict[str, tuple[str, Any, bool]] = {}  # flag -> (parameter, type, value of a bool flag)
    for name, parameter in inspect.signature(command).parameters.items():
        info = parameter.default
        values[name] = info.default
        if isinstance(info, ArgumentInfo):
            positional.append(name)
        elif isinstance(info, OptionInfo):
            for declaration in info.param_decls or ():
                on, _, off = declaration.partition("/")
                options[on] = (name, hints[name], True)
                if off:
                    options[off] = (name, hints[name], False)
    words = iter(args)
    for word in words:
        if not word.startswith("-"):
            if not positional:
                raise _NotPlain
            name = positional.pop(0)
            values[name] = _convert(word, hints[name], command, name)
            continue
        flag, has_value, given = word.partition("=")
        if flag not in options:
            raise _NotPlain
        name, hint, switch = options[flag]
        if _base(hint) is bool:
            if has_value:
                raise _NotPlain
            values[name] = switch
            continue
        text = given if has_value else next(words, None)
        if text is None:
            raise _NotPlain
        value = _convert(text, hint, command, name)
        values[name] = [*(values[name] or []), *value] if isinstance(value, list) else value
    if any(value is ... for value in values.values()):
        raise _NotPlain  # a required argument is missing
    return values


def _base(hint: Any) -> Any:
    """`X` of `X | None`."""
    if isinstance(hint, types.UnionType):
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return members[0] if len(members) == 1 else hint
    return hint


def _convert(text: str, hint: Any, command: Callable[..., None], name: str) -> Any:
    base = _base(hint)
    if typing.get_origin(base) is list:
        return [_convert(text, typing.get_args(base)[0], command, name)]
    try:
        if base is Path:
            return Path(text)
        if base is str:
            return text
        if base in (int, float):
            value = base(text)
            limit = inspect.signature(command).parameters[name].default.min
            if limit is not None and value < limit:
                raise _NotPlain
            return value
        if isinstance(base, type) and issubclass(base, enum.Enum):
            return base(text)
    except ValueError:
        raise _NotPlain from None
    raise _NotPlain
