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

Tool = Callable[..., str]
Hook = Callable[[dict, Any], bool]

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


def _arith(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _arith(node.left), _arith(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_arith(node.operand))
    raise ValueError("only numbers and + - * / // % ** ( ) are allowed")


def calc(input: dict) -> str:
    """Built-in tool: evaluate an arithmetic `expression` without `eval`."""
    expression = str(input.get("expression", ""))
    try:
        value = _arith(ast.parse(expression, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError) as error:
        raise ValueError(f"cannot evaluate {expression!r}: {error}") from None
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


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
        self._entry_points: dict[str, Callable] | None = None

    def _load_entry_points(self) -> dict[str, Callable]:
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


def wants_idempotency_key(tool: Callable) -> bool:
    """Tools that declare an `idempotency_key` parameter receive it (crash-safe runs)."""
    try:
        return "idempotency_key" in inspect.signature(tool).parameters
    except (TypeError, ValueError):
        return False
