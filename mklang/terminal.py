"""Text safe for a terminal (docs/limits.md, "Terminal output").

Used wherever text that a model, a tool, a server, a checkpoint or a machine
file supplied is printed for people: the CLI's results and errors and the
diagnostics' source lines. JSON output never goes through it.
"""

from __future__ import annotations

import re

# C0 and C1 controls but tab and newline, plus the bidirectional overrides that
# reorder what a reader sees: model answers, server messages and checkpoint
# fields may hold any of them, and a terminal would obey an ESC sequence.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` safe for a terminal: each control character is shown as its escape (`\\x1b`)."""
    return _CONTROL.sub(lambda match: match.group().encode("unicode_escape").decode("ascii"), text)
