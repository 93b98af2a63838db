"""A worker's side of `batch --executor celery`, in this process: the messages it accepts, the runs
it runs from their signed records, the reports a batch follows.

The batch enqueues on the real RabbitMQ and follows the real SQLite store
(`enqueue_and_follow`); this process takes each message off the queue as
Celery's consumer would and hands it to a `Worker`, so what the worker does
is observed without a worker process. The model is a scripted one.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import celery  # noqa: F401  (imported here, not on the batch's thread while this one imports kombu)
import pytest
from kombu import Connection, Exchange, Queue
from support.batches import MACHINE
from support.commands import model_config
from support.fleet import RABBITMQ, drop_queue
from support.fleet import fleet_key as fleet_key  # a fixture, autouse
from support.services import require_server

from mklang import distributed
from mklang.batching import Ceilings, Item, batch_id
from mklang.distributed import (
    TASK,
    CeleryWorker,
    RunLogFormatter,
    Worker,
    celery_app,
    celery_worker,
    enqueue_and_follow,
    log_runs,
    queue_for,
    read_note,
    task_mac,
)
from mklang.errors import CheckpointError, UsageError
from mklang.providers.base import Usage
from mklang.runs import Outcome, outcome, read_signed, record_key, report_key, write_signed
from mklang.session import Host
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


def delivered(worker: Worker, count: int) -> Iterator[tuple[Any, Any]]:
    """The next `count` messages of the worker's queue, as Celery hands them to the task: (args, kwargs);
    each is acknowledged once handled."""
    name = queue_for(worker.store)
    with Connection(RABBITMQ) as connection:
        queue = Queue(name, Exchange(name), routing_key=name)(connection.default_channel)  # as Celery declares it
        queue.declare()
        deadline = time.monotonic() + 60
        for got in range(count):
            while (message := queue.get()) is None:
                assert time.monotonic() < deadline, f"{got} of {count} messages came"
                time.sleep(0.05)
            assert message.headers["task"] == TASK  # what Celery hands the task registered under that name
            args, kwargs, _ = message.payload
            try:
                yield args, kwargs
            finally:
                message.ack()


def take(worker: Worker, count: int, handle: Callable[[Worker, str], None] = run_and_report) -> list[str | None]:
    """Take `count` messages off the worker's queue and `handle` each run the worker accepts (by
    default: run it and report it); the runs accepted, None for each refused."""
    taken: list[str | None] = []
    for args, kwargs in delivered(worker, count):
        run = worker.accept(args, kwargs)
        if run is not None:
            handle(worker, run)
        taken.append(run)
    return taken


def follow(
    project: Path, items: list[Item], budgets: dict[str, Any] | None = None, machine: str = "twostep.mk", **options: Any
) -> tuple[threading.Thread, list[list[Outcome]]]:
    """`enqueue_and_follow` of the project's `machine` on a thread of its own (it returns once every run is reported)."""
    followed: list[list[Outcome]] = []
    loaded = load_file(project / machine)
    options = {"stall": 60, **options}

    def batch() -> None:
        store = open_store(f"sqlite:///{project}/runs.db")
        try:
            followed.append(enqueue_and_follow(RABBITMQ, store, loaded, items, budgets or {}, **options))
        finally:
            store.close()

    thread = threading.Thread(target=batch, daemon=True)  # a failed test does not wait for it
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
        write_signed(worker.store, record_key("item-0"), {"run": "item-0", "machine": "twostep.mk"})
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


# --- what `mklang worker` configures, and what it says and logs ------------------------------------


@pytest.fixture
def run_log() -> Iterator[Callable[[str], None]]:
    """`log_runs` as `mklang worker --log-format` calls it (the suite's conftest restores the logger afterwards)."""
    yield log_runs


@pytest.fixture
def served(project: Path) -> Iterator[CeleryWorker]:
    """The Celery side of a worker of the project's store (not started), whose observer keeps the events
    of its runs; Celery's loggers and signals forget it afterwards."""
    from celery.signals import worker_ready, worker_shutting_down

    require_server("RabbitMQ")
    settings = {"script": str(project / "script.yaml"), "scenario": "words"}
    configured = celery_worker(
        RABBITMQ, f"sqlite:///{project}/runs.db", concurrency=3, host_settings=settings, observer=Events()
    )
    try:
        yield configured
    finally:
        worker_shutting_down.disconnect(configured.worker.stop)
        worker_ready.disconnect(distributed._say_malformed_messages)
        logging.getLogger("celery.app.trace").removeFilter(distributed._not_given_back)
        logging.getLogger("celery.worker.consumer.consumer").removeFilter(distributed._refused_by_celery)
        drop_queue(f"sqlite:///{project}/runs.db")
        configured.worker.store.close()


