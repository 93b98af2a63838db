"""`mklang worker` and Celery `mklang batch` processes, each with a home of its own, and their queues."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mklang.distributed import celery_app, queue_for
from mklang.stores import open_store
from support.commands import cli_env

RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"
REDIS = "redis://127.0.0.1:6379/0"
WORKER_CONCURRENCY = 4
FLEET_KEY = "a fleet's shared checkpoint key, long enough"


@pytest.fixture(autouse=True)
def fleet_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process signs, and reads what workers sign (their reports, the runs), with the fleet's key;
    a module that imports it uses it in every test."""
    monkeypatch.setenv("MKLANG_CHECKPOINT_KEY", FLEET_KEY)


def start(project: Path, *args: str) -> subprocess.Popen[str]:
    """A process with a home of its own: only the fleet key in MKLANG_CHECKPOINT_KEY is shared."""
    home = project / f"home-{len(list(project.glob('home-*')))}"
    home.mkdir()
    return subprocess.Popen(
        [sys.executable, "-m", "mklang", *args],
        cwd=project,
        env=cli_env(MKLANG_CHECKPOINT_KEY=FLEET_KEY, XDG_CONFIG_HOME=str(home)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def worker(project: Path, store: str, broker: str, config: str = "mklang.toml") -> subprocess.Popen[str]:
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


def batch(project: Path, store: str, broker: str, *options: str) -> subprocess.Popen[str]:
    return start(
        project,
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
    )


class Lines:
    """The stderr lines a process has printed so far, read on a thread of their own."""

    def __init__(self, process: subprocess.Popen[str]):
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._reader.start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        for line in process.stderr:
            self.lines.append(line.rstrip("\n"))

    def having(self, text: str) -> list[str]:
        return [line for line in list(self.lines) if text in line]

    def done(self) -> list[str]:
        self._reader.join(timeout=30)
        return self.lines


def queue_of(uri: str) -> str:
    store = open_store(uri)
    try:
        return queue_for(store)
    finally:
        store.close()


def queue_depth(store: str, broker: str = RABBITMQ) -> int:
    """Messages waiting in the store's queue (RabbitMQ)."""
    with celery_app(broker).connection_for_write() as connection:
        return connection.default_channel.queue_declare(queue_of(store), passive=True).message_count


def drop_queue(store: str, broker: str = RABBITMQ) -> None:
    with celery_app(broker).connection_for_write() as connection:
        connection.default_channel.queue_delete(queue_of(store))


def stop(*processes: subprocess.Popen[str]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()


def served_batch(project: Path, store: str, broker: str, *workers: subprocess.Popen[str]) -> tuple[int, str, str]:
    """A Celery `mklang batch` of `project` run to its end while `workers` serve it, then every process
    stopped: the batch's exit code, stdout and stderr."""
    running = batch(project, store, broker)
    try:
        stdout, stderr = running.communicate(timeout=180)
    finally:
        stop(running, *workers)
    return running.returncode, stdout, stderr
