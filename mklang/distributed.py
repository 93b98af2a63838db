"""Runs on Celery workers (the `distributed` extra): `mklang worker` and `batch --executor celery`.

Celery carries only "run this item"; every run's state lives in the store,
so any worker can start or resume any run, and `mklang batch` follows the
batch by reading the store, not Celery's results. Messages are acknowledged
late (after the run stopped) with a prefetch of one, and rejected back to the
queue when a worker is lost: a worker killed by SIGKILL has its runs
redelivered, and the worker that takes one resumes it from its last
loop-top, answering completed calls from the journal. SIGTERM interrupts
every run at its next loop-top (they suspend) and gives them back to the
queue. The run's lock, which dies with its process, keeps a redelivered
message from running a run that another worker still runs.

Nothing on the broker is trusted (ADR 0024). A message names a run and the
store's identity, and carries a MAC made with the fleet's checkpoint key;
everything else (the machine, the context, the budgets, the batch and its
ceilings, hitl) is read from the run's record in the store, which is signed
with the same key, and the machines are the texts the store keeps under the
sha256 the record signs. A worker's report of a run is signed too.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mklang.batching import Batch, Ceilings, Item, StoreLedger, batch_id
from mklang.checkpoint.texts import keep_texts, machine_root
from mklang.engine.events import EventSink
from mklang.errors import CheckpointError, MklangError, UsageError, first_line, redacted
from mklang.model import Machine
from mklang.providers.base import Usage
from mklang.runs import (
    Outcome,
    RunRequest,
    build_host,
    fleet_mac,
    outcome,
    read_signed,
    record_key,
    report_key,
    verified,
    write_signed,
)
from mklang.runs.pooling import require_pool
from mklang.stores import Store, open_note_store, run_name
from mklang.terminal import printable

if TYPE_CHECKING:
    from mklang.session import Host

TASK = "mklang.run_item"
POLL_SECONDS = 0.25
BUSY_SECONDS = 10  # how long a worker waits for a run another process holds before leaving it to that process
# Redis (not RabbitMQ) redelivers an unacknowledged message only after this
# many seconds: a run must finish within it, or it is delivered twice (the run
# lock then refuses the second delivery while the first still runs).
REDIS_VISIBILITY_TIMEOUT = 3600
_log = logging.getLogger("mklang.worker")
_runs_log = logging.getLogger("mklang")  # one line per run taken and per run finished (docs/runs.md)
LOG_FORMATS = ("text", "json")


class RunLogFormatter(logging.Formatter):
    """A run line of the `mklang` logger: `time LEVEL event key=value ...`, or one JSON object."""

    def __init__(self, as_json: bool):
        super().__init__()
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        from datetime import UTC, datetime

        fields = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="seconds"),
            "level": record.levelname,
            "event": record.getMessage(),
            **getattr(record, "mklang", {}),
        }
        if self.as_json:
            return json.dumps(fields, ensure_ascii=True, default=str)
        head = f"{fields.pop('time')} {fields.pop('level')} {fields.pop('event')}"
        return printable(head + "".join(f" {key}={json.dumps(value, default=str)}" for key, value in fields.items()))


def log_runs(log_format: str) -> None:
    """Send the `mklang` logger's run lines to stderr (INFO and up), as text or JSON lines."""
    handler = logging.StreamHandler(sys.__stderr__)
    handler.setFormatter(RunLogFormatter(log_format == "json"))
    _runs_log.addHandler(handler)
    _runs_log.setLevel(logging.INFO)
    _runs_log.propagate = False


def _log_run(event: str, run: str, worker: str, done: Outcome | None = None) -> None:
    fields: dict[str, Any] = {"run": run, "worker": worker}
    if done is not None:
        usage = Usage.from_json(done.usage) if done.usage else Usage()
        fields.update(status=done.status, reason=done.reason, tokens=usage.tokens, cost_usd=usage.cost_usd)
    _runs_log.info(event, extra={"mklang": fields})


_said = threading.Lock()


def _say(line: str) -> None:
    """One whole line on the worker's stderr (its log), whatever Celery did with logging; control
    characters of run ids or reasons (anyone may write a message) are shown escaped."""
    stream = sys.__stderr__
    if stream is not None:
        with _said:
            stream.write(f"mklang worker {os.getpid()}: {printable(redacted(line).replace(chr(10), ' '))}\n")
            stream.flush()