def said(capfd: pytest.CaptureFixture[str]) -> list[str]:
    """What the worker said on its stderr since last asked, without the `mklang worker PID: ` prefix."""
    prefix = f"mklang worker {os.getpid()}: "
    lines = capfd.readouterr().err.splitlines()
    assert all(line.startswith(prefix) for line in lines), lines
    return [line.removeprefix(prefix) for line in lines]


def test_a_worker_consumes_its_stores_queue_on_threads_and_acknowledges_a_run_once_it_stopped(served):
    import celery._state

    worker, app, options = served.worker, served.app, served.options
    assert options == {
        "pool_cls": "threads",
        "concurrency": 3,
        "loglevel": "WARNING",
        "queues": [queue_for(worker.store)],  # where the batches of its store enqueue
        "without_gossip": True,
        "without_mingle": True,
        "hostname": f"mklang-{os.getpid()}@{socket.gethostname()}",
    }
    conf = app.conf
    assert (conf.task_acks_late, conf.task_reject_on_worker_lost, conf.worker_prefetch_multiplier) == (True, True, 1)
    assert (conf.task_ignore_result, conf.task_serializer, conf.accept_content) == (True, "json", ["json"])
    assert conf.broker_connection_retry_on_startup is True and conf.worker_hijack_root_logger is False
    assert conf.broker_transport_options == {"visibility_timeout": 3600}
    assert app.main == "mklang" and celery._state.get_current_app() is not app


def test_the_task_a_batch_sends_runs_each_run_logs_it_in_json_and_reports_it(
    project, served, run_log, capfd, caplog, monkeypatch
):
    """The batch follows without a stall timeout, told of each run as it is reported; the worker's run
    lines go to its process's stderr even where Celery redirected `sys.stderr` to its own logger."""
    worker, app = served.worker, served.app
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    run_log("json")
    items = [Item(f"item-{n}", {"topic": f"t-{n}"}) for n in range(2)]
    told: list[Outcome] = []
    thread, followed = follow(project, items, stall=None, on_outcome=told.append)
    for args, kwargs in delivered(worker, 2):
        app.tasks[TASK](*args, **kwargs)
    thread.join(timeout=60)
    assert [(o.run, o.status, o.result) for o in followed[0]] == [
        ("item-0", "done", "word"),
        ("item-1", "done", "word"),
    ]
    assert sorted(told, key=lambda o: o.run) == followed[0]
    assert [event.run for event in worker.observer.events if event.kind == "run.finished"] == ["item-0", "item-1"]
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines()]
    for line in lines:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", line.pop("time")), line
    fields = {"level": "INFO", "worker": worker.name}
    finished = {"status": "done", "reason": None, "tokens": 30, "cost_usd": 0.0}
    assert lines == [
        {**fields, "event": "run-taken", "run": "item-0"},
        {**fields, "event": "run-finished", "run": "item-0", **finished},
        {**fields, "event": "run-taken", "run": "item-1"},
        {**fields, "event": "run-finished", "run": "item-1", **finished},
    ]
    assert not [record for record in caplog.records if record.name == "mklang"]  # not again through the root logger


def test_a_run_a_worker_cannot_set_up_is_one_line_logged_failed_in_text_and_reported(project, run_log, capfd):
    worker = worker_of(project)
    try:
        run_log("text")
        worker.take(["item-9"], {"store": worker.identity, "mac": task_mac(worker.identity, "item-9")})
        why = "run item-9: the store holds no run record for it (was it enqueued by a batch?)"
        err = capfd.readouterr().err.splitlines()
        stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00 INFO "
        assert len(err) == 3 and re.fullmatch(stamp + f'run-taken run="item-9" worker="{worker.name}"', err[0])
        assert re.fullmatch(
            stamp
            + f'run-finished run="item-9" worker="{worker.name}" status="failed" '
            f'reason="{why}" tokens=0 cost_usd=0.0'.replace("?", r"\?")
            .replace("(", r"\(")
            .replace(")", r"\)"),
            err[1],
        ), err[1]
        assert err[2] == f"mklang worker {os.getpid()}: run item-9 failed: {why}"
        note = read_note(worker.store, "item-9")
        assert note is not None and note["worker"] == worker.name
        assert Outcome.from_json(note["outcome"]) == Outcome("item-9", "failed", why)
    finally:
        worker.store.close()


