"""Run one machine over many inputs, each a durable run in one store (docs/scale.md).

Every input line names its run (its `id` field, else the hash of the line),
so re-running the same batch is how it resumes: finished runs are skipped,
runs that crashed or stopped on a budget resume (with the budgets given
now), and runs parked on a human question stay parked until someone answers
them with `mklang resume STORE#RUN --set ...`. The store, not this process,
is the source of truth: a run's outcome is what its envelope there says,
whichever process or worker ran it (`runs.outcome` reads it; a run this
process ran is told it from the envelope it wrote last, under its lock).
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mklang import exitcodes
from mklang.checkpoint.texts import keep_texts
from mklang.engine import Control
from mklang.engine.events import EventSink
from mklang.engine.runtime import Caps
from mklang.errors import MklangError, RunBusy, UsageError, first_line
from mklang.limits import COST_SLACK, load_json_object
from mklang.model import Machine
from mklang.providers.base import Usage
from mklang.runs import Claim, Outcome, claim, location, outcome
from mklang.session import Host
from mklang.stores import NoteStore, Store, run_name
from mklang.vocabulary import DEFAULT_BATCH_CONCURRENCY


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

    def any(self) -> bool:
        return self.max_tokens is not None or self.max_cost is not None

    def reached(self, tokens: int, cost: float) -> bool:
        return (self.max_tokens is not None and tokens >= self.max_tokens) or (
            self.max_cost is not None and cost >= self.max_cost - COST_SLACK
        )

    def overrun(self, tokens: int, cost: float) -> str | None:
        """Which ceiling the batch's spend reached and by how much: `batch tokens 900 of 800`."""
        words = Caps(self.max_tokens, self.max_cost).overrun(Usage(tokens, 0, cost))
        return f"batch {words}" if words else None

    def to_json(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "max_cost": self.max_cost}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Ceilings:
        return cls(data.get("max_tokens"), data.get("max_cost"))


class Ledger:
    """A batch's spend against its ceilings: what each run spent, live, and the total.

    The engine asks `record` at every loop-top and before every fan-out branch
    (`Control.ceiling`), so a run learns of a ceiling another run crossed before
    its next call. This one lives in the process (the local executor);
    `StoreLedger` shares it between workers through the store.
    """

    def __init__(self, ceilings: Ceilings):
        self.ceilings = ceilings
        self._runs: dict[str, tuple[int, float]] = {}
        self._tokens, self._cost = 0, 0.0
        self._guard = threading.Lock()

    def reached(self) -> bool:
        with self._guard:
            return self.ceilings.reached(self._tokens, self._cost)

    def overrun(self) -> str | None:
        with self._guard:
            return self.ceilings.overrun(self._tokens, self._cost)

    def record(self, run: str, spent: Usage) -> bool:
        """Note that `run` has spent `spent` in all (it never goes down); True once a ceiling is reached."""
        with self._guard:
            tokens, cost = self._runs.get(run, (0, 0.0))
            now = max(tokens, spent.tokens), max(cost, spent.cost_usd)
            self._runs[run] = now
            self._tokens += now[0] - tokens
            self._cost += now[1] - cost
            return self.ceilings.reached(self._tokens, self._cost)

    def count(self, store: Store, items: Iterable[Item]) -> None:
        """Record what each run spent in the batch's earlier passes: it counts against the ceilings."""
        for item in items:
            self.record(item.run, Usage.from_json(outcome(store, item.run).usage))


class StoreLedger(Ledger):
    """The ledger of a batch whose runs are spread over workers: each run's spend lives in the store."""

    def __init__(self, ceilings: Ceilings, store: NoteStore, batch: str):
        super().__init__(ceilings)
        self.store, self.batch = store, batch

    def reached(self) -> bool:
        return self.ceilings.reached(*self.store.spend(self.batch))

    def overrun(self) -> str | None:
        return self.ceilings.overrun(*self.store.spend(self.batch))

    def record(self, run: str, spent: Usage) -> bool:
        self.store.record_spend(self.batch, run, spent.tokens, spent.cost_usd)
        return self.reached()


def batch_id(items: Iterable[Item]) -> str:
    """A batch is named by the runs it holds: re-running it (in any order) is the same batch."""
    return hashlib.sha256("\n".join(sorted(item.run for item in items)).encode("utf-8")).hexdigest()[:16]


def read_inputs(path: str | Path) -> list[Item]:
    """The items of a JSON Lines file; each line is a JSON object (blank lines are skipped)."""
    from mklang.limits import read_text

    return items_of(
        (load_json_object(line, f"{path}:{number}", "each line"), f"{path}:{number}")
        for number, line in enumerate(read_text(path, "--inputs file").splitlines(), 1)
        if line.strip()
    )