IDENTITY = "store:identity"


def store_identity(store: Store) -> str:
    """The store's identity: a random id the store gets on first use (not its URI, which two
    projects may share, as `sqlite:///runs.db`)."""
    return store.add_note(IDENTITY, uuid.uuid4().hex.encode("ascii")).decode("ascii", errors="replace")


def queue_for(store: Store) -> str:
    """The queue of a store's runs: workers and batches of one store meet there, other stores never do."""
    return _queue(store_identity(store))


def _queue(identity: str) -> str:
    """The queue of the store whose identity is `identity`."""
    return "mklang-" + identity


def task_mac(identity: str, run: str) -> str:
    """What a task message carries to show the fleet key sent it: a MAC of the store and the run."""
    return fleet_mac(f"mklang task\n{identity}\n{run}")


BROKER_SCHEMES = ("amqp", "amqps", "pyamqp", "redis", "rediss")
BROKER_FORMS = "amqp://user:password@host:5672// (RabbitMQ) or redis://host:6379/0 (Redis)"


def celery_app(broker: str) -> Any:
    """The Celery application of mklang runs on `broker`, once the broker answered.

    A misspelt or unreachable broker is one line naming it (password hidden) and what to do, at once:
    the broker is tried once, as a refused connection is refused again a moment later."""
    try:
        from celery import Celery
    except ImportError:
        raise UsageError("workers need Celery: pip install 'mklang[distributed]>=2'") from None
    shown = redacted(broker)
    scheme = broker.split("://", 1)[0].lower() if "://" in broker else ""
    if scheme not in BROKER_SCHEMES:
        raise UsageError(f"{shown}: unknown broker URL scheme {scheme!r}: a broker is {BROKER_FORMS}")
    app = Celery("mklang", broker=broker, set_as_current=False)
    try:
        with app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=0)
    except Exception as error:  # kombu's and each transport's own errors: all mean "not reached"
        raise UsageError(
            f"{shown}: cannot reach the broker: {first_line(error)} "
            "(is it running, and the URL's host, port, user and password right?)"
        ) from None
    app.conf.update(
        task_acks_late=True,  # acknowledged once the run stopped, so a lost worker's runs are redelivered
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,  # a worker holds no run it is not running
        task_ignore_result=True,  # the store is the source of truth
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": REDIS_VISIBILITY_TIMEOUT},
        worker_hijack_root_logger=False,
    )
    return app


def read_note(store: Store, run: str) -> dict[str, Any] | None:
    """What the last worker to take `run` made of it: {id, worker, outcome}; None before any did.
    A note the fleet key did not sign is CheckpointError."""
    return read_signed(store, report_key(run), f"the worker's report of run {run}")


def _reported(store: Store, run: str, raw: bytes) -> Outcome:
    """What became of a run a worker reported (its note's bytes `raw`).

    The report says that a worker is done with the run and why it stopped; a
    finished run's result is read from its verified envelope, as the local
    executor reads it. A report the fleet key did not sign, or about another
    run, is `failed`.
    """
    what = f"the worker's report of run {run}"
    try:
        told = Outcome.from_json(verified(raw, what)["outcome"])
    except (CheckpointError, KeyError, TypeError) as error:
        return Outcome(run, "failed", first_line(error))
    if told.run != run:
        return Outcome(run, "failed", f"{what} is about another run")
    return outcome(store, run) if told.status in ("done", "halted") else told


def _note_bytes(store: Store, run: str) -> bytes | None:
    return store.read_note(report_key(run))


