"""`mklang worker` and Celery `mklang batch` processes, each with a home of its own, and their queues.

The processes are real, forked from the test process's factory of `mklang` commands (support/forks.py,
ADR 0046) after Celery, kombu and mklang were imported there: a test signals or kills them as it would
a new interpreter, without paying that interpreter's start-up each time."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mklang.distributed import celery_app, queue_for
from mklang.stores import open_store
from support.commands import cli, cli_env
from support.forks import Piped, piped

# What the fleet's helpers take: a worker or batch this module started, or a process a test made.
Process = Piped | subprocess.Popen[str]

RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"
REDIS = "redis://127.0.0.1:6379/0"
WORKER_CONCURRENCY = 4
FLEET_KEY = "a fleet's shared checkpoint key, long enough"


@pytest.fixture(autouse=True)
def fleet_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process signs, and reads what workers sign (their reports, the runs), with the fleet's key;
    a module that imports it uses it in every test."""
    monkeypatch.setenv("MKLANG_CHECKPOINT_KEY", FLEET_KEY)


def home_env(project: Path) -> dict[str, str]:
    """The environment of a `mklang` process with a home of its own: only the fleet key in
    MKLANG_CHECKPOINT_KEY is shared."""
    home = project / f"home-{len(list(project.glob('home-*')))}"
    home.mkdir()
    return cli_env(MKLANG_CHECKPOINT_KEY=FLEET_KEY, XDG_CONFIG_HOME=str(home))


def start(project: Path, *args: str) -> Piped:
    """A `mklang` process with a home of its own, for what a test does while it runs (its stdout and
    stderr read as pipes)."""
    return piped(list(args), home_env(project), project)


def here(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`mklang` run to its end in this process (its entry function), with a home of its own: a command
    whose process is not what a test is about costs no interpreter start."""
    return cli(*args, cwd=project, env=home_env(project))


def worker(project: Path, store: str, broker: str, config: str = "mklang.toml") -> Piped:
    return start(
        project,
        "worker",
        "--store",
        store,
        "--broker",
        broker,
        "--concurrency",
        str(WORKER_CONCURRENCY),
        "--config",
        config,
    )


def batch_command(store: str, broker: str, *options: str) -> list[str]:
    """A Celery `mklang batch` of the project's twostep.mk over its items.jsonl, results in out.jsonl."""
    return [
        "batch",
        "twostep.mk",
        "--inputs",
        "items.jsonl",
        "--store",
        store,
        "--executor",
        "celery",
        "--broker",
        broker,
        "--out",
        "out.jsonl",
        "--config",
        "mklang.toml",
        "--format",
        "json",
        *options,
    ]


def batch(project: Path, store: str, broker: str, *options: str) -> Piped:
    """The batch in a process of its own, for a test that acts while it follows its runs."""
    return start(project, *batch_command(store, broker, *options))


# A Celery batch run in this process stops following once no run was reported for this long (its
# workers died): the test fails where it would hang, having no timeout a subprocess would.
NO_HANG = ("--stall-timeout", "120s")


def followed(project: Path, store: str, broker: str, *options: str) -> subprocess.CompletedProcess[str]:
    """The batch run to its end in this process."""
    guard = () if "--stall-timeout" in options else NO_HANG
    return here(project, *batch_command(store, broker, *guard, *options))


class Lines:
    """The stderr lines a process has printed so far, read on a thread of their own."""

    def __init__(self, process: Process):
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._reader.start()

    def _read(self, process: Process) -> None:
        assert process.stderr is not None
        for line in process.stderr:
            self.lines.append(line.rstrip("\n"))

    def having(self, text: str) -> list[str]:
        return [line for line in list(self.lines) if text in line]

    def done(self) -> list[str]:
        self._reader.join(timeout=30)
        return self.lines


def now_and_then(condition: Callable[[], Any], every: float = 0.05) -> Callable[[], Any]:
    """`condition` for `wait_for`, asked at most every `every` seconds (false in between): one that reads
    the store leaves the CPU to the processes the test waits for."""
    asked = [0.0]

    def seldom() -> Any:
        if time.monotonic() - asked[0] < every:
            return False
        asked[0] = time.monotonic()
        return condition()

    return seldom


def queue_of(uri: str) -> str:
    store = open_store(uri)
    try:
        return queue_for(store)
    finally:
        store.close()


def _queue_state(connection: Any, queue: str) -> tuple[int, int]:
    """A queue on RabbitMQ: messages waiting and workers consuming; (0, 0) before any declared it."""
    from amqp.exceptions import NotFound

    channel = connection.channel()
    try:
        declared = channel.queue_declare(queue, passive=True)
    except NotFound:  # the broker closed the channel
        return 0, 0
    channel.close()
    return declared.message_count, declared.consumer_count


def queue_depth(store: str, broker: str = RABBITMQ) -> int:
    """Messages waiting in the store's queue (RabbitMQ)."""
    with celery_app(broker).connection_for_write() as connection:
        return _queue_state(connection, queue_of(store))[0]


def serving(store: str, *workers: Process) -> None:
    """Wait until `workers` all consume the store's queue (RabbitMQ), else stop them and fail: a test about
    what workers do with a batch's runs does not start the batch while one of them is still starting."""
    queue = queue_of(store)
    deadline = time.monotonic() + 120
    with celery_app(RABBITMQ).connection_for_write() as connection:
        while _queue_state(connection, queue)[1] < len(workers):
            if any(process.poll() is not None for process in workers) or time.monotonic() > deadline:
                stop(*workers)
                raise AssertionError(f"the workers ended or stalled before they all consumed {queue}")
            time.sleep(0.05)


def drop_queue(store: str, broker: str = RABBITMQ) -> None:
    with celery_app(broker).connection_for_write() as connection:
        connection.default_channel.queue_delete(queue_of(store))


def stop(*processes: Process) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()


def served_batch(project: Path, store: str, broker: str, *workers: Process) -> tuple[int, str, str]:
    """A Celery `mklang batch` of `project` run to its end (in this process) while `workers` serve it, then
    every worker stopped: the batch's exit code, stdout and stderr."""
    try:
        done = followed(project, store, broker)
    finally:
        stop(*workers)
    return done.returncode, done.stdout, done.stderr
