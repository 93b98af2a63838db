"""Lark's parse errors, said in words.

One table maps terminal names to words; a few groups of terminals collapse
into one phrase; the word before the mistake names the place ("after
\"->\""); an open block is pointed out when its `}` is what is missing; and
labelled snippets of common mistakes give a tailored sentence when the
parser fails in the same state on the same kind of token.
"""

from __future__ import annotations

import functools

from mklang.errors import Diagnostic, did_you_mean
from mklang.syntax import lexemes
from mklang.syntax._parser import UnexpectedCharacters, UnexpectedInput, UnexpectedToken
from mklang.syntax.text import either
from mklang.vocabulary import HEADER_KEYWORDS, PARSE_MODES, STATE_KEYWORDS, TIERS

WORDS = {
    "NAME": "a name",
    "NUMBER": "a number",
    "STRING": 'a "string"',
    "TRIPLE_STRING": 'a """block"""',
    "_NL": "a line break",
    "$END": "the end of the file",
    "END": "END",
    "TRUE": "true",
    "FALSE": "false",
    "NULL": "null",
    "_ARROW": '"->"',
    "LBRACE": '"{"',
    "RBRACE": '"}"',
    "LBRACKET": '"["',
    "RBRACKET": '"]"',
    "_COLON": '":"',
    "_COMMA": '","',
}
# The other keywords (`MACHINE`, `REPLY_TO`, ...) read as themselves.

# What a NAME stands for, by the word before it.
NAME_AFTER = {
    "->": "a state name",
    "state": "a state name",
    "entry": "a state name",
    "machine": "a machine name",
    "call": "a machine name",
    "tool": "a tool name",
    "hook": "a hook name",
    "output": "an output key",
    "result": "a context key",
    "over": "a context path",
    "reply_to": "a context path",
    "tier": f"a tier ({either(TIERS)})",
    "parse": either(PARSE_MODES),
}

# Sets of terminals that read better as one phrase: when the core set is
# expected, the phrase replaces every member.
# (A keyword's terminal is the keyword in capitals.)
_HEADER = {word.upper() for word in HEADER_KEYWORDS}
_STATEMENT = {word.upper() for word in STATE_KEYWORDS}
GROUPS = (
    ({"MACHINE", "ENTRY", "STATE"}, _HEADER, "a header line (machine, entry, budget, ...) or a state"),
    ({"PROMPT", "OUTPUT", "WHEN"}, _STATEMENT, "a state statement (prompt, output, when, otherwise, ...)"),
    ({"_ARROW", "REPAIR"}, {"_ARROW", "REPAIR", "ESCALATE", "FAIL"}, 'a policy ("->", repair, escalate or fail)'),
    (
        {"STRING", "NUMBER", "LBRACE"},
        {"STRING", "TRIPLE_STRING", "NUMBER", "TRUE", "FALSE", "NULL", "LBRACE", "LBRACKET"},
        "a value",
    ),
)

# Labelled snippets of common mistakes: the parser state and token type where
# each fails map to its sentence.
EXAMPLES = {
    'header and state lines take no ":" (write `entry classify`, `output draft`)': [
        "machine: x\n",
        "entry: x\n",
        "budget: 5\n",
        "tier: fast\n",
        "result: x\n",
        "state a {\n output: x\n}\n",
        'state a {\n prompt: "x"\n}\n',
        'state a {\n structure: "x"\n}\n',
        "state a {\n sample: 3\n}\n",
        "state a {\n over: x\n}\n",
        "state a {\n max_visits: 3\n}\n",
    ],
    'prose goes in quotes: "..." on one line, """...""" for several': [
        "state a {\n prompt Write it\n}\n",
        "state a {\n structure One line\n}\n",
        "state a {\n execution Be brief\n}\n",
    ],
    'a condition is prose in quotes: when "the reply is complete" -> END': [
        "state a {\n when the reply is good -> END\n}\n",
    ],
    "map entries are written `key: value`": ["context { a = 1 }\n", "context {\n a 1\n}\n"],
    'the "{" of a state goes on the same line as its name: state classify {': ["state a\n", "state a\n{\n"],
    'a state\'s statements start on the line after its "{"': ["state a { output x }\n"],
    "repair needs a number of attempts: repair 2 -> target": ["state a {\n otherwise repair -> a\n}\n"],
    'a gate needs a policy before its target: "-> target"': [
        "state a {\n otherwise END\n}\n",
        "state a {\n otherwise a\n}\n",
        'state a {\n when "x" END\n}\n',
    ],
}