def enqueue_and_follow(
    broker: str,
    store: Store,
    machine: Machine,
    items: Iterable[Item],
    budgets: dict[str, Any],
    *,
    ceilings: Ceilings | None = None,
    hitl: bool = False,
    stall: float | None = None,
    on_outcome: Callable[[Outcome], None] | None = None,
    on_wait: Callable[[float], None] | None = None,
) -> list[Outcome]:
    """Enqueue every item not settled yet, then follow the store until a worker reported each one.

    Each run's record (what a worker runs: machine texts, context, budgets,
    batch) is written signed before its message is sent. A worker reports a
    run by replacing its note (`read_note`), whatever became of it: done,
    halted, suspended, or failed on that worker. With `stall`,
    following ends once no run was reported for that many seconds; the runs
    not reported are then `pending` (they stay queued). `on_wait` is told, at
    every poll, how long no run was reported.
    """
    items = list(items)
    ceilings = ceilings or Ceilings()
    app = celery_app(broker)
    identity = store_identity(store)
    batch = batch_id(items)
    texts = keep_texts(store, machine, "the batch")
    record = dict(
        machine=machine.path, texts=texts, budgets=budgets, batch=batch, ceilings=ceilings.to_json(), hitl=hitl
    )
    waiting: dict[str, bytes | None] = {}  # run -> its note when it was enqueued
    finished: dict[str, Outcome] = {}
    for item in items:
        now = outcome(store, item.run)
        if ceilings.any() and now.usage:  # the batch's earlier passes count against its ceilings
            spent = Usage.from_json(now.usage)
            store.record_spend(batch, item.run, spent.tokens, spent.cost_usd)
        if now.settled:
            finished[item.run] = now
            if on_outcome is not None:
                on_outcome(now)
            continue
        waiting[item.run] = _note_bytes(store, item.run)
        write_signed(store, record_key(item.run), {**record, "run": item.run, "context": item.context})
        kwargs = {"store": identity, "mac": task_mac(identity, item.run)}
        app.send_task(TASK, args=[item.run], kwargs=kwargs, queue=_queue(identity))
    progress = time.monotonic()
    pause = POLL_SECONDS
    while waiting:
        time.sleep(pause)
        began = time.monotonic()
        for run, seen in list(waiting.items()):
            note = _note_bytes(store, run)
            if note is not None and note != seen:
                finished[run] = now = _reported(store, run, note)
                del waiting[run]
                progress = time.monotonic()
                if on_outcome is not None:
                    on_outcome(now)
        # Reading the notes of a large batch takes a while: the follower reads at most a quarter of
        # its time, leaving the CPU and the database to the runs (workers may share this host).
        pause = max(POLL_SECONDS, 3 * (time.monotonic() - began))
        idle = time.monotonic() - progress
        if waiting and on_wait is not None:
            on_wait(idle)
        if waiting and stall is not None and idle >= stall:
            for run in waiting:
                finished[run] = Outcome(run, "pending", f"no worker reported it within {stall:g}s")
            break
    return [finished[item.run] for item in items]


