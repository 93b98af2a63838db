"""A light scan of the source into lexemes, aware of strings and comments.

The grammar drops comments; this scan finds them for `fmt`, and gives error
messages the word before a mistake and the blocks still open at it.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable
from dataclasses import dataclass

_LEXEME = re.compile(r'"""[\s\S]*?"""|"(?:[^"\\\n]|\\.)*"|#[^\n]*|->|[A-Za-z_][A-Za-z0-9_.]*|-?[0-9][0-9.eE+-]*|\S')


@dataclass(frozen=True)
class Lexeme:
    text: str
    offset: int
    line: int  # 1-based
    col: int  # 1-based
    own_line: bool  # nothing but indentation before it on its line

    @property
    def is_comment(self) -> bool:
        return self.text.startswith("#")


def scan(source: str) -> list[Lexeme]:
    return scan_at(source, _LEXEME.finditer(source))


_STRING_OR_COMMENT = re.compile(r'"""[\s\S]*?"""|"(?:[^"\\\n]|\\.)*"|#[^\n]*')


def comments(source: str) -> list[Lexeme]:
    """The comments of a source; strings are skipped whole, everything else is not looked at."""
    if "#" not in source:
        return []
    found = [match for match in _STRING_OR_COMMENT.finditer(source) if match.group().startswith("#")]
    return scan_at(source, found)


def scan_at(source: str, matches: Iterable[re.Match[str]]) -> list[Lexeme]:
    starts = [0] + [match.end() for match in re.finditer("\n", source)]
    found = []
    for match in matches:
        line = bisect.bisect_right(starts, match.start())
        line_start = starts[line - 1]
        own_line = not source[line_start : match.start()].strip()
        found.append(Lexeme(match.group(), match.start(), line, match.start() - line_start + 1, own_line))
    return found


def before(source: str, offset: int) -> tuple[Lexeme | None, list[Lexeme]]:
    """The last lexeme before `offset` (comments aside), and the `{`/`[` still open there."""
    previous = None
    opened: list[Lexeme] = []
    for lexeme in scan(source[:offset]):
        if lexeme.is_comment:
            continue
        previous = lexeme
        if lexeme.text in "{[":
            opened.append(lexeme)
        elif lexeme.text in "}]" and opened:
            opened.pop()
    return previous, opened
