"""The store contract kit: every promise of `RunStore`, and of each capability a store declares,
checked against a store that a factory opens (ADR 0052).

A store written outside mklang proves itself by running the kit in its own
tests, as this repository does for its file, SQLite and PostgreSQL stores:

    from mklang.stores import conformance

    def test_the_store_keeps_the_contract(tmp_path):
        report = conformance.verify(lambda: MyStore(tmp_path / "runs"))
        assert report.capabilities == {"SegmentStore", "NoteStore"}

or one test per promise, so a failure names it:

    @pytest.mark.parametrize("check", conformance.CHECKS, ids=str)
    def test_the_store_keeps(check, tmp_path):
        check.run(lambda: MyStore(tmp_path / "runs"))

The factory opens the same store each time it is called, as another process
would: a second opener (another connection, other file handles) of the same
runs. Checks name their runs uniquely, so they may share one store. A check of
a capability the store does not declare is skipped, and the report says so.
Envelopes are JSON objects, as `mklang.checkpoint` writes them; the kit writes
such bytes. Failures are `ContractError`s naming the promise broken.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import cast

from mklang.errors import CheckpointError, RunBusy
from mklang.stores import GenerationStore, NoteStore, PoolStore, RunStore, SegmentStore, SummaryStore
from mklang.stores.summary import RunQuery, RunSummary

Factory = Callable[[], RunStore]
CAPABILITIES: dict[str, type] = {
    "SegmentStore": SegmentStore,
    "SummaryStore": SummaryStore,
    "NoteStore": NoteStore,
    "GenerationStore": GenerationStore,
    "PoolStore": PoolStore,
}
DEATH_TIMEOUT = 10.0  # seconds a lock may outlive its killed holder (a server notices a dead client late)


class ContractError(AssertionError):
    """A promise of the store protocol that the store under test broke."""


def expect(condition: bool, promise: str) -> None:
    """Fail with `promise` unless `condition` holds (not `assert`: `python -O` keeps these)."""
    if not condition:
        raise ContractError(promise)


def envelope(text: str) -> bytes:
    """Envelope bytes as the checkpoint layer writes them: a JSON object in field order."""
    return b'{"answers":{},"format":3,"note":"' + text.encode() + b'"}'


@dataclass(frozen=True)
class Check:
    """One promise: what it checks, the capability it needs (None: every store), and the test."""

    name: str
    needs: str | None
    test: Callable[[Factory, str], None]

    def __str__(self) -> str:
        return self.name

    def applies(self, store: RunStore) -> bool:
        return self.needs is None or isinstance(store, CAPABILITIES[self.needs])

    def run(self, factory: Factory) -> bool:
        """Run the check on a store `factory` opens; False when it does not apply (skipped)."""
        with opened(factory) as store:
            if not self.applies(store):
                return False
        self.test(factory, f"conformance-{self.name}-{uuid.uuid4().hex[:12]}")
        return True


@dataclass
class Report:
    """What `verify` ran: the capabilities the store declares, the checks passed and skipped."""

    capabilities: set[str] = field(default_factory=set)
    passed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def verify(factory: Factory) -> Report:
    """Run every check against the store `factory` opens; raise `ContractError` naming each promise broken."""
    report = Report()
    with opened(factory) as store:
        report.capabilities = {name for name, kind in CAPABILITIES.items() if isinstance(store, kind)}
    failures = []
    for check in CHECKS:
        try:
            ran = check.run(factory)
        except Exception as error:  # a broken promise, or the store failing in a way of its own
            failures.append(f"{check.name}: {type(error).__name__}: {error}")
            continue
        (report.passed if ran else report.skipped).append(check.name)
    if failures:
        raise ContractError(f"{len(failures)} of {len(CHECKS)} promises broken:\n" + "\n".join(failures))
    return report


@contextmanager
def opened(factory: Factory) -> Iterator[RunStore]:
    store = factory()
    try:
        yield store
    finally:
        store.close()


# --- every store -------------------------------------------------------------------


def _envelopes(factory: Factory, run: str) -> None:
    with opened(factory) as store, opened(factory) as other:
        expect(store.read(run) is None, "read of a run the store does not hold is None")
        store.write(run, envelope("first"), generation=1)
        expect(store.read(run) == envelope("first"), "read returns the envelope written, byte for byte")
        expect(other.read(run) == envelope("first"), "a second opener reads the envelope written")
        big = envelope("x" * (1 << 20) + "\u00e9\\n")
        store.write(run, big, generation=2)
        expect(other.read(run) == big, "write replaces the envelope whole (a 1 MiB one read back as written)")
        expect(store.read(run + "-other") is None, "an envelope belongs to its run alone")


def _journal(factory: Factory, run: str) -> None:
    with opened(factory) as store, opened(factory) as other:
        expect(store.read_journal(run) == b"", "the journal of a run with none is empty")
        store.start_journal(run, b'{"k":"gen","g":1}\n')
        lines = [f'{{"k":"call","n":{n}}}\n'.encode() for n in range(20)]
        for number, line in enumerate(lines):
            store.append(run, line, durable=number % 2 == 0)
        whole = b'{"k":"gen","g":1}\n' + b"".join(lines)
        expect(store.read_journal(run) == whole, "read_journal returns the header and every append, in order")
        expect(other.read_journal(run) == whole, "an append is read back by a second opener as soon as it returns")
        store.start_journal(run, b'{"k":"gen","g":2}\n')
        expect(other.read_journal(run) == b'{"k":"gen","g":2}\n', "start_journal replaces the journal whole")
        store.append(run, lines[0], durable=True)
        expect(other.read_journal(run) == b'{"k":"gen","g":2}\n' + lines[0], "appends go on the new journal")
        expect(other.read_journal(run + "-other") == b"", "a journal belongs to its run alone")
        store.drop_journal(run)
        expect(other.read_journal(run) == b"", "drop_journal leaves the run no journal")
        store.drop_journal(run)  # dropping none is no error


def _lock(factory: Factory, run: str) -> None:
    with opened(factory) as store, opened(factory) as other:
        expect(other.holder(run) is None, "holder of a run nobody locked is None")
        lock = store.lock(run)
        try:
            for taker, who in ((other, "a second opener"), (store, "the same opener")):
                try:
                    taker.lock(run).release()
                except RunBusy as busy:
                    expect(bool(str(busy)), "the refusal of a held lock says who holds it")
                else:
                    raise ContractError(f"a held lock refuses {who} (RunBusy)")
            expect(other.holder(run) is not None, "holder names who holds a held lock, to a second opener")
            other.lock(run + "-other").release()  # a lock is its run's alone
        finally:
            lock.release()
        expect(other.holder(run) is None, "holder is None once the lock is released")
        again = other.lock(run)  # released: another opener takes it
        again.release()
        lock.release()  # releasing twice is no error


def _lock_dies_with_its_process(factory: Factory, run: str) -> None:
    with opened(factory) as store:
        store.read(run)  # everything the store imports, imported before the fork
    reading, writing = os.pipe()
    child = os.fork()
    if child == 0:  # the child: lock, tell the parent, wait to be killed
        try:
            os.close(reading)
            store = factory()
            held = store.lock(run)  # kept referenced: a store may close what it holds when collected
            os.write(writing, b"locked")
            time.sleep(60)
            held.release()
        finally:
            os._exit(1)
    os.close(writing)
    try:
        told = os.read(reading, 16)
        expect(told == b"locked", "a child process can lock a run (it failed before saying so)")
        with opened(factory) as store:
            expect(str(child) in (store.holder(run) or ""), "holder names the process id of the lock's holder")
        os.kill(child, signal.SIGKILL)
    finally:
        os.close(reading)
        os.waitpid(child, 0)
    with opened(factory) as store:
        deadline = time.monotonic() + DEATH_TIMEOUT
        while True:
            try:
                store.lock(run).release()
                return
            except RunBusy:
                expect(time.monotonic() < deadline, "a lock is released when its process dies (SIGKILL)")
                time.sleep(0.05)


def _runs_and_removal(factory: Factory, run: str) -> None:
    with opened(factory) as store, opened(factory) as other:
        names = [f"{run}-b", f"{run}-a", f"{run}-c"]
        for name in names:
            store.write(name, envelope(name), generation=1)
        store.start_journal(names[0], b'{"k":"gen","g":1}\n')
        listed = other.runs()
        expect(listed == sorted(listed), "runs() is sorted")
        expect(set(names) <= set(listed), "runs() names every run the store holds an envelope of")
        lock = store.lock(names[0])
        try:
            store.remove(names[0])
            expect(other.read(names[0]) is None, "remove takes the run's envelope")
            expect(other.read_journal(names[0]) == b"", "remove takes the run's journal")
            expect(names[0] not in other.runs(), "a removed run is not listed")
            expect(other.read(names[1]) == envelope(names[1]), "remove takes only its run")
            try:
                other.lock(names[0]).release()
            except RunBusy:
                pass
            else:
                raise ContractError("remove leaves the run's lock held by its holder")
        finally:
            lock.release()
        store.remove(f"{run}-never")  # removing a run the store does not hold is no error
        for name in names[1:]:
            store.remove(name)


# --- capabilities ------------------------------------------------------------------


def _segments(factory: Factory, run: str) -> None:
    with opened(factory) as opened_store, opened(factory) as opened_other:
        store, other = cast(SegmentStore, opened_store), cast(SegmentStore, opened_other)  # `Check.run` checked it
        name = "0" * 64
        expect(store.read_segment(run, name) is None, "read_segment of a segment not written is None")
        expect(store.segment_names(run) == set(), "a run with no segments lists none")
        store.write_segment(run, name, b"[1,2]")
        store.write_segment(run, name, b"[3]")  # named by its hash: one already there is kept
        expect(other.read_segment(run, name) == b"[1,2]", "a segment is kept as first written, for every opener")
        expect(other.segment_names(run) == {name}, "segment_names lists the run's segments")
        expect(run not in opened_other.runs(), "a run with segments and no envelope is not listed")
        expect(other.read_segment(run + "-other", name) is None, "a segment belongs to its run alone")
        opened_store.write(run, envelope(run), generation=1)
        opened_store.remove(run)
        expect(other.segment_names(run) == set(), "remove takes the run's segments")


def _summaries(factory: Factory, run: str) -> None:
    with opened(factory) as opened_store, opened(factory) as opened_other:
        store, other = cast(SummaryStore, opened_store), cast(SummaryStore, opened_other)  # `Check.run` checked it
        machine = f"machine-{run}"
        mine = RunQuery(machine=machine)
        store.write(run, envelope(run), generation=1, summary=RunSummary(run, "id-1", machine, "running", None, 10))
        [first] = other.summaries(mine)
        expect(
            (first.run, first.run_id, first.status, first.tokens) == (run, "id-1", "running", 10),
            "write keeps its summary",
        )
        expect(first.started is not None and first.updated is not None, "a summary is stamped started and updated")
        time.sleep(0.01)
        store.write(run, envelope(run), generation=2, summary=RunSummary(run, "id-1", machine, "done", cost_usd=0.5))
        store.write(run, envelope(run), generation=3)  # without a summary: the one kept stays
        [again] = other.summaries(mine)
        expect(
            (again.status, again.cost_usd) == ("done", 0.5), "write with a summary replaces it, without one keeps it"
        )
        expect(again.started == first.started, "a summary of the same run id keeps when it started")
        expect(again.updated is not None and again.updated > (first.updated or 0), "a summary is stamped updated now")
        time.sleep(0.01)
        store.summarize(run, RunSummary(run, "id-2", machine, "suspended", "Publish?"))
        [other_id] = other.summaries(mine)
        expect((other_id.status, other_id.reason) == ("suspended", "Publish?"), "summarize replaces the summary")
        expect(other_id.started is not None and other_id.started > (first.started or 0), "another run id starts anew")
        time.sleep(0.01)
        store.write(f"{run}-2", envelope(run), generation=1, summary=RunSummary(f"{run}-2", "id-3", machine, "done"))
        [newest, oldest] = other.summaries(mine)
        expect([newest.run, oldest.run] == [f"{run}-2", run], "summaries come newest started first")
        expect(
            [s.run for s in other.summaries(RunQuery(("done",), machine))] == [f"{run}-2"], "a query filters by status"
        )
        expect([s.run for s in other.summaries(RunQuery(machine=machine, limit=1, offset=1))] == [run], "a query pages")
        since = RunQuery(machine=machine, since=newest.updated)
        expect(
            [s.run for s in other.summaries(since)] == [f"{run}-2"], "a query takes those updated at or after `since`"
        )
        asks = {"ask": "Publish?", "question": "q1", "choices": ["yes", "no"], "shown": "the draft"}
        parked = RunSummary(run, "id-2", machine, "suspended", "Publish?", asks=asks, deadline=5.0, budget_cost=1.0)
        store.summarize(run, replace(parked, over_budget=True))
        [kept] = other.summaries(RunQuery(machine=machine, asking=True, due_by=5.0, over_budget=True))
        expect(
            (kept.run, kept.asks, kept.deadline, kept.budget_cost, kept.over_budget) == (run, asks, 5.0, 1.0, True),
            "a summary keeps what the run asks, its deadline, budgets and whether it is over budget",
        )
        expect(other.summaries(RunQuery(machine=machine, due_by=4.0)) == [], "a query takes those due by `due_by`")
        expect(
            [s.run for s in other.summaries(RunQuery(machine=machine, search="PUBLISH"))] == [run],
            "a query searches the reason in any case",
        )
        opened_store.remove(run)
        opened_store.remove(f"{run}-2")
        expect(other.summaries(mine) == [], "remove takes the run's summary")


def _notes(factory: Factory, run: str) -> None:
    with opened(factory) as opened_store, opened(factory) as opened_other:
        store, other = cast(NoteStore, opened_store), cast(NoteStore, opened_other)  # `Check.run` checked it
        key = f"{run}-note"  # named as a run could be: it must not be listed as one
        expect(store.read_note(key) is None, "read_note of a key never written is None")
        store.write_note(key, b"one")
        store.write_note(key, b"two")
        expect(other.read_note(key) == b"two", "write_note replaces the note, for every opener")
        expect(other.add_note(key, b"three") == b"two", "add_note keeps the note there and returns it")
        expect(other.add_note(key + "+", b"new") == b"new", "add_note writes a note that is not there")
        expect(key not in opened_other.runs(), "notes are not runs")
        store.drop_note(key)
        store.drop_note(key)  # dropping none is no error
        expect(other.read_note(key) is None, "drop_note removes the note")
        batch = f"batch-{run}"
        store.record_spend(batch, "run ä/1", 100, 0.5)
        store.record_spend(batch, "run ä/1", 150, 0.25)  # more tokens, fewer dollars
        store.record_spend(batch, "run ä/1", 10, 0.75)  # more dollars, fewer tokens
        store.record_spend(batch, "run ä/1", 1, 0.125)  # a resumed run replays from a smaller total
        expect(other.spend(batch) == (150, 0.75), "record_spend keeps the most of tokens and of dollars, apart")
        other.record_spend(batch, "b", 5, 0.25)
        expect(store.spend(batch) == (155, 1.0), "spend sums each run's highest recorded spend in its batch")
        expect(other.spend(batch + "-other") == (0, 0.0), "spend belongs to its batch alone")


def _generations(factory: Factory, run: str) -> None:
    with opened(factory) as opened_store, opened(factory) as opened_other:
        store, other = (
            cast(GenerationStore, opened_store),
            cast(GenerationStore, opened_other),
        )  # `Check.run` checked it
        expect(store.generation(run) == 0, "generation of a run the store does not hold is 0")
        opened_store.write(run, envelope("three"), generation=3)
        expect(other.generation(run) == 3, "generation is that of the envelope written last")
        try:
            opened_other.write(run, envelope("two"), generation=2)
        except CheckpointError:
            pass
        else:
            raise ContractError("write refuses an envelope older than the one the run holds (CheckpointError)")
        expect(opened_store.read(run) == envelope("three"), "a refused older envelope leaves the newer one")
        run_id = f"id-{run}"
        expect(store.generation_seen(run_id) == 0, "generation_seen of a run id never recorded is 0")
        store.record_generation(run_id, 5)
        other.record_generation(run_id, 4)
        expect(store.generation_seen(run_id) == 5, "record_generation never lowers what a run id reached")
        opened_store.remove(run)
        expect(other.generation_seen(run_id) == 5, "removing a run keeps what its run id reached")


def _pools(factory: Factory, run: str) -> None:
    from mklang.stores.pools import Caps, Hold

    with opened(factory) as opened_store, opened(factory) as opened_other:
        store, other = cast(PoolStore, opened_store), cast(PoolStore, opened_other)  # `Check.run` checked it
        name = run[-40:].lstrip("-")
        expect(store.pool(name) is None, "pool of a name never created is None")
        expect(store.create_pool(name, Caps(max_cost=1.0, max_tokens=1000, concurrency=2)), "create_pool makes it")
        expect(not other.create_pool(name, Caps(max_cost=5.0)), "create_pool refuses a name taken")
        expect(name in other.pool_names(), "pool_names lists the pool, for every opener")
        now = time.time()

        def hold(key: str, cost: float, tokens: int = 100, expires: float = now + 60) -> Hold:
            return Hold(name, f"{run}/{key}", run, cost, tokens, expires)

        expect(store.reserve(hold("a", 0.4), now), "reserve takes a hold that fits")
        expect(other.reserve(hold("b", 0.4, expires=now - 1), now), "a second opener reserves from the same pool")
        expect(not store.reserve(hold("c", 0.1), now), "reserve refuses a hold past the pool's calls in flight")
        pool = other.pool(name)
        expect(
            pool is not None and pool.in_flight == 2 and abs(pool.reserved_cost - 0.8) < 1e-9,
            "a hold counts as reserved and in flight",
        )
        expect(other.settle(name, f"{run}/a", 0.1, 20), "settle releases a hold and charges its actual spend")
        expect(not store.settle(name, f"{run}/a", 0.1, 20), "a hold settles once: the second settle charges nothing")
        expect(not store.reserve(hold("d", 0.6), now), "reserve refuses what spent plus reserved leaves no room for")
        expect(other.held(name, run) == [f"{run}/b"], "held lists the run's holds")
        expect(store.charge_held(name, now) == 1, "charge_held takes the holds whose lease expired")
        expect(not other.settle(name, f"{run}/b", 0.0, 0), "an expired hold charged cannot be settled again")
        pool = store.pool(name)
        expect(
            pool is not None and abs(pool.spent_cost - 0.5) < 1e-9 and pool.spent_tokens == 120 and pool.in_flight == 0,
            "an expired hold is charged its full reservation, a settled one its actual spend",
        )
        expect(not store.reserve(hold("e", 0.6), now), "the pool never lets spent and reserved past its cap")
        expect(store.top_up(name, 1.0, 0), "top_up raises the caps")
        expect(other.reserve(hold("e", 0.6), now), "a topped-up pool takes what did not fit")
        expect(other.charge_held(name, now, f"{run}/e") == 1, "charge_held with a key takes that hold alone")
        store.pause(name, now + 30)
        expect(not store.reserve(hold("f", 0.01), now), "a paused pool takes no hold until the pause ends")
        expect(store.reserve(hold("f", 0.01), now + 31), "a pause ends")
        expect(other.settle(name, f"{run}/f", 0.0, 0), "a hold taken after a pause settles")
        expect(store.reserve(hold("g", 0.1), now + 31) and other.reserve(hold("h", 0.2), now + 31), "two holds")
        expect(store.settle(name, f"{run}/h", 0.0, 0) and other.settle(name, f"{run}/g", 0.0, 0), "both settle")
        pool = store.pool(name)
        expect(
            pool is not None and pool.reserved_cost == 0 and pool.reserved_tokens == 0,
            "with no hold left nothing is reserved: no float residue of the holds' sums",
        )
        store.note_waiting(run, name)
        store.note_waiting(run, name)
        pool = other.pool(name)
        expect(pool is not None and pool.waiting == 0, "a run waits on a pool only while it is suspended on it")
        store.note_waiting(run, None)
        expect(store.remove_pool(name) and other.pool(name) is None, "remove_pool removes the pool")
        expect(not store.remove_pool(name), "removing a pool twice says it was not there")


CHECKS: tuple[Check, ...] = (
    Check("envelopes", None, _envelopes),
    Check("journal", None, _journal),
    Check("lock", None, _lock),
    Check("lock-dies-with-its-process", None, _lock_dies_with_its_process),
    Check("runs-and-removal", None, _runs_and_removal),
    Check("segments", "SegmentStore", _segments),
    Check("summaries", "SummaryStore", _summaries),
    Check("notes", "NoteStore", _notes),
    Check("generations", "GenerationStore", _generations),
    Check("pools", "PoolStore", _pools),
)
