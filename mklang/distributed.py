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
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

from mklang.batching import Batch, Item, Outcome, outcome
from mklang.checkpoint.store import Store, open_store
from mklang.errors import UsageError
from mklang.model import Machine

TASK = "mklang.run_item"
POLL_SECONDS = 0.25
# Redis (not RabbitMQ) redelivers an unacknowledged message only after this
# many seconds: a run must finish within it, or it is delivered twice (the run
# lock then refuses the second delivery while the first still runs).
REDIS_VISIBILITY_TIMEOUT = 3600


def queue_for(uri: str) -> str:
    """The queue of a store's runs: workers and batches of one store meet there, other stores never do."""
    return "mklang-" + hashlib.sha256(uri.encode("utf-8")).hexdigest()[:12]


def celery_app(broker: str) -> Any:
    """The Celery application of mklang runs on `broker`."""
    try:
        from celery import Celery
    except ImportError:
        raise UsageError("workers need Celery: pip install 'mklang[distributed]'") from None
    app = Celery("mklang", broker=broker, set_as_current=False)
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


def enqueue_and_follow(
    broker: str,
    uri: str,
    store: Store,
    machine_path: str,
    items: Iterable[Item],
    budgets: dict[str, Any],
    *,
    on_outcome: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Enqueue every item not finished yet, then wait until the store says each one stopped."""
    items = list(items)
    app = celery_app(broker)
    queue = queue_for(uri)
    waiting: dict[str, Item] = {}
    finished: dict[str, Outcome] = {}
    for item in items:
        now = outcome(store, item.run)
        if now.status == "pending":
            app.send_task(TASK, args=[item.run, item.context, machine_path, budgets], queue=queue)
            waiting[item.run] = item
        else:
            finished[item.run] = now
            if on_outcome is not None:
                on_outcome(now)
    while waiting:
        time.sleep(POLL_SECONDS)
        for run in list(waiting):
            now = outcome(store, run)
            if now.status != "pending":
                finished[run] = now
                del waiting[run]
                if on_outcome is not None:
                    on_outcome(now)
    return [finished[item.run] for item in items]


class Worker:
    """What a worker process shares between its runs: the store, the host options, a stop flag."""

    def __init__(self, uri: str, host_options: dict[str, Any]):
        self.uri = uri
        self.store = open_store(uri)
        self.host_options = host_options
        self.stopping = threading.Event()

    def run(self, run: str, context: dict[str, Any], machine_path: str, budgets: dict[str, Any]) -> Outcome:
        from mklang.session import Host

        runner = Batch(
            _machine(machine_path),
            self.store,
            self.uri,
            lambda: Host.build(**self.host_options, max_cost=budgets.get("max_cost")),
            **budgets,
            stop=self.stopping,
        )
        return runner.run_item(Item(run, context))


@cache
def _machine(path: str) -> Machine:
    from mklang.check import require_runnable
    from mklang.syntax import load_file

    return require_runnable(load_file(path))


def start_worker(broker: str, uri: str, *, concurrency: int, host_options: dict[str, Any]) -> None:
    """Run a Celery worker (threads: one process, so SIGKILL loses exactly its runs in flight)."""
    from celery.exceptions import Reject
    from celery.signals import worker_shutting_down

    app = celery_app(broker)
    worker = Worker(uri, host_options)

    @app.task(name=TASK, bind=True)
    def run_item(task: Any, run: str, context: dict[str, Any], machine_path: str, budgets: dict[str, Any]) -> None:
        done = worker.run(run, context, machine_path, budgets)
        if done.status == "pending" and worker.stopping.is_set():
            raise Reject(f"{run}: suspended by the worker's shutdown", requeue=True)

    def stop(**_: Any) -> None:
        worker.stopping.set()  # every run suspends at its next loop-top

    worker_shutting_down.connect(stop, weak=False)
    app.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={concurrency}",
            "--loglevel=WARNING",
            f"--queues={queue_for(uri)}",
            "--without-gossip",
            "--without-mingle",
            f"--hostname=mklang-{os.getpid()}@%h",
        ]
    )