def test_a_run_line_is_one_ascii_json_object_or_one_text_line_with_control_characters_escaped():
    fields = {"run": "item-1", "reason": "café\n\x1b[31mred", "at": Path("/x")}
    record = logging.makeLogRecord({"msg": "run-finished", "levelname": "INFO", "created": 0.0, "mklang": fields})
    line = RunLogFormatter(as_json=True).format(record)
    assert line.isascii() and "\n" not in line
    assert json.loads(line) == {
        "time": "1970-01-01T00:00:00+00:00",
        "level": "INFO",
        "event": "run-finished",
        "run": "item-1",
        "reason": "café\n\x1b[31mred",
        "at": "/x",  # a value JSON has no form for: its text
    }
    text = RunLogFormatter(as_json=False).format(record)
    assert (
        text == '1970-01-01T00:00:00+00:00 INFO run-finished run="item-1" reason="caf\\u00e9\\n\\u001b[31mred" at="/x"'
    )
    plain = logging.makeLogRecord({"msg": "worker-ready", "levelname": "WARNING", "created": 0.0})
    assert RunLogFormatter(as_json=False).format(plain) == "1970-01-01T00:00:00+00:00 WARNING worker-ready"
    assert json.loads(RunLogFormatter(as_json=True).format(plain))["event"] == "worker-ready"


def test_a_warm_shutdown_gives_each_run_back_to_the_queue_unreported(project, served, run_log, capfd):
    from celery.exceptions import Reject
    from celery.signals import worker_shutting_down

    worker, app, options = served.worker, served.app, served.options
    thread, _ = follow(project, [Item("item-0", {"topic": "t-0"})], stall=0.5)
    message = next(delivered(worker, 1))
    worker_shutting_down.send(sender=options["hostname"], sig="SIGTERM", how="Warm", exitcode=0)
    assert worker.stopping.is_set()
    assert said(capfd) == ["stopping: every run suspends at its next loop-top and goes back to the queue"]
    run_log("json")
    with pytest.raises(Reject) as given_back:
        app.tasks[TASK](*message[0], **message[1])
    assert (given_back.value.reason, given_back.value.requeue) == ("item-0: suspended by the worker's shutdown", True)
    err = capfd.readouterr().err.splitlines()
    assert [json.loads(line)["event"] for line in err[:2]] == ["run-taken", "run-finished"]
    assert (json.loads(err[1])["status"], json.loads(err[1])["reason"]) == ("pending", "interrupted")
    assert err[2:] == [
        f"mklang worker {os.getpid()}: run item-0: suspended by the worker's shutdown, back to the queue"
    ]
    assert read_note(worker.store, "item-0") is None
    thread.join(timeout=60)


def test_a_run_another_process_holds_is_waited_for_then_left_to_it_unreported(project, monkeypatch, capfd):
    require_server("RabbitMQ")
    worker = worker_of(project)
    try:
        thread, followed = follow(project, [Item("item-0", {"topic": "t-0"}), Item("item-1", {"topic": "t-1"})])
        messages = list(delivered(worker, 2))
        held = worker.store.lock("item-0")
        tries: list[str] = []
        lock = worker.store.lock

        def released_at_the_second_try(run: str) -> Any:
            tries.append(run)
            if len(tries) == 2:
                held.release()  # its holder ended while the worker waited
            return lock(run)

        monkeypatch.setattr(worker.store, "lock", released_at_the_second_try)
        assert worker.run("item-0") == outcome(worker.store, "item-0") and tries == ["item-0"] * 2
        assert outcome(worker.store, "item-0").status == "done"
        run_and_report(worker, "item-0")
        other = worker.store.lock("item-1")
        monkeypatch.setattr(distributed, "BUSY_SECONDS", 0)
        try:
            worker.take(*messages[1])
        finally:
            other.release()
        (line,) = said(capfd)
        assert line.startswith("run item-1: ") and line.endswith("; left to that process"), line
        assert read_note(worker.store, "item-1") is None
        run_and_report(worker, "item-1")
        thread.join(timeout=60)
        assert [o.status for o in followed[0]] == ["done", "done"]
    finally:
        drop_queue(f"sqlite:///{project}/runs.db")
        worker.store.close()


