"""Reading user-supplied data (files, YAML, JSON) within fixed limits (docs/limits.md).

YAML is read through `mklang.yaml_composer`, which checks these limits event by event.

Scenario scripts, configs, machines, `--input`, `--set` values, cassettes,
model answers under `parse json` and checkpoints can all come from someone
else. Each is read through this module, so an alias bomb, a huge file or a
value nested a thousand deep is refused with one line before it can exhaust
memory, the stack or a later resume. The limits are far above what real
machines, scripts and data need.
"""

from __future__ import annotations

import math
import re
from array import array
from collections.abc import Iterable
from itertools import accumulate
from pathlib import Path
from typing import Any

from mklang.errors import UsageError

# Dollars are float sums: ten calls of $0.01 make 0.0999...; this much slack keeps such a sum
# from letting one more call through a $0.10 cap, or a listing from calling it under budget.
COST_SLACK = 1e-9
MAX_FILE_BYTES = 8 * 1024 * 1024  # any one file read as text
MAX_DEPTH = 64  # nesting of JSON and YAML values (lists and maps inside each other)
MAX_CHECKPOINT_DEPTH = 3 * MAX_DEPTH  # a checkpoint nests values inside frames, steps and sub-traces
MAX_YAML_ALIAS_VALUES = 100_000  # YAML values that aliases add, each counted with its own aliases expanded
MAX_YAML_ALIASES = 1_000  # `*name` references in one YAML document


class UnreadableText(Exception):
    """A text file that cannot be used; `reason` says why in a few words."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class NestingError(ValueError):
    """A JSON value nested deeper than the limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"nested more than {limit} levels deep")


def read_bounded(path: str | Path) -> str:
    """The UTF-8 text (a leading byte order mark dropped) of a file of at most
    `MAX_FILE_BYTES`; `UnreadableText` otherwise."""
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)
    except OSError as error:
        raise UnreadableText(error.strerror or type(error).__name__) from None
    if len(raw) > MAX_FILE_BYTES:
        raise UnreadableText(f"larger than {MAX_FILE_BYTES // (1024 * 1024)} MiB")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UnreadableText("not UTF-8 text") from None


def read_text(path: str | Path, what: str) -> str:
    """A user-supplied text file (`what` names it in errors), or one UsageError line."""
    try:
        return read_bounded(path)
    except UnreadableText as error:
        raise UsageError(f"{path}: cannot read the {what}: {error.reason}") from None


# -- JSON ---------------------------------------------------------------------


def load_json(text: str | bytes, max_depth: int = MAX_DEPTH, *, scan: bool = True) -> Any:
    """`json.loads` that refuses values nested deeper than `max_depth` (`NestingError`).

    `scan=False` is for bytes known to come from this user (a verified signature):
    only the decoder's own recursion limit stops them.
    """
    import json

    try:
        value = json.loads(text)
    except RecursionError:
        raise NestingError(max_depth) from None
    if scan and text_depth(text.encode("utf-8") if isinstance(text, str) else text) > max_depth:
        raise NestingError(max_depth)
    return value


def parse_value(raw: str) -> Any:
    """A `--set` value (and an inbox reply): JSON when it parses to JSON, else the text itself.
    Raises NestingError for JSON nested too deep."""
    try:
        value = load_json(raw)
    except NestingError:
        raise
    except ValueError:
        return raw
    if isinstance(value, float) and not math.isfinite(value):  # NaN, Infinity, 1e400: not JSON
        return raw
    return value


def parse_assignments(items: Iterable[str] | None) -> dict[str, Any]:
    """`k.path=value` pairs (`--set`, and the console's fork form); the value is JSON when it parses,
    else text. A malformed pair or a value nested too deep is one UsageError line."""
    from mklang.vocabulary import PATH

    values: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not re.fullmatch(PATH, key):
            raise UsageError(f"--set expects K.PATH=VALUE, got {item!r}")
        try:
            values[key] = parse_value(raw)
        except NestingError as error:
            raise UsageError(f"--set {key}: the value is {error}") from None
    return values


def load_json_object(text: str, where: str, what: str) -> dict[str, Any]:
    """A JSON object given by the user (`what` at `where` names it in errors), or one UsageError line."""
    try:
        data = load_json(text)
    except ValueError as error:
        raise UsageError(f"{where}: {what} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{where}: {what} must hold a JSON object")
    return data


_NOT_STRUCTURE = bytes(byte for byte in range(256) if byte not in b'"[]{}')
_NESTING_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 and -1 as signed bytes


def text_depth(text: bytes) -> int:
    """How deep lists and maps nest in a valid JSON text, the same as `json_depth` of its value.

    Works on the bytes with C-speed passes (a checkpoint can be megabytes):
    escapes and everything but quotes and brackets dropped, then strings,
    then the deepest running count of open brackets.
    """
    skeleton = text.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    outside_strings = b"".join(skeleton.split(b'"')[::2])
    steps = array("b", outside_strings.translate(_NESTING_STEP))
    return max(accumulate(steps), default=0)


def json_depth(value: Any) -> int:
    """How deep lists and maps nest in `value` (a scalar is 0), without recursion."""
    deepest = 0
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        pending.extend((child, depth + 1) for child in children)
    return deepest
