"""Sweeping a store: every run parked on a human decision whose deadline has passed goes on
along the decision's timeout transition, exactly once (SPEC section 8, ADR 0059).

One pass, for cron: each suspended run is continued through `resume` with a deadline's
decision. A run is locked only when its envelope, read without the lock, says its deadline has
passed: a sweep never holds a run that is not due, so a human answering it before its deadline
is never told it is busy. The deadline is checked again once `resume` holds the lock and has
read the run (the host is built only for a run that is due), and again by
`decisions.refusal` as the decision applies, so a sweep racing another sweep or a human's
answer either takes the lock and decides, or is told the run is busy or no longer waits on
that question.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from typing import Any, cast

from mklang.checkpoint.envelope import load
from mklang.engine import decisions
from mklang.engine.records import HumanAsk
from mklang.errors import CheckpointError, DecisionRefused, MklangError, RunBusy, first_line, redacted
from mklang.runs.hosting import build_host
from mklang.runs.opening import Resumable
from mklang.runs.request import RunRequest
from mklang.runs.resuming import resume
from mklang.session import Host
from mklang.stores import Location, RunQuery, RunStore, summaries_of


@dataclass
class Swept:
    """What a sweep did with one parked run: `continued` it along its timeout (with the status
    it came to), found it `busy` (another process holds it), `refused` (no longer due when the
    decision applied) or `failed` (it could not be continued)."""

    run: str
    outcome: str  # continued | busy | refused | failed
    question: str | None = None
    status: str | None = None  # done | halted | suspended, once continued
    detail: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """What `runs sweep` prints of it: `RUN: continued question Q -> done (why)`."""
        parts = [f"question {self.question}"] if self.question else []
        parts += [f"-> {self.status}"] if self.status else []
        parts += [f"({self.detail})"] if self.detail else []
        return f"{self.run}: {self.outcome}" + "".join(f" {part}" for part in parts)


class _NotDue(Exception):
    """The run read under its lock waits on no deadline that has passed: the sweep leaves it."""


def sweep(store: RunStore, locate: Callable[[str], Location], request: RunRequest) -> list[Swept]:
    """Continue every run of `store` whose decision's deadline has passed; `locate` names a run of
    the store, `request` says how each is continued (its host options, as `resume`'s). Runs not
    due, or that this user cannot continue, are passed over without a word."""
    swept = []
    for summary in summaries_of(store, RunQuery(statuses=("suspended",))):
        location = locate(summary.run)
        if not _looks_due(location):
            continue
        done = _sweep_one(replace(request, source=location, decision={"by": "deadline"}))
        if done is not None:
            swept.append(done)
    return swept


def _looks_due(location: Location) -> bool:
    """Whether the run's envelope, read without its lock (and unverified: `resume` verifies it
    under the lock), waits on a decision whose deadline has passed."""
    try:
        frames = load(location).frames
    except CheckpointError:
        return True  # `resume` opens it under the lock and says why it does not open
    asked = frames[-1].get("ask") if frames else None
    try:
        return asked is not None and decisions.due(cast(HumanAsk, asked), decisions.now())
    except (TypeError, ValueError):
        return True  # an unreadable deadline: `resume` reads it under the lock and says so


def _sweep_one(request: RunRequest) -> Swept | None:
    """Continue one run when its deadline has passed; None when it is not due."""
    assert isinstance(request.source, Location), "a sweep continues runs of its store"
    name = redacted(request.source.text)
    question: list[str | None] = []

    with ExitStack() as hosts:

        def host_for(resumable: Resumable) -> Host:
            asked = resumable.chain[-1].ask
            if asked is None or not decisions.due(asked, decisions.now()):
                raise _NotDue
            question.append(asked.get("question"))
            return hosts.enter_context(build_host(request, resumable))

        try:
            result = resume(request, host_for, tell=lambda _said: None)
        except _NotDue:
            return None
        except RunBusy as error:
            return Swept(name, "busy", detail=first_line(error))
        except DecisionRefused as error:
            return Swept(name, "refused", question[0], detail=first_line(error))
        except CheckpointError as error:  # a run that does not open: `show` says why, a sweep leaves it
            return Swept(name, "failed", question[0], detail=first_line(error)) if question else None
        except MklangError as error:
            return Swept(name, "failed", question[0] if question else None, detail=first_line(error))
    return Swept(name, "continued", question[0], status=result.status, detail=result.error)


class Sweeper:
    """Sweeps a store every `every` seconds in a thread of its own until stopped, so deadlines are
    taken without cron: what `mklang serve --sweep` and `mklang worker --sweep` run. Each pass is a
    `sweep`; what it did with a run, and a pass that could not read the store, is told in one line."""

    def __init__(
        self,
        store: RunStore,
        locate: Callable[[str], Location],
        request: RunRequest,
        every: float,
        tell: Callable[[str], None],
    ):
        self.store, self.locate, self.request, self.every, self.tell = store, locate, request, every, tell
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._sweep, name="mklang-sweep", daemon=True)

    def __enter__(self) -> Sweeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        self._thread.join(timeout=30)  # a pass continuing runs ends with them

    def _sweep(self) -> None:
        while not self._stopped.wait(self.every):
            try:
                swept = sweep(self.store, self.locate, self.request)
            except MklangError as error:  # the store cannot be read now: the next pass looks again
                self.tell(f"sweep: {redacted(first_line(error))}")
                continue
            for done in swept:
                self.tell(f"sweep: {done.line()}")