def items_of(inputs: Iterable[tuple[dict[str, Any], str]]) -> list[Item]:
    """The items of context maps, each with where it was given: its `id` names the run, else its hash.

    A run name is checked here, before any run starts (`run_name`): an id is never a file path."""
    items: list[Item] = []
    seen: set[str] = set()
    for data, where in inputs:
        run = run_name(str(data["id"]), where) if "id" in data else input_hash(data)
        if run in seen:
            raise UsageError(f"{where}: run id {run!r} appears twice")
        seen.add(run)
        items.append(Item(run, data))
    return items


def input_hash(data: dict[str, Any]) -> str:
    """The name of an input without `id`: the hash of its canonical JSON, whether it came from a file or not."""
    canonical = json.dumps(data, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


class Batch:
    """Runs items with one machine, up to `concurrency` at a time, under batch-wide ceilings.

    `host_for()` gives each run its host as a context manager: a `Host` built
    for the run (closed after it), or a shared one wrapped in `nullcontext`.
    The ceilings are kept by `ledger` (by default one in this process, which
    counts what the batch's runs spent in earlier passes too).
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
        untrusted_flow: str | None = None,
        ceilings: Ceilings | None = None,
        ledger: Ledger | None = None,
        on_outcome: Callable[[Outcome], None] | None = None,
        stop: threading.Event | None = None,
        hitl: bool,
        kept_texts: bool = False,
        texts: dict[str, str] | None = None,
        observer: EventSink | None = None,
    ):
        self.machine = machine
        self.store = store
        self.uri = uri
        self.host_for = host_for
        # What every run is started or resumed with: the budgets, and the untrusted-flow policy.
        self.budgets: dict[str, Any] = dict(
            max_tokens=max_tokens, max_cost=max_cost, max_time=max_time, untrusted_flow=untrusted_flow
        )
        self.hitl = hitl  # escalations park the run for a human reply
        self.kept_texts = kept_texts  # a resume runs the machine texts the store keeps in place of edited files
        self._texts = texts  # the machine texts the store keeps (a worker's record names them), kept once
        self._texts_guard = threading.Lock()
        if ledger is None and ceilings is not None and ceilings.any():
            ledger = Ledger(ceilings)
        self.ledger = ledger
        self.on_outcome = on_outcome
        self.stop = stop or threading.Event()  # set: every run suspends at its next loop-top
        self.observer = observer  # told of every run's events, each with the run's name

    def run_item(self, item: Item) -> Outcome:
        """Start, resume or skip one run; its outcome is what its envelope in the store says (the
        one a run started or resumed here wrote, under its lock).

        The run's lock is taken first and its envelope read under it, so a run
        another process finished meanwhile is skipped, never started again.
        A run that cannot be set up or resumed here (its name, its host, its
        checkpoint) is `failed` with the one-line reason; one locked by
        another process is `pending` (it is still going there).
        """
        if self.stop.is_set():  # interrupted: a run not started yet stays for the next pass
            return self._report(Outcome(item.run, "pending", "interrupted"))
        try:
            held = claim(location(self.store, self.uri, item.run))
        except RunBusy as error:
            return self._report(Outcome(item.run, "pending", first_line(error)))
        except MklangError as error:
            return self._report(Outcome(item.run, "failed", first_line(error)))
        try:
            return self._report(self._run_held(item, held))
        finally:
            held.release()

    def _run_held(self, item: Item, held: Claim) -> Outcome:
        done = held.outcome()
        if done.settled:
            return done
        if self.ledger is not None and self.ledger.reached():  # leave it for a pass with a higher ceiling
            return Outcome(item.run, "suspended", "batch-ceiling", usage=done.usage)
        control = Control()
        control.interrupted = self.stop
        if self.ledger is not None:
            control.ceiling = functools.partial(self.ledger.record, item.run)
            control.ceiling_detail = self.ledger.overrun
        try:
            with self.host_for() as host:
                ended = held.run(
                    self.machine,
                    item.context,
                    host,
                    texts=self._kept_texts,
                    kept_texts=self.kept_texts,
                    hitl=self.hitl or None,  # else the scenario's `run:` setting, if any
                    control=control,
                    observer=self.observer,
                    **self.budgets,
                )
        except MklangError as error:
            return Outcome(item.run, "failed", first_line(error))
        if self.ledger is not None:  # the last call of a run is after its last loop-top
            self.ledger.record(item.run, Usage.from_json(ended.usage))
        return ended

    def _kept_texts(self) -> dict[str, str]:
        """The machine's texts in the store, kept by the first run that starts (not once per run)."""
        with self._texts_guard:
            if self._texts is None:
                self._texts = keep_texts(self.store, self.machine, "the batch")
            return self._texts

    def _report(self, result: Outcome) -> Outcome:
        if self.on_outcome is not None:
            self.on_outcome(result)
        return result

    def run(self, items: Iterable[Item], concurrency: int = DEFAULT_BATCH_CONCURRENCY) -> list[Outcome]:
        items = list(items)
        if self.ledger is not None:
            self.ledger.count(self.store, items)
        with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="mklang-batch") as pool:
            return list(pool.map(self.run_item, items))


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
