r'''The rules of prose strings, shared by the parser and the printer.

`"..."` strings use JSON escapes. `"""..."""` blocks are raw text: the rest of
the opening line and the closing line are dropped when blank, and the common
indentation of the non-blank lines is removed.
'''

from __future__ import annotations

import json
import re
from collections.abc import Sequence

_BARE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Characters a `"""` block cannot carry faithfully: they are printed as `"..."`.
_UNSAFE_IN_BLOCK = re.compile(r'"""|\r|[\x00-\x08\x0b-\x1f\x7f]')


def either(words: Sequence[str]) -> str:
    """Alternatives in words, as messages list them: `a`, `a or b`, `a, b or c`."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + f" or {words[-1]}"


def decode_string(token: str) -> str:
    """The value of a `"..."` token; raises ValueError on a bad escape."""
    if "\\" not in token:
        return token[1:-1]  # no escapes: the text between the quotes is the value
    return json.loads(token, strict=False)


def decode_block(token: str) -> str:
    """The value of a `\"\"\"...\"\"\"` token."""
    body = token[3:-3]
    if "\n" not in body:
        return body
    lines = body.split("\n")
    if not lines[0].strip():
        lines = lines[1:]
    if lines and not lines[-1].strip():
        lines = lines[:-1]
    indents = [len(line) - len(line.lstrip(" \t")) for line in lines if line.strip()]
    cut = min(indents, default=0)
    return "\n".join(line[cut:] if line.strip() else "" for line in lines)


def encode_string(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def block_fits(value: str) -> bool:
    """True when `value` prints as a `\"\"\"` block and reads back unchanged."""
    if "\n" not in value or _UNSAFE_IN_BLOCK.search(value):
        return False
    lines = value.split("\n")
    if any(line and not line.strip() for line in lines):
        return False  # whitespace-only lines would be emptied
    return any(line[:1] not in (" ", "\t", "") for line in lines)  # dedent must be a no-op


def encode_text(value: str, indent: str) -> str:
    """Prose as a `\"\"\"` block indented under a statement, or as a `"..."` string."""
    if not block_fits(value):
        return encode_string(value)
    body = "\n".join(indent + "  " + line if line else "" for line in value.split("\n"))
    return f'"""\n{body}\n{indent}  """'


def encode_key(key: str) -> str:
    return key if _BARE_KEY.match(key) and key not in ("true", "false", "null") else encode_string(key)