def test_a_warm_shutdown_while_a_worker_waits_for_a_held_run_ends_the_wait_at_once(project, monkeypatch):
    require_server("RabbitMQ")
    worker = worker_of(project)
    try:
        thread, _ = follow(project, [Item("item-0", {"topic": "t-0"})], stall=0.5)
        take(worker, 1, lambda worker, run: None)  # enqueued: its record is in the store
        held = worker.store.lock("item-0")
        lock = worker.store.lock

        def stopped_at_the_first_try(run: str) -> Any:
            worker.stopping.set()  # SIGTERM came while the worker tried the run
            return lock(run)

        monkeypatch.setattr(worker.store, "lock", stopped_at_the_first_try)
        try:
            busy = worker.run("item-0")
        finally:
            held.release()
        assert busy.status == "pending" and "the run is still going in process" in str(busy.reason), busy
        thread.join(timeout=60)
    finally:
        drop_queue(f"sqlite:///{project}/runs.db")
        worker.store.close()


def test_a_dollar_limit_a_scripted_model_has_no_price_for_fails_the_run_naming_its_option(project):
    """A run's --max-cost, else the batch's --batch-max-cost: the one the run is held to is named."""
    require_server("RabbitMQ")
    worker = worker_of(project)
    needs = "needs model prices, and a scripted model has none: use --max-tokens"
    try:
        for budgets, ceilings, option in (({"max_cost": 0.5}, Ceilings(max_cost=2.0), "--max-cost"),
                                          ({}, Ceilings(max_cost=2.0), "--batch-max-cost")):  # fmt: skip
            item = Item(f"item-{option}", {"topic": "t"})
            thread, followed = follow(project, [item], budgets, ceilings=ceilings)
            take(worker, 1)
            thread.join(timeout=60)
            assert followed[0] == [Outcome(item.run, "failed", f"{option} {needs}")]
    finally:
        drop_queue(f"sqlite:///{project}/runs.db")
        worker.store.close()


class Events:
    """An observer that keeps every event (with prompts), and fails the run at one kind if told to."""

    trace_content = True

    def __init__(self, fail_at: str | None = None):
        self.events: list[Any] = []
        self.fail_at = fail_at

    def emit(self, event: Any) -> None:
        self.events.append(event)
        if event.kind == self.fail_at:
            raise RuntimeError("the events file is full\nsecond line")


def test_a_workers_observer_sees_each_run_named_under_its_records_budgets_context_and_hitl(project):
    require_server("RabbitMQ")
    events = Events()
    worker = Worker(
        f"sqlite:///{project}/runs.db", {"script": str(project / "script.yaml"), "scenario": "words"}, events
    )
    try:
        thread, followed = follow(project, [Item("item-0", {"topic": "t-7"})], {"max_tokens": 100}, hitl=True)
        take(worker, 1)
        thread.join(timeout=60)
        assert [o.status for o in followed[0]] == ["done"]
        started = events.events[0]
        assert (started.kind, started.run, started.max_tokens, started.hitl) == ("run.started", "item-0", 100, True)
        prompts = [event.prompt for event in events.events if event.kind == "model.started"]
        assert [(prompt["user"].split()[0], "\nt-7\n" in prompt["user"]) for prompt in prompts] == [
            ("first", True),
            ("second", True),
        ]
    finally:
        drop_queue(f"sqlite:///{project}/runs.db")
        worker.store.close()


def test_a_fault_of_the_worker_fails_the_run_with_why_and_logs_its_traceback(project, caplog):
    require_server("RabbitMQ")
    events = Events(fail_at="run.started")
    worker = Worker(
        f"sqlite:///{project}/runs.db", {"script": str(project / "script.yaml"), "scenario": "words"}, events
    )
    try:
        thread, followed = follow(project, [Item("item-0", {"topic": "t-0"})])
        take(worker, 1)
        thread.join(timeout=60)
        why = f"internal error on worker {worker.name}: the events file is full"
        assert followed[0] == [Outcome("item-0", "failed", why)]
        assert events.events[0].hitl is False  # a batch without hitl
        (logged,) = [record for record in caplog.records if record.name == "mklang.worker"]
        assert (logged.levelname, logged.getMessage()) == ("ERROR", "run item-0 failed on an internal error")
        assert logged.exc_info is not None and str(logged.exc_info[1]).startswith("the events file is full")
    finally:
        drop_queue(f"sqlite:///{project}/runs.db")
        worker.store.close()


