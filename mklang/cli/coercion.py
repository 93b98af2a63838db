"""Command-line values converted without pydantic.

Typer converts every parameter of the command it runs through a pydantic
`TypeAdapter` built on the spot: importing pydantic and building the
adapters costs more than checking a machine or running a small one
(ADR 0035). The options of mklang are all of a few plain kinds (text, path,
whole number, number, flag, choice, or a list of one of these), so each
parameter of those kinds is given a converter of its own here; typer's own
conversion stays for any other kind.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_origin

import typer.core
from typer._click import Context
from typer._click.exceptions import BadParameter
from typer._coercion import RuntimeParam, TypeDescriptor
from typer._coercion import build_runtime_param as typer_runtime_param
from typer._param_types import coerce_cli_choice, coerce_cli_path
from typer.models import ParameterInfo


def flag(value: Any) -> bool:
    """A flag's value is already a bool (typer converts nothing else for a flag)."""
    if not isinstance(value, bool):
        raise ValueError(f"{value!r} is not a flag value")
    return value


def path(value: Any, info: ParameterInfo) -> Any:
    """A path, held to the declaration's checks (exists, readable, ...) as typer does."""
    return coerce_cli_path(Path(value), info, path_type=Path)


PLAIN_KINDS: dict[Any, Callable[[Any], Any]] = {str: str, int: int, float: float, bool: flag}


@dataclass(frozen=True)
class PlainValue(RuntimeParam):
    """Converts one value, or each of a list, by `convert`, then holds it to the parameter's bounds."""

    convert: Callable[[Any], Any]

    def _coerce_value(self, value: Any, param: Any, ctx: Context) -> Any:
        if isinstance(value, list | tuple):
            return [self._one(item, param, ctx) for item in value]
        return self._one(value, param, ctx)

    def _one(self, value: Any, param: Any, ctx: Context) -> Any:
        try:
            converted = self.convert(value)
        except ValueError as error:
            raise BadParameter(str(error), ctx=ctx, param=param) from None
        least, most = self.parameter_info.min, self.parameter_info.max
        if (least is not None and converted < least) or (most is not None and converted > most):
            raise BadParameter(f"{converted} is out of range", ctx=ctx, param=param)
        return converted


def converter(annotation: Any, info: ParameterInfo) -> Callable[[Any], Any] | None:
    """How to convert a value of `annotation` (a list converts its items), or None for a kind not handled here."""
    if info.parser is not None or info.clamp or info.path_type is not None:
        return None
    if get_origin(annotation) is list:
        annotation = get_args(annotation)[0]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        choices = list(annotation)
        return lambda value: coerce_cli_choice(value, choices=choices, case_sensitive=info.case_sensitive)
    if annotation is Path:
        return lambda value: path(value, info)
    return PLAIN_KINDS.get(annotation)


def runtime_param(descriptor: TypeDescriptor) -> RuntimeParam:
    """The converter of a parameter: one of `PlainValue` for the plain kinds, typer's own for the rest."""
    info = descriptor.parameter_info
    convert = converter(descriptor.annotation, info)
    if convert is None:
        return typer_runtime_param(descriptor)
    return PlainValue(parameter_info=info, annotation=descriptor.annotation, convert=convert)


def convert_plainly() -> None:
    """Have typer build its parameters' converters with `runtime_param` (it calls the function by this name
    the first time a parameter converts a value, the help option's included)."""
    typer.core.build_runtime_param = runtime_param
