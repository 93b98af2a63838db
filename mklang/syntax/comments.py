"""Attach the comments of a source to the nodes and statements they describe.

An own-line comment belongs to the next statement of its block (a header
line, declaration or state at the top; a statement or gate inside a state),
or to the block's end when nothing follows. A comment at the end of a line
belongs to the statement that starts on that line. Comments inside a
multi-line statement (a context map) move above that statement.
"""

from __future__ import annotations

import bisect
import itertools
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


class _Block:
    """The statements of one block in source order, indexed so that placing a comment
    costs O(log n): a file with a comment per state must not take quadratic time."""

    def __init__(self, node: Node, children: Iterable[Node]):
        slots = [_Slot(node, key, span) for key, span in node.field_spans.items()]
        slots += [_Slot(child, None, child.span) for child in children if child.span is not None]
        self.slots = sorted(slots, key=lambda slot: (slot.span.line, slot.span.col))
        self.by_line: dict[int, _Slot] = {}
        for slot in self.slots:
            self.by_line.setdefault(slot.span.line, slot)
        # The furthest end line so far: the first slot ending at or after a line is found by bisection.
        self.reach = list(itertools.accumulate((slot.span.end_line for slot in self.slots), max))

    def following(self, line: int) -> _Slot | None:
        """The first statement that ends at or after `line`."""
        index = bisect.bisect_left(self.reach, line)
        return self.slots[index] if index < len(self.slots) else None


def attach(machine: Machine, found: list[Lexeme]) -> None:
    top = _Block(machine, [*machine.tools, *machine.hooks, *machine.moved, *machine.states])
    spanned = [state for state in machine.states if state.span is not None]  # in source order
    starts = [state.span.line for state in spanned if state.span is not None]
    blocks = {id(state): _Block(state, state.gates) for state in spanned}
    for comment in found:
        text = comment.text.rstrip()
        index = bisect.bisect_left(starts, comment.line) - 1  # the last state starting before the comment
        state = spanned[index] if index >= 0 else None
        if state is not None and state.span is not None and comment.line > state.span.end_line:
            state = None
        block, closing = (blocks[id(state)], state) if state is not None else (top, machine)
        if not comment.own_line:
            starting = block.by_line.get(comment.line) or top.by_line.get(comment.line)
            if starting is not None:
                starting.set_after(text)
                continue
        following = block.following(comment.line)
        if following is None:
            closing.trailing_comments.append(text)
        else:
            following.add_before(text)