def test_what_celery_would_log_of_a_refused_message_or_a_run_given_back_is_one_line_or_nothing(served, capfd, caplog):
    from celery.app.trace import report_internal_error
    from celery.exceptions import Reject
    from celery.worker.consumer.consumer import INVALID_TASK_ERROR, MESSAGE_DECODE_ERROR, UNKNOWN_TASK_ERROR

    app = served.app
    consumer = logging.getLogger("celery.worker.consumer.consumer")
    consumer.error(UNKNOWN_TASK_ERROR, KeyError("x.y"), "{'body': 1}", {}, {})
    consumer.error(INVALID_TASK_ERROR, "missing task id", "{'body': 1}")
    consumer.critical(
        MESSAGE_DECODE_ERROR, "ContentDisallowed('pickle')", "application/x-python-serialize", "binary", "{}", ""
    )
    consumer.error("consumer: cannot connect to amqp://127.0.0.1:5672//")
    assert said(capfd) == [
        "refused a task message: Received unregistered task of type 'x.y'.",
        "refused a task message: Received invalid task message: missing task id",
        "refused a task message: Can't decode message body: \"ContentDisallowed('pickle')\"",
    ]
    assert [record.getMessage() for record in caplog.records] == ["consumer: cannot connect to amqp://127.0.0.1:5672//"]
    caplog.clear()
    trace = logging.getLogger("celery.app.trace")
    for error in (Reject("item-0: suspended by the worker's shutdown", requeue=True), RuntimeError("boom")):
        try:
            raise error
        except Exception:
            trace.error("Task %s raised", TASK, exc_info=True)
    assert [record.exc_info[1] for record in caplog.records if record.exc_info] == [error]  # the RuntimeError only
    # Arguments Celery cannot hand to the task: Celery warns with a traceback once its worker is ready.
    from celery.signals import worker_ready

    shown: list[tuple[str, type[Warning]]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, *_, **__: shown.append((str(message), category))
        worker_ready.send(sender=None)
        try:
            raise TypeError("run_item() argument after ** must be a mapping, not list")
        except TypeError as error:
            report_internal_error(app.tasks[TASK], error)
        warnings.warn("something else", UserWarning, stacklevel=1)
        warnings.warn("Exception raised outside body of something else", UserWarning, stacklevel=1)
    assert said(capfd) == [
        "refused a task message: TypeError('run_item() argument after ** must be a mapping, not list'):"
    ]
    assert shown == [("something else", UserWarning), ("Exception raised outside body of something else", UserWarning)]


def test_a_batch_no_worker_serves_stops_following_after_its_stall_with_the_runs_left_queued(project):
    """Of an earlier pass, the first item was done and the second failed (its report is still there).
    The first is told at once and its spend counts against the new pass's ceilings; the second waits for
    a new report, told how long none came, until the stall. A worker that comes later runs it."""
    require_server("RabbitMQ")
    worker = worker_of(project)
    first, second = Item("item-0", {"topic": "t-0"}), Item("item-1", {"topic": "t-1"})
    try:
        for item, budgets in ((first, {}), (second, {"max_cost": 0.5})):
            thread, _ = follow(project, [item], budgets)
            take(worker, 1)
            thread.join(timeout=60)
        assert outcome(worker.store, "item-1").status == "pending"  # failed on the worker: never started
        told: list[Outcome] = []
        waited: list[float] = []
        machine = load_file(project / "twostep.mk")
        items = [first, second]
        outcomes = enqueue_and_follow(
            RABBITMQ, worker.store, machine, items, {}, ceilings=Ceilings(max_tokens=1000), stall=0.5,
            on_outcome=told.append, on_wait=waited.append,
        )  # fmt: skip
        done = outcome(worker.store, "item-0")
        assert done.status == "done"
        assert outcomes == [done, Outcome("item-1", "pending", "no worker reported it within 0.5s")]
        assert told == [done]
        assert waited and all(0 < idle < 60 for idle in waited) and waited == sorted(waited)
        assert waited[-1] >= 0.5
        assert worker.store.spend(batch_id(items)) == (30, 0.0)
        record = read_signed(worker.store, record_key("item-1"), "the record")
        assert record is not None and (record["batch"], record["hitl"]) == (batch_id(items), False)
        take(worker, 1)
        assert outcome(worker.store, "item-1").status == "done"
        assert worker.store.spend(batch_id(items)) == (60, 0.0)  # the worker counts its spend in the batch
    finally:
        drop_queue(f"sqlite:///{project}/runs.db")
        worker.store.close()


def test_a_worker_builds_a_real_provider_once_per_dollar_limit_and_refuses_a_limit_it_has_no_price_for(tmp_path):
    config = model_config("http://127.0.0.1:1/v1", tmp_path / "mklang.toml")
    worker = Worker(f"sqlite:///{tmp_path}/runs.db", {"config": str(config)})
    try:
        with worker.host_for(None, "max_cost") as one, worker.host_for(None, "max_cost") as two:
            assert isinstance(one, Host) and one is two  # its HTTP client and connections shared by the runs
        for limit, setting, option in ((0.5, "max_cost", "--max-cost"), (2.0, "batch_max_cost", "--batch-max-cost")):
            with pytest.raises(UsageError, match=f"^{option} needs a price for local:m"):
                worker.host_for(limit, setting)
    finally:
        worker.store.close()


def test_a_scripted_worker_gives_each_run_a_host_of_its_own(project):
    """A scenario's answers are consumed run by run: runs sharing one host would share its place in them."""
    worker = worker_of(project)
    try:
        with worker.host_for(None, "max_cost") as one, worker.host_for(None, "max_cost") as two:
            assert isinstance(one, Host) and isinstance(two, Host) and one is not two
    finally:
        worker.store.close()


def test_a_worker_runs_each_batch_with_its_own_machine(project):
    """Three batches: another machine file, then the first file edited since its batch."""
    require_server("RabbitMQ")
    (project / "onestep.mk").write_text(
        MACHINE.replace("twostep", "onestep").split("state two")[0].replace("-> two", "-> END")
    )
    events = Events()
    worker = Worker(
        f"sqlite:///{project}/runs.db", {"script": str(project / "script.yaml"), "scenario": "words"}, events
    )
    try:
        for n, machine in enumerate(("twostep.mk", "onestep.mk", "twostep.mk")):
            if n == 2:
                (project / machine).write_text(MACHINE.replace("machine twostep", "machine renamed"))
            thread, followed = follow(project, [Item(f"item-{n}", {"topic": "t-1"})], machine=machine)
            take(worker, 1)
            thread.join(timeout=60)
            assert [o.status for o in followed[0]] == ["done"]
        started = [(event.run, event.machine) for event in events.events if event.kind == "run.started"]
        assert started == [("item-0", "twostep"), ("item-1", "onestep"), ("item-2", "renamed")]
    finally:
        drop_queue(f"sqlite:///{project}/runs.db")
        worker.store.close()


def test_a_batch_whose_machine_file_is_gone_says_it_cannot_keep_its_text(project):
    require_server("RabbitMQ")
    store = open_store(f"sqlite:///{project}/runs.db")
    machine = load_file(project / "twostep.mk")
    (project / "twostep.mk").unlink()
    try:
        with pytest.raises(CheckpointError) as refused:
            enqueue_and_follow(RABBITMQ, store, machine, [Item("item-0", {})], {})
        assert str(refused.value) == (
            f"the batch: cannot keep the text of {project / 'twostep.mk'} in the store: No such file or directory"
        )
    finally:
        store.close()


@pytest.mark.parametrize(
    ("broker", "why"),
    [
        ("127.0.0.1:5672", "unknown broker URL scheme ''"),
        ("redis://127.0.0.1:1/0?fallback=amqp://x", "cannot reach the broker: "),
    ],
)
def test_a_broker_url_is_refused_with_what_to_do(broker, why):
    with pytest.raises(UsageError) as refused:
        celery_app(broker)
    assert str(refused.value).startswith(f"{broker}: {why}")
    if why.startswith("cannot reach"):
        assert str(refused.value).endswith("(is it running, and the URL's host, port, user and password right?)")


def test_a_worker_without_celery_installed_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "celery", None)  # as where the `distributed` extra is not installed
    with pytest.raises(UsageError) as refused:
        celery_app(RABBITMQ)
    assert str(refused.value) == "workers need Celery: pip install 'mklang[distributed]>=2'"


