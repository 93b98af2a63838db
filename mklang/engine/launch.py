"""When a run level may take its next step, and launching a fan-out's branches by that rule.

`exhausted` is the one budget check (loop-tops and fan-outs both call it), `ran_out` says
how far the budget it names went;
`Launch` hands a fan-out's branches to the run's worker threads in input order.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from mklang.engine.frame import Frame
from mklang.engine.runtime import Level, Runtime


def exhausted(rt: Runtime, level: Level, launched: int = 0) -> str | None:
    """Why `level` may not start another state, or another branch of a fan-out that has
    `launched` branches already; None when it may. The one budget check: loop-tops and
    fan-outs both call it. SPEC section 4 order: steps, token/cost (the run's, then a
    batch's shared ceiling, which also learns the run's spend here), time, interrupts.

    Tokens, dollars and time are the whole run's (every level, every branch, live);
    steps are the level's own, a branch counting one.
    """
    frame = level.frame
    if frame.steps + launched >= frame.budget:
        return "budget-exhausted"
    caps, control = rt.caps, rt.control
    if (caps.tokens is not None or caps.cost is not None) and caps.reached(rt.spent):  # no call uncapped
        return "cost-exhausted"
    if control.ceiling is not None and control.ceiling(rt.spent):
        return "batch-ceiling"
    if control.deadline is not None and control.past_deadline():
        return "time-exhausted"
    if control.interrupted.is_set() and not level.branch:
        return "interrupted"
    return None


def ran_out(rt: Runtime, frame: Frame, reason: str) -> str | None:
    """Which budget `reason` (of `exhausted`) names and how far it went, for the run's detail:
    `steps 25 of 25`, `tokens 1,204 of 1,000`, `time 10.2s of 10s`, `batch tokens 900 of 800`;
    None for other reasons."""
    if reason == "budget-exhausted":
        return f"steps {frame.steps:,} of {frame.budget:,}"
    if reason == "cost-exhausted":
        return rt.caps.overrun(rt.spent_so_far())
    if reason == "batch-ceiling" and rt.control.ceiling_detail is not None:
        return rt.control.ceiling_detail()
    limit, deadline = rt.control.max_time, rt.control.deadline
    if reason == "time-exhausted" and limit is not None and deadline is not None:
        return f"time {round(limit + max(0.0, time.monotonic() - deadline), 3):g}s of {limit:g}s"
    return None


class Launch:
    """The launches of one fan-out's branches, in input order. While the run has a worker slot
    free, the thread that fans out hands the branch it launches to a pooled thread, which
    keeps the slot and goes on launching and running the branches left; once no slot is
    free, it runs the branch itself. So a thread is handed over once a slot is taken, not
    once per branch (ADR 0038). Before each launch `exhausted` decides whether it may; once
    it may not, or a branch raised, no more launch and those in flight finish."""

    def __init__(
        self, rt: Runtime, level: Level, todo: list[int], launched: int, branch: Callable[[int], dict[str, Any]]
    ):
        self._rt, self._level, self._branch = rt, level, branch
        self._todo = todo
        self._next = 0  # the position in `todo` of the next branch to launch
        self._launched = launched  # the branches kept or launched so far: each is a step of the level
        self._turn = threading.Condition()  # a launch; a lent thread ending
        self._lent = 0  # pooled threads still working for the fan-out
        self.cut: str | None = None  # why a branch could not launch
        self.done: dict[int, dict[str, Any]] = {}
        self.errors: dict[int, BaseException] = {}

    def run(self) -> None:
        """Launch every branch that may launch, then wait for the lent threads to end."""
        while (launched := self._launch(lending=True)) is not None:
            i, lent = launched
            if lent:
                self._rt.workers.lend(functools.partial(self._lent_thread, i))
            else:
                self._run(i)
        with self._turn:
            self._turn.wait_for(lambda: not self._lent)

    def _launch(self, lending: bool) -> tuple[int, bool] | None:
        """The next branch to launch and whether a slot was taken to lend it a thread (only
        the thread that fans out lends: a lent thread runs its branch until it waits before
        the next launch, as a branch on a thread of its own did); None once none may launch."""
        with self._turn:
            if self._next == len(self._todo) or self.cut or self.errors:
                return None
            i = self._todo[self._next]
            try:
                self.cut = exhausted(self._rt, self._level, self._launched)
            except BaseException as error:  # a batch ceiling kept in a store may fail to answer
                self.errors[i] = error
                return None
            if self.cut:
                return None
            self._launched += 1
            self._next += 1
            lent = lending and self._rt.workers.reserve()
            if lent:
                self._lent += 1
            return i, lent

    def _lent_thread(self, i: int) -> None:
        try:
            self._run(i)
            while (launched := self._launch(lending=False)) is not None:
                self._run(launched[0])
        finally:
            with self._turn:
                self._lent -= 1
                self._turn.notify_all()

    def _run(self, i: int) -> None:
        try:
            self.done[i] = self._branch(i)
        except BaseException as error:  # re-raised by the fan-out once every branch in flight ends
            self.errors[i] = error
