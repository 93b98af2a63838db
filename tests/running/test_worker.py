"""A worker's side of `batch --executor celery`, in this process: the messages it accepts, the runs
it runs from their signed records, the reports a batch follows.

The batch enqueues on the real RabbitMQ and follows the real SQLite store
(`enqueue_and_follow`); this process takes each message off the queue as
Celery's consumer would and hands it to a `Worker`, so what the worker does
is observed without a worker process. The model is a scripted one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import celery  # noqa: F401  (imported here, not on the batch's thread while this one imports kombu)
import pytest
from kombu import Connection, Exchange, Queue
from support.batches import MACHINE
from support.fleet import RABBITMQ, drop_queue
from support.fleet import fleet_key as fleet_key  # a fixture, autouse
from support.services import require_server

from mklang.batching import Ceilings, Item
from mklang.distributed import Worker, enqueue_and_follow, queue_for, read_note, task_mac
from mklang.errors import CheckpointError
from mklang.providers.base import Usage
from mklang.service import Outcome, outcome, record_key, report_key, write_signed
from mklang.stores import open_store
from mklang.syntax import load_file

SCRIPT = """\
scenarios:
  - name: words
    llm:
      produce: ["word"]
      tokens: [10, 5]
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "twostep.mk").write_text(MACHINE, encoding="utf-8")
    (tmp_path / "script.yaml").write_text(SCRIPT, encoding="utf-8")
    return tmp_path


def worker_of(project: Path) -> Worker:
    settings = {"script": str(project / "script.yaml"), "scenario": "words"}
    return Worker(f"sqlite:///{project}/runs.db", settings)


def run_and_report(worker: Worker, run: str) -> None:
    worker.report(worker.run(run))


def take(worker: Worker, count: int, handle: Callable[[Worker, str], None] = run_and_report) -> list[str | None]:
    """Take `count` messages off the worker's queue, as Celery hands them to the task, and `handle`
    each run the worker accepts (by default: run it and report it); the runs accepted, None for
    each refused."""
    name = queue_for(worker.store)
    taken: list[str | None] = []
    with Connection(RABBITMQ) as connection:
        queue = Queue(name, Exchange(name), routing_key=name)(connection.default_channel)  # as Celery declares it
        queue.declare()
        deadline = time.monotonic() + 60
        while len(taken) < count:
            message = queue.get()
            if message is None:
                assert time.monotonic() < deadline, f"{len(taken)} of {count} messages came"
                time.sleep(0.05)
                continue
            args, kwargs, _ = message.payload
            run = worker.accept(args, kwargs)
            if run is not None:
                handle(worker, run)
            message.ack()
            taken.append(run)
    return taken


def follow(project: Path, items: list[Item], **options: Any) -> tuple[threading.Thread, list[list[Outcome]]]:
    """`enqueue_and_follow` on a thread of its own (it returns once every run is reported)."""
    followed: list[list[Outcome]] = []
    machine = load_file(project / "twostep.mk")

    def batch() -> None:
        store = open_store(f"sqlite:///{project}/runs.db")
        try:
            followed.append(enqueue_and_follow(RABBITMQ, store, machine, items, {}, stall=60, **options))
        finally:
            store.close()

    thread = threading.Thread(target=batch)
    thread.start()
    return thread, followed


def test_a_batch_on_the_broker_is_run_from_the_signed_records_and_followed_to_each_outcome(project):
    require_server("RabbitMQ")
    worker = worker_of(project)
    items = [Item(f"item-{n}", {"topic": f"t-{n}"}) for n in range(3)]
    try:
        thread, followed = follow(project, items)
        assert take(worker, 3) == ["item-0", "item-1", "item-2"]
        thread.join(timeout=60)
        ((first),) = followed
        assert [(o.run, o.status, o.result) for o in first] == [(f"item-{n}", "done", "word") for n in range(3)]
        assert [o.usage["input_tokens"] for o in first] == [20] * 3  # two calls of 10 input tokens each
        note = read_note(worker.store, "item-1")
        assert note is not None and (note["worker"], note["outcome"]["status"]) == (worker.name, "done")
        # Again: every run is settled, so nothing is enqueued and nothing waits.
        thread, followed = follow(project, items)
        thread.join(timeout=60)
        assert followed == [first]
    finally:
        drop_queue(f"sqlite:///{project}/runs.db")
        worker.store.close()


def test_a_worker_runs_a_batch_ceiling_from_the_record_across_its_runs(project):
    """15 tokens a call, 40 for the batch: the third call crosses it, and the runs left are suspended."""
    require_server("RabbitMQ")
    worker = worker_of(project)
    items = [Item(f"item-{n}", {"topic": f"t-{n}"}) for n in range(3)]
    try:
        thread, followed = follow(project, items, ceilings=Ceilings(max_tokens=40))
        take(worker, 3)
        thread.join(timeout=60)
        ((first),) = followed
        assert [(o.status, o.reason) for o in first] == [("done", None)] + [("suspended", "batch-ceiling")] * 2
        assert [Usage.from_json(o.usage).tokens for o in first] == [30, 15, 0]
    finally:
        drop_queue(f"sqlite:///{project}/runs.db")
        worker.store.close()