def test_a_garbled_store_identity_is_read_as_text_with_the_garbled_bytes_replaced(tmp_path):
    store = open_store(f"sqlite:///{tmp_path}/runs.db")
    try:
        store.add_note(distributed.IDENTITY, b"\xff\xfeab")
        assert queue_for(store) == "mklang-\ufffd\ufffdab"
    finally:
        store.close()


def test_a_worker_runs_the_texts_the_store_keeps_of_an_edited_machine_and_says_so_once(project, capfd):
    require_server("RabbitMQ")
    worker = worker_of(project)
    try:
        items = [Item(f"item-{n}", {"topic": f"t-{n}"}) for n in range(2)]
        thread, followed = follow(project, items)
        messages = list(delivered(worker, 2))  # enqueued: the record signs the texts as they were
        (project / "twostep.mk").write_text("mklang 0.4\nnot a machine\n", encoding="utf-8")
        for args, kwargs in messages:
            worker.take(args, kwargs)
        thread.join(timeout=60)
        assert [o.status for o in followed[0]] == ["done", "done"]
        (line,) = said(capfd)
        assert line.startswith(f"{project / 'twostep.mk'} differs from the run's; running the machine texts the store")
    finally:
        drop_queue(f"sqlite:///{project}/runs.db")
        worker.store.close()


