"""`{{path}}` interpolation, context paths and untrusted-data fencing (SPEC section 4).

Taint is tracked per top-level context key: a placeholder is tainted when the
first segment of its path names a tainted key.
"""

from __future__ import annotations

import json
import secrets
from functools import lru_cache
from typing import Any

from mklang.vocabulary import PLACEHOLDER, lookup


def assign(context: dict[str, Any], path: str, value: Any, *, copy_maps: bool = False) -> None:
    """Write `value` at a dotted path, creating maps on the way.

    With `copy_maps`, each map on the way is replaced by a shallow copy before
    it is written into, so maps shared with another context stay as they were.
    """
    if "." not in path:
        context[path] = value
        return
    parts = path.split(".")
    target = context
    for part in parts[:-1]:
        child = target.get(part)
        if not isinstance(child, dict):
            child = {}
        elif copy_maps:
            child = dict(child)
        target[part] = child
        target = child
    target[parts[-1]] = value


def render_value(value: Any) -> str:
    """Lists render as numbered lines, maps as JSON, scalars as text."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(f"{i}. {render_value(item)}" for i, item in enumerate(value, 1))
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return json.dumps(value)


class Scope:
    """What a template can read: the context, its tainted keys, and branch locals.

    Branch locals (`index`, `item`) shadow context keys of the same name.
    """

    __slots__ = ("context", "locals", "tainted", "tainted_locals")

    def __init__(
        self,
        context: dict[str, Any],
        tainted: set[str] | frozenset[str],
        locals_: dict[str, Any] | None = None,
        tainted_locals: frozenset[str] = frozenset(),
    ):
        self.context = context
        self.tainted = tainted
        self.locals = locals_ or {}
        self.tainted_locals = tainted_locals

    def read(self, path: str) -> tuple[Any, bool]:
        """The value at `path` and whether it is tainted, in one lookup."""
        head, _, rest = path.partition(".")
        if head in self.locals:
            value = self.locals[head]
            return (lookup(value, rest) if rest else value), head in self.tainted_locals
        value = lookup(self.context, path) if rest else self.context.get(head)
        return value, head in self.tainted

    def get(self, path: str) -> Any:
        return self.read(path)[0]

    def is_tainted(self, path: str) -> bool:
        return self.read(path)[1]


@lru_cache(maxsize=4096)
def compile_template(template: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Split a template once into literal text and placeholder paths.

    Returns (literals, paths) with len(literals) == len(paths) + 1.
    """
    parts = PLACEHOLDER.split(template)
    return tuple(parts[0::2]), tuple(parts[1::2])


def render(template: str, scope: Scope) -> str:
    """Render a template to text, tainted or not (tool and call inputs)."""
    literals, paths = compile_template(template)
    if not paths:
        return template
    out = [literals[0]]
    for path, literal in zip(paths, literals[1:], strict=False):
        out.append(render_value(scope.get(path)))
        out.append(literal)
    return "".join(out)


def uses_taint(template: str, scope: Scope) -> bool:
    return any(scope.is_tainted(path) for path in compile_template(template)[1])


def resolve_input(value: Any, scope: Scope) -> Any:
    """Resolve an `input` map: a lone placeholder passes the raw value through."""
    if isinstance(value, str):
        match = PLACEHOLDER.fullmatch(value.strip())
        if match:
            return scope.get(match.group(1))
        return render(value, scope)
    if isinstance(value, dict):
        return {key: resolve_input(item, scope) for key, item in value.items()}
    if isinstance(value, list):
        return [resolve_input(item, scope) for item in value]
    return value


def input_taint(value: Any, scope: Scope) -> bool:
    """An input value is tainted iff it interpolates a tainted value."""
    if isinstance(value, str):
        return uses_taint(value, scope)
    if isinstance(value, dict):
        return any(input_taint(item, scope) for item in value.values())
    if isinstance(value, list):
        return any(input_taint(item, scope) for item in value)
    return False


def render_prompt(template: str, scope: Scope) -> tuple[str, bool]:
    """Render a produce prompt, fencing tainted values; returns (text, fenced?).

    The nonce is fresh per call and re-rolled while it occurs in any fenced
    value, so data can never close its own fence.
    """
    literals, paths = compile_template(template)
    if not paths:
        return template, False
    values = []
    for path in paths:
        value, tainted = scope.read(path)
        values.append((render_value(value), tainted))
    nonce = None
    if any(tainted for _, tainted in values):
        nonce = secrets.token_hex(6)
        while any(tainted and nonce in text for text, tainted in values):
            nonce = secrets.token_hex(6)
    out = [literals[0]]
    for (text, tainted), literal in zip(values, literals[1:], strict=False):
        out.append(f"<data-{nonce}>\n{text}\n</data-{nonce}>" if tainted else text)
        out.append(literal)
    return "".join(out), nonce is not None
