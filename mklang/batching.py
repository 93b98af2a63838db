"""Run one machine over many inputs, each a durable run in one store (docs/scale.md).

Every input line names its run (its `id` field, else the hash of the line),
so re-running the same batch is how it resumes: finished runs are skipped,
runs that crashed or stopped on a budget resume (with the budgets given
now), and runs parked on a human question stay parked until someone answers
them with `mklang resume STORE#RUN --set ...`. The store, not this process,
is the source of truth: `collect` reads every run's outcome from it, whichever
process or worker ran it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mklang import exitcodes
from mklang.checkpoint.envelope import parse
from mklang.checkpoint.journal import resume_change
from mklang.checkpoint.store import Location, Store
from mklang.engine import Control
from mklang.errors import MklangError, UsageError
from mklang.limits import load_json
from mklang.model import Machine
from mklang.providers.base import Usage
from mklang.session import Host, opened, proceed, start

DEFAULT_CONCURRENCY = 32  # runs wait on models, not on this machine's cores
PARKED = "escalated"  # a run waiting for a human reply; only `resume --set` continues it


@dataclass(frozen=True)
class Item:
    """One input line: the run it names and the context it starts with."""

    run: str
    context: dict[str, Any]


@dataclass
class Ceilings:
    """Batch-wide spend ceilings beside each run's own budgets."""

    max_tokens: int | None = None
    max_cost: float | None = None


@dataclass
class Outcome:
    """What became of one run, as its envelope in the store says."""

    run: str
    status: str  # done | halted | suspended | pending | failed
    reason: str | None = None
    result: Any = None
    usage: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.run,
            "status": self.status,
            "reason": self.reason,
            "result": self.result,
            "usage": self.usage,
        }


