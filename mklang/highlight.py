"""Syntax highlighting of `.mk` source: a Pygments lexer and a rich renderable.

`MkLexer` is registered under the `pygments.lexers` entry point, so
`pygmentize -l mk`, Sphinx, MkDocs and rich find it by name. It follows SPEC
section 2 token by token and the TextMate grammar
`grammar/mklang.tmLanguage.json` uses the same categories; a valid machine
never yields an error token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from pygments.lexer import RegexLexer, bygroups, include, words
from pygments.token import (
    Comment,
    Error,
    Keyword,
    Name,
    Number,
    Operator,
    Punctuation,
    String,
    Whitespace,
)

from mklang import vocabulary

if TYPE_CHECKING:
    from rich.syntax import Syntax

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
PATH = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*"

KEYWORDS = tuple(word for word in vocabulary.KEYWORDS if word not in vocabulary.POLICY_KEYWORDS)
CONSTANTS = (*vocabulary.TIERS, *vocabulary.PARSE_MODES, *vocabulary.LITERALS)


class MkLexer(RegexLexer):
    """Lexer for mklang `.mk` machines."""

    name = "mklang"
    aliases: ClassVar[list[str]] = ["mk", "mklang"]
    filenames: ClassVar[list[str]] = [f"*{vocabulary.MK_SUFFIX}"]
    mimetypes: ClassVar[list[str]] = ["text/x-mklang"]
    url = "https://github.com/mklang/mklang"

    tokens: ClassVar[dict[str, list]] = {
        "root": [
            (r"[ \t\f]+", Whitespace),
            (r"\r?\n", Whitespace),
            (r"#.*$", Comment.Single),
            (r'"""', String.Double, "block"),
            (r'"', String.Double, "string"),
            (r"(->)([ \t]*)(END)\b", bygroups(Operator, Whitespace, Keyword.Constant)),
            (rf"(->)([ \t]*)({IDENT})\b", bygroups(Operator, Whitespace, Name.Class)),
            (r"->", Operator),
            # A name declared or referenced by a keyword gets the category of what it names.
            (rf"\b(state|entry)(\s+)({IDENT})\b", bygroups(Keyword.Declaration, Whitespace, Name.Class)),
            (rf"\b(machine|call)(\s+)({IDENT})\b", bygroups(Keyword.Declaration, Whitespace, Name.Namespace)),
            (rf"\b(tool|hook)(\s+)({IDENT})\b", bygroups(Keyword.Declaration, Whitespace, Name.Function)),
            (words(vocabulary.POLICY_KEYWORDS, suffix=r"\b"), Keyword.Reserved),
            (words(KEYWORDS, suffix=r"\b"), Keyword),
            (words(CONSTANTS, prefix=r"\b", suffix=r"\b"), Keyword.Constant),
            (r"\bEND\b", Keyword.Constant),
            (r"\b[0-9]+[smhd]\b", Number),  # a decision's deadline: `within 48h`
            (r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\b", Number),
            (PATH, Name.Variable),
            (r"[{}\[\]:,]", Punctuation),
        ],
        "interpolation": [
            (vocabulary.PLACEHOLDER.pattern, String.Interpol),
        ],
        "string": [
            (r'"', String.Double, "#pop"),
            (r"\n", Error, "#pop"),  # a one-line string left open
            (r'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})', String.Escape),
            include("interpolation"),
            (r'[^"\\{\n]+', String.Double),
            (r"\{", String.Double),
            (r"\\", String.Double),
        ],
        "block": [
            (r'"""', String.Double, "#pop"),
            include("interpolation"),
            (r'[^"{]+', String.Double),
            (r'["{]', String.Double),
        ],
    }


def highlight_source(text: str, *, line_numbers: bool = False, start_line: int = 1) -> Syntax:
    """`.mk` source as a rich renderable, for CLI views that show machine text."""
    from rich.syntax import Syntax

    return Syntax(text, MkLexer(), line_numbers=line_numbers, start_line=start_line, theme="ansi_dark", word_wrap=False)
