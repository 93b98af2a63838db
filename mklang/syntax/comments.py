"""Attach the comments of a source to the nodes and statements they describe.

An own-line comment belongs to the next statement of its block (a header
line, declaration or state at the top; a statement or gate inside a state),
or to the block's end when nothing follows. A comment at the end of a line
belongs to the statement that starts on that line. Comments inside a
multi-line statement (a context map) move above that statement.
"""

from __future__ import annotations

from collections.abc import Iterable

from mklang.model import FieldComments, Machine, Node, Span
from mklang.syntax.lexemes import Lexeme


class _Slot:
    """A statement that can carry comments: a node, or a field of a node."""

    def __init__(self, owner: Node, key: str | None, span: Span):
        self.owner, self.key, self.span = owner, key, span

    def _field(self, key: str) -> FieldComments:
        return self.owner.field_comments.setdefault(key, FieldComments(before=[], after=None))

    def add_before(self, text: str) -> None:
        (self.owner.comments if self.key is None else self._field(self.key).before).append(text)

    def set_after(self, text: str) -> None:
        if self.key is None:
            self.owner.line_comment = text
        else:
            self._field(self.key).after = text


def _slots(node: Node, children: Iterable[Node]) -> list[_Slot]:
    slots = [_Slot(node, key, span) for key, span in node.field_spans.items()]
    slots += [_Slot(child, None, child.span) for child in children if child.span is not None]
    return sorted(slots, key=lambda slot: (slot.span.line, slot.span.col))


def attach(machine: Machine, found: list[Lexeme]) -> None:
    top = _slots(machine, [*machine.tools, *machine.hooks, *machine.states])
    blocks = {id(state): _slots(state, state.gates) for state in machine.states}
    for comment in found:
        text = comment.text.rstrip()
        state = next(
            (s for s in machine.states if s.span is not None and s.span.line < comment.line <= s.span.end_line), None
        )
        slots, closing = (blocks[id(state)], state) if state is not None else (top, machine)
        if not comment.own_line:
            starting = [slot for slot in slots + top if slot.span.line == comment.line]
            if starting:
                starting[0].set_after(text)
                continue
        following = next((slot for slot in slots if slot.span.end_line >= comment.line), None)
        if following is None:
            closing.trailing_comments.append(text)
        else:
            following.add_before(text)