def read_inputs(path: str | Path) -> list[Item]:
    """The items of a JSON Lines file; each line is a JSON object (blank lines are skipped)."""
    from mklang.limits import read_text

    items: list[Item] = []
    seen: set[str] = set()
    for number, line in enumerate(read_text(path, "--inputs file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = load_json(line)
        except ValueError as error:
            raise UsageError(f"{path}:{number}: not a JSON object: {error}") from None
        if not isinstance(data, dict):
            raise UsageError(f"{path}:{number}: each line must be a JSON object")
        run = str(data["id"]) if "id" in data else hashlib.sha256(line.strip().encode()).hexdigest()[:16]
        if run in seen:
            raise UsageError(f"{path}:{number}: run id {run!r} appears twice")
        seen.add(run)
        items.append(Item(run, data))
    return items


def location(store: Store, uri: str, run: str) -> Location:
    text = f"{uri}#{run}" if "://" in uri else str(Path(uri) / run)
    return Location(store, run, text, text)


def outcome(store: Store, run: str) -> Outcome:
    """A run's outcome as its envelope says; `pending` when it has not run or is still running."""
    raw = store.read(run)
    if raw is None:
        return Outcome(run, "pending")
    envelope = parse(raw, run)
    status: str = envelope.status
    running = status == "running" or resume_change(store, run, envelope) is not None
    if running or (status == "suspended" and envelope.reason == "interrupted"):
        status = "pending"  # a crashed or interrupted run: the next pass resumes it
    return Outcome(
        run,
        status,
        envelope.reason if status == "suspended" else envelope.error,
        envelope.result,
        dict(envelope.usage),
    )


class Batch:
    """Runs items with one machine, up to `concurrency` at a time, under batch-wide ceilings.

    `host_for()` gives each run its host as a context manager: a `Host` built
    for the run (closed after it), or a shared one wrapped in `nullcontext`.
    """

    def __init__(
        self,
        machine: Machine,
        store: Store,
        uri: str,
        host_for: Callable[[], AbstractContextManager[Host]],
        *,
        max_tokens: int | None = None,
        max_cost: float | None = None,
        max_time: float | None = None,
        ceilings: Ceilings | None = None,
        on_outcome: Callable[[Outcome], None] | None = None,
        stop: threading.Event | None = None,
    ):
        self.machine = machine
        self.store = store
        self.uri = uri
        self.host_for = host_for
        self.budgets = dict(max_tokens=max_tokens, max_cost=max_cost, max_time=max_time)
        self.ceilings = ceilings or Ceilings()
        self.on_outcome = on_outcome
        self.stop = stop or threading.Event()  # set: every run suspends at its next loop-top
        self._spent = Usage()
        self._guard = threading.Lock()

    def run_item(self, item: Item) -> Outcome:
        """Start, resume or skip one run; its outcome is read back from the store."""
        done = outcome(self.store, item.run)
        if done.status in ("done", "halted") or (done.status == "suspended" and done.reason == PARKED):
            return self._report(done)
        budgets = self._budgets()
        if budgets is None:  # a batch-wide ceiling is reached: leave it for a later pass
            return self._report(Outcome(item.run, "suspended", "batch-ceiling"))
        where = location(self.store, self.uri, item.run)
        control = Control()
        control.interrupted = self.stop
        try:
            with self.host_for() as host:
                if self.store.read(item.run) is None:
                    result = start(self.machine, item.context, host, checkpoint=where, control=control, **budgets)
                else:
                    with opened(where) as resumable:
                        result = proceed(resumable, host, control=control, **budgets)
        except MklangError as error:
            return self._report(Outcome(item.run, "failed", str(error)))
        with self._guard:
            self._spent = self._spent + result.usage
        return self._report(outcome(self.store, item.run))

    def _budgets(self) -> dict[str, Any] | None:
        """The run's budgets, lowered to what the batch-wide ceilings leave; None when nothing is left."""
        budgets: dict[str, Any] = dict(self.budgets)
        with self._guard:
            spent = self._spent
        for key, ceiling, used in (
            ("max_tokens", self.ceilings.max_tokens, spent.tokens),
            ("max_cost", self.ceilings.max_cost, spent.cost_usd),
        ):
            if ceiling is None:
                continue
            left = ceiling - used
            if left <= 0:
                return None
            budgets[key] = left if budgets[key] is None else min(budgets[key], left)
        return budgets

    def _report(self, result: Outcome) -> Outcome:
        if self.on_outcome is not None:
            self.on_outcome(result)
        return result

    def run(self, items: Iterable[Item], concurrency: int = DEFAULT_CONCURRENCY) -> list[Outcome]:
        items = list(items)
        with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="mklang-batch") as pool:
            return list(pool.map(self.run_item, items))


def collect(store: Store, items: Iterable[Item]) -> list[Outcome]:
    """Every item's outcome, from the store."""
    return [outcome(store, item.run) for item in items]


def summary(outcomes: list[Outcome]) -> dict[str, Any]:
    counts = Counter(result.status for result in outcomes)
    usage = sum((Usage.from_json(result.usage) for result in outcomes), Usage())
    return {
        "items": len(outcomes),
        **{status: counts.get(status, 0) for status in ("done", "halted", "suspended", "pending", "failed")},
        "usage": usage.to_json(),
        "exit_code": exit_code(outcomes),
    }


def exit_code(outcomes: list[Outcome]) -> int:
    """3 when some run can continue (suspended or pending), else 1 when some halted or failed, else 0."""
    statuses = {result.status for result in outcomes}
    if statuses & {"suspended", "pending"}:
        return exitcodes.SUSPENDED
    if statuses & {"halted", "failed"}:
        return exitcodes.HALT
    return exitcodes.OK


def write_results(path: str | Path, outcomes: list[Outcome]) -> None:
    """One JSON line per input, in input order, written atomically."""
    from mklang.files import write_atomic

    payload = "".join(json.dumps(result.to_json(), ensure_ascii=False) + "\n" for result in outcomes)
    try:
        write_atomic(path, payload.encode("utf-8"))
    except OSError as error:
        raise UsageError(f"{path}: cannot write the results: {error.strerror}") from None
