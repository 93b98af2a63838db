"""Host tools `(dict) -> str` and hooks `(context, output) -> bool`.

Sources, later ones winning: built-in demo tools, Python entry points
(groups `mklang.tools` and `mklang.hooks`), then what the host passes to
`mklang.run(tools=..., hooks=...)`. Entry points are read only when a name is
first looked up, so start-up does not pay for them.
"""

from __future__ import annotations

import ast
import inspect
import operator
from collections.abc import Callable, Mapping
from typing import Any

from mklang.effects import read_only

Tool = Callable[..., str]

_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


# `calc` limits (docs/limits.md): a model writes the expression, so it must not
# be able to make the host compute or print a number of millions of digits.
CALC_MAX_LENGTH = 1000  # characters of one expression
CALC_MAX_DIGITS = 100  # decimal digits of any operand or result
CALC_MAX_EXPONENT = 64
_CALC_LIMIT = 10**CALC_MAX_DIGITS


def _arith(node: ast.AST) -> float | int:
    """The value of an arithmetic node; every operand and result stays within the limits."""
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return _bounded(node.value, "operand")
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _arith(node.left), _arith(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _bounded(_OPERATORS[type(node.op)](left, right), "result")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_arith(node.operand))
    raise ValueError("only numbers and + - * / // % ** ( ) are allowed")


def _check_power(base: float | int, exponent: float | int) -> None:
    """Refuse a power before computing it when its result would be too large."""
    if abs(exponent) > CALC_MAX_EXPONENT:
        raise ValueError(f"exponent larger than {CALC_MAX_EXPONENT}")
    if (
        isinstance(base, int)
        and abs(base) > 1
        and exponent > 0
        and len(str(abs(base))) * exponent > CALC_MAX_DIGITS + 1
    ):
        raise ValueError(f"result larger than {CALC_MAX_DIGITS} digits")


def _bounded(value: float | int, what: str) -> float | int:
    if isinstance(value, complex):
        raise ValueError(f"{what} is not a real number")
    if not abs(value) < _CALC_LIMIT:  # also refuses inf and nan
        raise ValueError(f"{what} larger than {CALC_MAX_DIGITS} digits")
    return value


@read_only
def calc(input: dict) -> str:
    """Built-in tool: evaluate an arithmetic `expression` without `eval`."""
    expression = str(input.get("expression", ""))
    shown = expression if len(expression) <= 80 else expression[:77] + "..."
    try:
        if len(expression) > CALC_MAX_LENGTH:
            raise ValueError(f"longer than {CALC_MAX_LENGTH} characters")
        value = _arith(ast.parse(expression, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError, MemoryError) as error:
        raise ValueError(f"cannot evaluate {shown!r}: {error}") from None
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


@read_only
def word_count(input: dict) -> str:
    """Built-in tool: count the words of `text`."""
    return str(len(str(input.get("text", "")).split()))


BUILTIN_TOOLS: dict[str, Tool] = {"calc": calc, "word_count": word_count}


class Registry:
    """Named host callables of one kind, looked up lazily."""

    def __init__(
        self, group: str, builtins: Mapping[str, Callable] | None = None, given: Mapping[str, Callable] | None = None
    ):
        self.group = group
        self._builtins = dict(builtins or {})
        self._given = dict(given or {})
        self._entry_points: dict[str, Any] | None = None  # an EntryPoint until first used, then its callable

    def _load_entry_points(self) -> dict[str, Any]:
        if self._entry_points is None:
            from importlib.metadata import entry_points

            self._entry_points = {}
            for point in entry_points(group=self.group):
                self._entry_points[point.name] = point  # loaded on first use
        return self._entry_points

    def get(self, name: str) -> Callable | None:
        if name in self._given:
            return self._given[name]
        points = self._load_entry_points()
        if name in points:
            point = points[name]
            if hasattr(point, "load"):
                points[name] = point.load()
            return points[name]
        return self._builtins.get(name)


HostCallables = Registry | Mapping[str, Callable[..., Any]] | None  # what a host may pass as tools or hooks


def as_registry(group: str, builtins: Mapping[str, Callable[..., Any]] | None, given: HostCallables) -> Registry:
    """`given` itself when it is already a registry, else a registry over it."""
    return given if isinstance(given, Registry) else Registry(group, builtins, given)


def wants_idempotency_key(tool: Callable) -> bool:
    """Tools that declare an `idempotency_key` parameter receive it (crash-safe runs)."""
    try:
        return "idempotency_key" in inspect.signature(tool).parameters
    except (TypeError, ValueError):
        return False
