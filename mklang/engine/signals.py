"""How a run level ends early: the one signal the engine raises, `Stop`."""

from __future__ import annotations

from typing import Literal

from mklang.engine.frame import Frame
from mklang.engine.records import TraceStep

StopKind = Literal["halted", "suspended", "interrupted", "stopped", "cut", "call-failed"]


class Stop(Exception):
    """A run level ends early for `reason` at its state `at`. The `kind` says how:

    - halted: for good; `reason` is the halt (with detail).
    - suspended: the run parks at a loop-top; `frames` runs root..innermost once fully
      raised; `ask`, `reply_to` and `detail` say what it waits on.
    - interrupted: an interrupt reached a run that cannot suspend; it ends at once (exit 130).
    - stopped: a run-wide ceiling (tokens, dollars, time) stopped a level inside a fan-out
      branch; branches cannot suspend, so the fan-out keeps the branch out of its list.
    - cut: a fan-out stopped launching branches; its level ends as a loop-top check would.
    - call-failed: a called machine halted; the calling state records `trace`, its sub-run.

    A Stop carries no spend: a level that stops mid-step records in its frame what the
    step had paid (its `Calls` tally), so a run's spend is read once, at its end.
    """

    def __init__(
        self,
        kind: StopKind,
        reason: str,
        at: str | None,
        frames: list[Frame] | None = None,
        *,
        ask: str | None = None,
        reply_to: str | None = None,
        detail: str | None = None,
        trace: list[TraceStep] | None = None,
    ):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.at = at
        self.frames = frames or []
        self.ask = ask
        self.reply_to = reply_to
        self.detail = detail
        self.trace = trace or []