class Worker:
    """What a worker process shares between its runs: the store, the host settings, a stop flag."""

    def __init__(self, uri: str, host_settings: dict[str, Any], observer: EventSink | None = None):
        self.uri = uri
        self.observer = observer  # told of every run's events, each with the run's name
        self.store = open_note_store(uri, "a worker")
        self.identity = store_identity(self.store)
        try:
            require_pool(self.store, host_settings)
        except UsageError:
            self.store.close()
            raise
        self.host_settings = host_settings
        self.stopping = threading.Event()
        self.name = f"{os.getpid()}@{socket.gethostname()}"
        self._hosts: dict[float | None, Host] = {}  # by the runs' dollar budget, which the provider checks
        self._hosts_guard = threading.Lock()
        self._machines: dict[tuple[str, str], Machine] = {}  # by root file and the sha256 of every text

    def accept(self, args: Any, kwargs: Any) -> str | None:
        """The run a task message names, or None (said on stderr) when the fleet key did not send it.

        A refused message is acknowledged and dropped: it reaches no run, so it changes nothing a
        batch follows."""
        run, why = self._check_message(args, kwargs)
        if why is not None:
            _say(f"refused a task message: {why}")
            return None
        return run

    def _check_message(self, args: Any, kwargs: Any) -> tuple[str, str | None]:
        """The run a message names, and why it is refused (None: it is not)."""
        if (
            not isinstance(args, (list, tuple))
            or len(args) != 1
            or not isinstance(args[0], str)
            or not isinstance(kwargs, dict)
            or set(kwargs) != {"store", "mac"}
            or not all(isinstance(value, str) for value in kwargs.values())
        ):
            return "", "not a mklang task (a run name, the store's identity and a MAC)"
        run = args[0]
        if kwargs["store"] != self.identity:
            return run, f"it names another store ({kwargs['store'][:40]!r}) than this worker's"
        try:
            run_name(run, "the message")
        except UsageError as error:
            return run, str(error)
        if not (kwargs["mac"].isascii() and hmac.compare_digest(task_mac(self.identity, run), kwargs["mac"])):
            return run, f"run {run}: the message is not signed with the fleet's checkpoint key"
        return run, None

    def run(self, run: str) -> Outcome:
        """Start, resume or skip `run` as its signed record says; anything that keeps this worker from
        running it makes it `failed`."""
        try:
            record = read_signed(self.store, record_key(run), f"the run record of {run}")
            if record is None:
                raise CheckpointError(f"run {run}: the store holds no run record for it (was it enqueued by a batch?)")
            if record["run"] != run:  # another run's signed record, copied under this run's name
                raise CheckpointError(f"run {run}: the run record is about another run")
            ceilings = Ceilings.from_json(record["ceilings"])
            ledger = StoreLedger(ceilings, self.store, str(record["batch"])) if ceilings.any() else None
            budgets = dict(record["budgets"])
            # A dollar limit this worker's models have no price for cannot hold: the host refuses it.
            limit, priced_for = (
                (budgets["max_cost"], "max_cost")
                if budgets.get("max_cost") is not None
                else (ceilings.max_cost, "batch_max_cost")
            )
            runner = Batch(
                self.machine(str(record["machine"]), dict(record["texts"])),
                self.store,
                self.uri,
                lambda: self.host_for(limit, priced_for),
                **budgets,
                ledger=ledger,
                stop=self.stopping,
                hitl=bool(record["hitl"]),
                kept_texts=True,
                texts=dict(record["texts"]),
                observer=self.observer,
            )
            item = Item(run, dict(record["context"]))
            deadline = time.monotonic() + BUSY_SECONDS
            while True:
                done = runner.run_item(item)
                # Pending and not stopping: another process holds the run's lock. A worker killed a moment
                # ago may still hold it until its database session ends: wait a little before leaving it.
                if done.status != "pending" or self.stopping.is_set() or time.monotonic() >= deadline:
                    return done
                time.sleep(POLL_SECONDS)
        except MklangError as error:
            return Outcome(run, "failed", first_line(error))
        except (KeyError, TypeError, ValueError) as error:
            return Outcome(run, "failed", f"run {run}: malformed run record: {type(error).__name__}: {error}")
        except Exception as error:  # a fault of this worker: the run is failed, not retried forever
            _log.exception("run %s failed on an internal error", run)
            return Outcome(run, "failed", f"internal error on worker {self.name}: {first_line(error)}")

    def machine(self, root: str, texts: dict[str, str]) -> Machine:
        """The root machine a record names: its file here when every machine file matches the signed
        sha256, else the texts the store keeps (said once)."""
        from mklang.checker import require_runnable
        from mklang.syntax import load_file

        key = (root, json.dumps(texts, sort_keys=True))
        machine = self._machines.get(key)
        if machine is None:
            where, note = machine_root(self.store, Path(root), texts, changed=True)
            if note is not None:
                _say(note)
            machine = self._machines[key] = require_runnable(load_file(where))
        return machine

    def report(self, done: Outcome) -> None:
        """Tell the batch what became of a run: replace its note, signed."""
        write_signed(
            self.store, report_key(done.run), {"id": uuid.uuid4().hex, "worker": self.name, "outcome": done.to_json()}
        )

    def take(self, args: Any, kwargs: Any) -> None:
        """What the task does with a message Celery hands it: run the run it names, log it taken and
        finished, and report it; then Celery acknowledges the message (a failed run is not redelivered
        forever). A run the worker's shutdown suspended goes back to the queue (Celery's `Reject`); one
        another process holds is left to that process, which reports it when it stops."""
        from celery.exceptions import Reject

        run = self.accept(args, kwargs)
        if run is None:
            return  # acknowledged and dropped
        _log_run("run-taken", run, self.name)
        done = self.run(run)
        _log_run("run-finished", run, self.name, done)
        if done.status == "pending":
            if self.stopping.is_set():
                _say(f"run {run}: suspended by the worker's shutdown, back to the queue")
                raise Reject(f"{run}: suspended by the worker's shutdown", requeue=True)
            _say(f"run {run}: {done.reason}; left to that process")
            return
        if done.status == "failed":
            _say(f"run {run} failed: {done.reason}")
        self.report(done)

    def stop(self, **_: Any) -> None:
        """Celery's warm shutdown (SIGTERM): every run suspends at its next loop-top."""
        _say("stopping: every run suspends at its next loop-top and goes back to the queue")
        self.stopping.set()

    def host_for(self, max_cost: float | None, priced_for: str) -> AbstractContextManager[Host]:
        """A run's host; a dollar limit (`max_cost`, given as the setting `priced_for`) needs every
        model's price. A scripted host keeps a state per run, so each run gets its own; a real
        provider is thread-safe and built once, so runs share its HTTP client and connections (as
        `mklang batch` does) instead of paying a client, a TLS context and a connection each."""
        request = RunRequest(hosting=self.host_settings, max_cost=max_cost, priced_for=priced_for)
        if self.host_settings.get("script"):
            return build_host(request)
        with self._hosts_guard:
            host = self._hosts.get(max_cost)
            if host is None:
                host = self._hosts[max_cost] = build_host(request)
        return nullcontext(host)