def _key(error: UnexpectedInput) -> tuple:
    """Where the parser failed, and on what: the LALR state and the token type or character."""
    state = getattr(error.state, "position", error.state)
    if isinstance(error, UnexpectedToken):
        return state, error.token.type
    return state, error.char


@functools.cache
def _example_index(parse) -> dict[tuple, str]:
    """`_key` -> label: Lark's `match_examples`, but exact on the token type as well as the state."""
    index: dict[tuple, str] = {}
    for label, snippets in EXAMPLES.items():
        for snippet in snippets:
            try:
                parse(snippet)
            except UnexpectedInput as error:
                index.setdefault(_key(error), label)
    return index


def _describe(expected: set[str], previous: str | None) -> str:
    words = []
    rest = set(expected) - {"WS"}
    for core, members, phrase in GROUPS:
        if core <= rest:
            words.append(phrase)
            rest -= members
    if len(rest) + len(words) > 3:
        rest.discard("_NL")  # a line break is rarely the point when much else would do
    for name in sorted(rest, key=lambda n: (n in ("_NL", "$END"), n != "NAME", n)):
        if name == "NAME" and previous in NAME_AFTER:
            words.append(NAME_AFTER[previous])
        else:
            words.append(WORDS.get(name, f'"{name.lower()}"'))
    if not words:
        return "nothing more"
    return either(words)


def _quote(text: str) -> str:
    """A token as the message shows it: quoted once, cut when long."""
    text = text.split("\n")[0]
    text = text if len(text) <= 24 else text[:21] + "..."
    return text if text.startswith('"') else f'"{text}"'


def diagnostic(error: UnexpectedInput, source: str, file: str | None, parse) -> Diagnostic:
    """One diagnostic, in words, for a Lark parse error on `source`."""
    offset = min(error.pos_in_stream or 0, len(source))
    line, col = error.line if error.line > 0 else 1, error.column if error.column > 0 else 1
    previous, opened = lexemes.before(source, offset)
    previous_text = previous.text if previous else None
    where = f"after {_quote(previous.text)}" if previous else "at the start of the file"
    end_col = col + 1
    if isinstance(error, UnexpectedToken) and error.token.type not in ("_NL", "$END"):
        end_col = col + max(1, len(str(error.token).split("\n")[0]))
    label = _example_index(parse).get(_key(error))
    if label:
        message = label
    elif isinstance(error, UnexpectedCharacters):
        char = error.char
        if char == '"':
            block = source.startswith('"""', offset) or source[max(0, offset - 2) : offset] == '""'
            if not source.startswith('"""', offset) and block:
                col -= 2  # point at the opening quotes, not at the third one
            message = (
                'this """ block is never closed'
                if block
                else 'this string is not closed on its line (use """ for several lines)'
            )
        elif char == "'":
            message = 'strings use double quotes: "..."'
        else:
            message = f"expected {_describe(error.allowed or set(), previous_text)} {where}, not {_quote(char)}"
    else:
        token = error.token
        expected = error.accepts or error.expected
        message = f"expected {_describe(expected, previous_text)} {where}"
        hint = ""
        if token.type == "$END":
            message += ", but the file ends"
        elif token.type != "_NL":
            message += f", not {_quote(str(token))}"
            # A misspelled keyword reads as a name: offer the keyword it is closest to.
            keywords = [name.lower() for name in expected if name.isupper() and name not in WORDS]
            hint = did_you_mean(str(token), keywords) if token.type == "NAME" else ""
            message += hint
        if not hint and opened and (token.type == "$END" or {"RBRACE", "RBRACKET"} & set(expected)):
            unclosed = opened[-1]
            message += f' (the "{unclosed.text}" at line {unclosed.line} is still open)'
    return Diagnostic(file, line, col, line, end_col, "error", "syntax", message)
