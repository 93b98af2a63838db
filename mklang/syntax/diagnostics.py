"""The one renderer of diagnostics as text: `file:line:col: severity: message [code]`,
then the source line and a caret under the span.

Diagnostics hold data only; the same records feed `--format json`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO

from mklang.errors import Diagnostic
from mklang.terminal import printable

_COLORS = {"error": "\x1b[1;31m", "warning": "\x1b[1;33m", "caret": "\x1b[1;36m", "reset": "\x1b[0m"}


def color_allowed() -> bool:
    """No colour (nor bold) anywhere when NO_COLOR is set (https://no-color.org)."""
    return not os.environ.get("NO_COLOR")


def wants_color(stream: TextIO) -> bool:
    """Colour only on a terminal, and only when allowed."""
    return stream.isatty() and color_allowed()


def _source_line(file: str | None, line: int, cache: dict) -> str | None:
    if file is None:
        return None
    if file not in cache:
        try:
            cache[file] = Path(file).read_text(encoding="utf-8-sig").splitlines()
        except (OSError, UnicodeDecodeError):
            cache[file] = []
    lines = cache[file]
    return lines[line - 1] if 0 < line <= len(lines) else None


def render_one(diagnostic: Diagnostic, source_line: str | None, color: bool = False) -> str:
    """One diagnostic with its caret view (when the source line is known)."""
    paint = (lambda key, text: f"{_COLORS[key]}{text}{_COLORS['reset']}") if color else (lambda _key, text: text)
    where = f"{diagnostic.file or '<text>'}:{diagnostic.line}:{diagnostic.col}"
    message = printable(diagnostic.message)
    head = f"{printable(where)}: {paint(diagnostic.severity, diagnostic.severity)}: {message} [{diagnostic.code}]"
    if source_line is None:
        return head
    line = source_line.replace("\t", " ")
    start = max(diagnostic.col - 1, 0)
    end = diagnostic.end_col - 1 if diagnostic.end_line == diagnostic.line else len(line.rstrip())
    width = max(1, min(end, len(line) + 1) - start)
    # Control characters show as escapes (a machine file may come from anyone); the caret follows them.
    shown = printable(line)
    start, width = _shown_width(line, start), _shown_width(line, start + width) - _shown_width(line, start)
    gutter = " " * len(str(diagnostic.line))
    return "\n".join(
        [
            head,
            f" {diagnostic.line} | {shown}",
            f" {gutter} | {' ' * start}{paint('caret', '^' * width)}",
        ]
    )


def _shown_width(line: str, columns: int) -> int:
    """How wide the first `columns` characters of `line` print once escaped (past its end: one each)."""
    return len(printable(line[:columns])) + max(0, columns - len(line))


def render_text(diagnostics: list[Diagnostic], color: bool = False) -> str:
    """All diagnostics, each with its source line read from its file."""
    cache: dict[str, list[str]] = {}
    return "\n".join(render_one(d, _source_line(d.file, d.line, cache), color) for d in diagnostics)


def summary(diagnostics: list[Diagnostic], files: int) -> str:
    errors = sum(d.severity == "error" for d in diagnostics)
    warnings = len(diagnostics) - errors
    plural = lambda n, word: f"{n} {word}{'' if n == 1 else 's'}"  # noqa: E731
    return f"{plural(errors, 'error')}, {plural(warnings, 'warning')} in {plural(files, 'file')}"