def test_a_worker_resumes_a_run_whose_machine_file_was_edited_since_from_the_texts_the_store_keeps(project, capfd):
    """Suspended at the batch's ceiling after its first call, the run is resumed by the next pass with a
    higher ceiling, after someone broke the machine file: the worker that takes it (another than the
    first) runs the text the run started with."""
    require_server("RabbitMQ")
    first, worker = worker_of(project), worker_of(project)
    item = Item("item-0", {"topic": "t-0"})
    try:
        thread, followed = follow(project, [item], ceilings=Ceilings(max_tokens=10))
        take(first, 1)
        thread.join(timeout=60)
        assert [(o.status, o.reason) for o in followed[0]] == [("suspended", "batch-ceiling")]
        thread, followed = follow(project, [item], ceilings=Ceilings(max_tokens=1000))
        messages = list(delivered(worker, 1))
        (project / "twostep.mk").write_text("mklang 0.4\nnot a machine\n", encoding="utf-8")
        capfd.readouterr()
        worker.take(*messages[0])
        thread.join(timeout=60)
        assert [(o.status, o.result) for o in followed[0]] == [("done", "word")]
        (line,) = said(capfd)
        assert line.startswith(f"{project / 'twostep.mk'} differs from the run's; running the machine texts")
    finally:
        drop_queue(f"sqlite:///{project}/runs.db")
        first.store.close()
        worker.store.close()


def test_a_run_record_copied_from_another_run_is_not_run(project):
    """Whoever can write the store but has no key copies one run's signed record under another's name."""
    require_server("RabbitMQ")
    worker = worker_of(project)
    try:
        thread, _ = follow(project, [Item("item-0", {"topic": "t-0"})], stall=0.5)
        take(worker, 1, lambda worker, run: None)
        thread.join(timeout=60)
        worker.store.write_note(record_key("item-1"), worker.store.read_note(record_key("item-0")) or b"")
        copied = worker.run("item-1")
        assert copied == Outcome("item-1", "failed", "run item-1: the run record is about another run")
        assert outcome(worker.store, "item-1").status == "pending"  # never started
    finally:
        drop_queue(f"sqlite:///{project}/runs.db")
        worker.store.close()


def test_a_run_record_a_worker_cannot_read_fails_that_run_with_why(project):
    worker = worker_of(project)
    try:
        write_signed(worker.store, record_key("item-0"), {"run": "item-0", "machine": "twostep.mk", "ceilings": {}})
        assert worker.run("item-0") == Outcome(
            "item-0", "failed", "run item-0: malformed run record: KeyError: 'budgets'"
        )
    finally:
        worker.store.close()