def refusal(worker: Worker, args: Any, kwargs: Any, capfd: pytest.CaptureFixture[str]) -> str | None:
    """Why the worker refused a message (the line it says on its stderr), None when it accepted it."""
    run = worker.accept(args, kwargs)
    said = capfd.readouterr().err.splitlines()
    if run is not None:
        assert said == []
        return None
    (line,) = said
    return line.split(": refused a task message: ", 1)[1]


def test_a_worker_refuses_a_message_the_fleet_key_did_not_send_for_this_store(project, capfd):
    worker = worker_of(project)
    mac = task_mac(worker.identity, "item-0")
    try:
        assert worker.accept(["item-0"], {"store": worker.identity, "mac": mac}) == "item-0"
        assert worker.accept(("item-0",), {"store": worker.identity, "mac": mac}) == "item-0"
        malformed = "not a mklang task (a run name, the store's identity and a MAC)"
        for args, kwargs in [
            ("item-0", {"store": worker.identity, "mac": mac}),
            ([], {"store": worker.identity, "mac": mac}),
            (["item-0", "item-1"], {"store": worker.identity, "mac": mac}),
            ([7], {"store": worker.identity, "mac": mac}),
            (["item-0"], [worker.identity, mac]),
            (["item-0"], {"store": worker.identity}),
            (["item-0"], {"store": worker.identity, "mac": mac, "more": ""}),
            (["item-0"], {"store": worker.identity, "mac": 7}),
        ]:
            assert refusal(worker, args, kwargs, capfd) == malformed, (args, kwargs)
        other = "f" * 60
        assert refusal(worker, ["item-0"], {"store": other, "mac": mac}, capfd) == (
            f"it names another store ({other[:40]!r}) than this worker's"
        )
        outside = refusal(worker, ["../x"], {"store": worker.identity, "mac": task_mac(worker.identity, "../x")}, capfd)
        assert outside is not None and outside.startswith("the message: ")
        unsigned = "run item-1: the message is not signed with the fleet's checkpoint key"
        for forged in (mac, "é" * 64, ""):  # another run's MAC, not ASCII, none
            assert refusal(worker, ["item-1"], {"store": worker.identity, "mac": forged}, capfd) == unsigned
    finally:
        worker.store.close()


def test_a_run_without_a_good_record_is_failed_with_why(project):
    worker = worker_of(project)
    try:
        missing = worker.run("item-0")
        assert (missing.status, missing.reason) == (
            "failed",
            "run item-0: the store holds no run record for it (was it enqueued by a batch?)",
        )
        write_signed(worker.store, record_key("item-0"), {"machine": "twostep.mk"})
        malformed = worker.run("item-0")
        assert (malformed.status, malformed.reason) == (
            "failed",
            "run item-0: malformed run record: KeyError: 'ceilings'",
        )
        worker.store.write_note(record_key("item-0"), b'{"machine": "twostep.mk"}')
        unsigned = worker.run("item-0")
        assert unsigned.status == "failed" and unsigned.reason.startswith("the run record of item-0 is ")
    finally:
        worker.store.close()


def test_a_report_is_failed_unless_the_fleet_key_signed_it_for_its_run_and_a_result_is_read_from_the_run(project):
    """Whoever can write the store but has no key: one run's signed report copied onto another's,
    a report written unsigned; and a signed report saying done or halted of a run that never ran.
    The batch reports the first two failed, and reads the result of the others from their runs."""
    require_server("RabbitMQ")
    worker = worker_of(project)
    claims = {"item-3": "done", "item-4": "halted"}

    def forge(worker: Worker, run: str) -> None:
        if run == "item-0":
            run_and_report(worker, run)
        elif run == "item-1":
            worker.store.write_note(report_key(run), worker.store.read_note(report_key("item-0")) or b"")
        elif run == "item-2":
            worker.store.write_note(report_key(run), b'{"outcome": {"run": "item-2", "status": "done"}}')
        else:
            worker.report(Outcome(run, claims[run], None, "forged"))

    items = [Item(f"item-{n}", {"topic": f"t-{n}"}) for n in range(5)]
    try:
        thread, followed = follow(project, items)
        take(worker, 5, forge)
        thread.join(timeout=60)
        ((first),) = followed
        assert [(o.run, o.status, o.result) for o in first[:3]] == [
            ("item-0", "done", "word"),
            ("item-1", "failed", None),
            ("item-2", "failed", None),
        ]
        assert first[1].reason == "the worker's report of run item-1 is about another run"
        assert first[2].reason == "the worker's report of run item-2 is not signed"
        never_ran = outcome(worker.store, "item-3")
        assert never_ran.status not in ("done", "halted")
        assert first[3:] == [never_ran, outcome(worker.store, "item-4")]
        with pytest.raises(CheckpointError) as unsigned:
            read_note(worker.store, "item-2")
        assert str(unsigned.value) == "the worker's report of run item-2 is not signed"
    finally:
        drop_queue(f"sqlite:///{project}/runs.db")
        worker.store.close()


def test_a_records_ceilings_read_back_as_the_batch_wrote_them():
    for ceilings in (Ceilings(), Ceilings(max_tokens=40), Ceilings(max_cost=1.5), Ceilings(7, 0.25)):
        assert Ceilings.from_json(ceilings.to_json()) == ceilings
    assert Ceilings.from_json({}) == Ceilings()  # a record without ceilings: none
