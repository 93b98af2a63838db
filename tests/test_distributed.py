"""Workers on Celery over real RabbitMQ (and Redis) and PostgreSQL, with the fake HTTP model.

Two `mklang worker` processes share a PostgreSQL store; `mklang batch
--executor celery` enqueues the items and follows them in the store. One
worker is killed with SIGKILL mid-batch: its runs are redelivered to the
other and resumed (each process has a home of its own: the fleet key in
MKLANG_CHECKPOINT_KEY is what lets one worker resume what the other signed),
every item ends done with the uninterrupted answers, and
the extra model calls are at most the calls it had in flight.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_env, model_config, require_server, wait_for
from fakeserver import FakeServer, answer
from test_batch import CALLS, MACHINE, reply, results, write_items

RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"
REDIS = "redis://127.0.0.1:6379/0"
WORKER_CONCURRENCY = 4
FLEET_KEY = "a fleet's shared checkpoint key"


@pytest.fixture
def server():
    with FakeServer() as running:
        running.handler = reply
        yield running


@pytest.fixture
def project(tmp_path: Path, server: FakeServer) -> Path:
    (tmp_path / "twostep.mk").write_text(MACHINE, encoding="utf-8")
    model_config(server.openai_url, tmp_path / "mklang.toml")
    return tmp_path


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


def worker(project: Path, store: str, broker: str) -> subprocess.Popen[str]:
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
        "mklang.toml",
    )


def batch(project: Path, store: str, broker: str) -> subprocess.Popen[str]:
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
    )


def stop(*processes: subprocess.Popen[str]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.communicate()


def test_a_worker_killed_mid_batch_loses_only_its_calls_in_flight(project, server, postgres_uri):
    require_server("RabbitMQ")
    items = 200
    write_items(project, items)
    workers = [worker(project, postgres_uri, RABBITMQ) for _ in range(2)]
    running = batch(project, postgres_uri, RABBITMQ)
    try:
        wait_for(lambda: server.count >= items // 2, running, "a quarter of the calls were paid", timeout=180)
        workers[0].send_signal(signal.SIGKILL)
        workers[0].communicate()
        stdout, stderr = running.communicate(timeout=300)
    finally:
        stop(running, *workers)
    assert running.returncode == 0, stderr
    assert json.loads(stdout)["done"] == items
    out = results(project / "out.jsonl")
    assert [line["result"] for line in out] == [f"answer {n}" for n in range(items)]  # as an uninterrupted batch
    assert items * CALLS <= server.count <= items * CALLS + WORKER_CONCURRENCY


def test_redis_works_as_the_broker(project, server, postgres_uri):
    require_server("Redis")
    write_items(project, 10)
    one = worker(project, postgres_uri, REDIS)
    running = batch(project, postgres_uri, REDIS)
    try:
        stdout, stderr = running.communicate(timeout=180)
    finally:
        stop(running, one)
    assert running.returncode == 0, stderr
    assert json.loads(stdout)["done"] == 10 and server.count == 10 * CALLS


def test_sigterm_suspends_a_workers_runs_and_gives_them_back_to_the_queue(project, server, postgres_uri):
    require_server("RabbitMQ")
    server.handler = lambda request: answer(reply(request).text, delay=0.3)  # slow enough to stop mid-run
    write_items(project, 8)
    workers = [worker(project, postgres_uri, RABBITMQ)]
    running = batch(project, postgres_uri, RABBITMQ)
    try:
        wait_for(lambda: server.count >= 2, running, "the worker started runs", timeout=120)
        workers[0].send_signal(signal.SIGTERM)
        workers[0].communicate(timeout=120)  # a warm shutdown: its runs suspended at their next loop-top
        workers.append(worker(project, postgres_uri, RABBITMQ))
        stdout, stderr = running.communicate(timeout=180)
    finally:
        stop(running, *workers)
    assert running.returncode == 0, stderr
    assert json.loads(stdout)["done"] == 8
    assert server.count == 8 * CALLS  # suspended at loop-tops: no call was made twice
