"""Reasoning for models without a native reasoning channel: ask for it in tags, then split it off.

The same splitter also lifts `<think>...</think>` blocks that some
OpenAI-compatible servers leave inside the answer text.
"""

from __future__ import annotations

import re

INSTRUCTION = (
    "Think before you answer. Write your private reasoning between <reasoning> and </reasoning>, "
    "then write only the final answer after </reasoning>. Only the text after </reasoning> is used."
)

_BLOCK = re.compile(r"<(reasoning|think)>(.*?)</\1>", re.DOTALL)


def with_instruction(system: str) -> str:
    """The system message extended with the scratchpad request."""
    return f"{system}\n\n{INSTRUCTION}" if system else INSTRUCTION


def split(text: str) -> tuple[str, str | None]:
    """Split `text` into (answer, reasoning); reasoning is None when there was no tagged block."""
    blocks = [match.group(2).strip() for match in _BLOCK.finditer(text)]
    if not blocks:
        return text.strip(), None
    return _BLOCK.sub("", text).strip(), "\n\n".join(blocks)