# How Celery's consumer starts the (multi-line, traceback) log of a message it discards before any task.
_DISCARDED = ("Received unregistered task", "Received invalid task message", "Can't decode message body")


def _refused_by_celery(record: logging.LogRecord) -> bool:
    """A message Celery discards (unknown task, pickle, not JSON) is one refusal line, not Celery's report."""
    text = record.getMessage()
    if not text.startswith(_DISCARDED):
        return True
    _say(f"refused a task message: {text.splitlines()[0].split(' [type:')[0]}")
    return False


def _say_malformed_messages(**_: Any) -> None:
    """A message Celery cannot even hand to the task (its arguments are no list and map) is one
    refusal line, not the traceback Celery warns with (installed once Celery set up its logging)."""
    import warnings

    shown = warnings.showwarning

    def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        text = str(message)
        if issubclass(category, RuntimeWarning) and text.startswith("Exception raised outside body"):
            _say(f"refused a task message: {text.splitlines()[0].removeprefix('Exception raised outside body: ')}")
        else:
            shown(message, category, *args, **kwargs)

    warnings.showwarning = show


def _not_given_back(record: logging.LogRecord) -> bool:
    """A run given back to the queue is said in one line (`Worker.take`); Celery would log each with a traceback."""
    from celery.exceptions import Reject

    return not (record.exc_info and isinstance(record.exc_info[1], Reject))


@dataclass
class CeleryWorker:
    """A worker process's Celery side, configured and not started yet: the `Worker`, the Celery
    application whose task hands it the messages of its store's queue, and the options of Celery's
    worker."""

    worker: Worker
    app: Any
    options: dict[str, Any]

    def start(self) -> None:
        """Run Celery's worker until it is stopped: Celery's worker itself, not its command line, which
        imports an interactive shell (click-repl, prompt_toolkit) a worker never uses: a fifth of a
        worker's start-up CPU (about 0.15 s)."""
        self.app.Worker(**self.options).start()


def celery_worker(
    broker: str, uri: str, *, concurrency: int, host_settings: dict[str, Any], observer: EventSink | None = None
) -> CeleryWorker:
    """A Celery worker of the store at `uri`: threads (one process, so SIGKILL loses exactly its runs
    in flight), `concurrency` of them; `observer` is told of the events of every run it takes.
    Celery's warm shutdown stops the runs (`Worker.stop`); what Celery would log of a message it
    refuses or of a run given back is one line each."""
    from celery.signals import worker_ready, worker_shutting_down

    app = celery_app(broker)
    worker = Worker(uri, host_settings, observer)

    @app.task(name=TASK, bind=True, shared=False)  # this worker's, not every application's in the process
    def run_item(task: Any, *args: Any, **kwargs: Any) -> None:
        worker.take(args, kwargs)

    logging.getLogger("celery.app.trace").addFilter(_not_given_back)
    logging.getLogger("celery.worker.consumer.consumer").addFilter(_refused_by_celery)
    worker_shutting_down.connect(worker.stop)  # weakly: the task holds the worker while Celery runs
    worker_ready.connect(_say_malformed_messages)
    options = dict(
        pool_cls="threads",
        concurrency=concurrency,
        loglevel="WARNING",
        queues=[_queue(worker.identity)],
        without_gossip=True,
        without_mingle=True,
        hostname=f"mklang-{worker.name}",
    )
    return CeleryWorker(worker, app, options)
