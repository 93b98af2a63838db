"""How a run level stops early: halts, suspensions and hard interrupts."""

from __future__ import annotations

from mklang.engine.frame import Frame
from mklang.providers.base import Usage


class Halt(Exception):
    """The run stops for good: `error` is the halt kind (with detail), `at` the state.

    `usage` is what the state had spent before it failed (a model answer that
    did not parse was still paid for); the run's totals include it.
    """

    def __init__(self, error: str, at: str | None, usage: Usage | None = None):
        super().__init__(error)
        self.error = error
        self.at = at
        self.usage = usage if usage is not None else Usage()


class Suspend(Exception):
    """The run parks at a loop-top; `frames` runs root..innermost once fully raised."""

    def __init__(
        self, frame: Frame, reason: str, ask: str | None = None, reply_to: str | None = None, detail: str | None = None
    ):
        super().__init__(reason)
        self.frames = [frame]
        self.reason = reason
        self.ask = ask
        self.reply_to = reply_to
        self.detail = detail


class Interrupted(Exception):
    """An interrupt reached a run that cannot suspend: it ends at once (exit 130).

    `usage` gathers what every level had spent as the exception passed it, so
    the run's totals stay true.
    """

    def __init__(self, at: str, usage: Usage):
        super().__init__(at)
        self.at = at
        self.usage = usage


class Stopped(Exception):
    """A run-wide ceiling (tokens, dollars, time) stopped a level inside a fan-out branch.

    Branches cannot suspend, so the branch is not done: the fan-out keeps it out of
    its list and stops launching. `usage` is what the branch spent before it stopped.
    """

    def __init__(self, reason: str, usage: Usage):
        super().__init__(reason)
        self.reason = reason
        self.usage = usage
