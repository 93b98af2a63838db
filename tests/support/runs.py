"""Machines and comparisons shared by the tests of runs."""

from __future__ import annotations

import json
from typing import Any

# Two generative states in a row: a then b then END.
TWO_STATES = """
    machine m
    entry a
    budget 5
    state a {
      structure "s"
      prompt "p"
      output x
      otherwise -> b
    }
    state b {
      structure "s"
      prompt "p"
      output y
      otherwise -> END
    }
"""


def outcome(result: Any, fields: tuple[str, ...] = ("status", "result", "context", "trace", "usage")) -> dict[str, Any]:
    """The comparable, JSON-shaped part of a `RunResult`."""
    data = result.to_json()
    return json.loads(json.dumps({key: data[key] for key in fields}))


# What a resumed run must share with the uninterrupted one.
RESUMED_LIKE = ("status", "error", "at", "result", "context", "trace", "usage")


def compared(result: Any) -> dict[str, Any]:
    """The fields of `result` a resumed run must share with the uninterrupted one."""
    return outcome(result, RESUMED_LIKE)


class InterruptAt:
    """An observer that requests an interrupt at the n-th loop-top it sees."""

    def __init__(self, control: Any, n: int):
        self.control, self.n, self.seen = control, n, 0

    def __call__(self, chain: Any) -> None:
        self.seen += 1
        if self.seen == self.n:
            self.control.interrupted.set()
