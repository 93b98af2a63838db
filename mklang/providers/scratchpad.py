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


_OPENINGS = ("<reasoning>", "<think>")


def settled(text: str) -> str:
    """The answer so far of a text still arriving: the tagged blocks closed so far removed, and
    cut where a block opens that is not closed yet, or where the text may yet open one."""
    text = _BLOCK.sub("", text)
    cut = min((at for at in (text.find(tag) for tag in _OPENINGS) if at >= 0), default=len(text))
    text = text[:cut]
    start = text.rfind("<")
    if start >= 0 and any(tag.startswith(text[start:]) for tag in _OPENINGS):
        text = text[:start]
    return text
