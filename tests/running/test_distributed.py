"""Workers on Celery over real RabbitMQ (and Redis) and PostgreSQL, with the fake HTTP model.

Two `mklang worker` processes share a PostgreSQL store; `mklang batch
--executor celery` enqueues the items and follows them in the store. One
worker is killed with SIGKILL mid-batch: its runs are redelivered to the
other and resumed (each process has a home of its own: the fleet key in
MKLANG_CHECKPOINT_KEY is what lets one worker resume what the other signed),
every item ends done with the uninterrupted answers, and
the extra model calls are at most the calls it had in flight.

A worker stopped with SIGTERM suspends its runs and gives them back; a run a
worker cannot set up is failed, reported and acknowledged once; batch-wide
ceilings hold across workers; a batch no worker serves stops following
after its stall timeout. Tests wait for observable states (calls held at the
fake model, lines a worker prints), not for time to pass.
"""

from __future__ import annotations

import json
import signal
import threading

import jsonschema
import pytest
from support import ROOT
from support.batches import CALLS, reply, results, write_items
from support.batches import batch_project as batch_project  # the fixture `project`
from support.batches import batch_server as batch_server  # the fixture `server`
from support.commands import cli, cli_env, wait_for
from support.fleet import (
    RABBITMQ,
    REDIS,
    WORKER_CONCURRENCY,
    Lines,
    batch,
    drop_queue,
    followed,
    queue_depth,
    queue_of,
    served_batch,
    serving,
    start,
    stop,
    worker,
)
from support.fleet import fleet_key as fleet_key  # a fixture, autouse
from support.services import require_server

from mklang.checkpoint.envelope import parse
from mklang.distributed import read_note
from mklang.stores import open_store


def test_a_worker_killed_mid_batch_loses_only_its_calls_in_flight(project, server, postgres_uri):
    require_server("RabbitMQ")
    items = 40
    write_items(project, items)
    workers = [worker(project, postgres_uri, RABBITMQ) for _ in range(2)]
    serving(postgres_uri, *workers)  # both take runs from the first message on
    killed = threading.Event()

    def kill_at_a_quarter(request):  # the model kills the first worker once a quarter of the calls were paid
        if server.count >= items // 2 and not killed.is_set():
            killed.set()
            workers[0].kill()
        return reply(request)

    server.handler = kill_at_a_quarter
    try:
        done = followed(project, postgres_uri, RABBITMQ)
    finally:
        stop(*workers)
    assert killed.is_set() and workers[0].returncode == -signal.SIGKILL
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["done"] == items
    out = results(project / "out.jsonl")
    assert [line["result"] for line in out] == [f"answer {n}" for n in range(items)]  # as an uninterrupted batch
    assert items * CALLS <= server.count <= items * CALLS + WORKER_CONCURRENCY


def test_a_worker_logs_one_line_per_run_taken_and_finished_and_writes_each_runs_events(project, server, postgres_uri):
    require_server("Redis")
    write_items(project, 3)
    logging = start(project, "worker", "--store", postgres_uri, "--broker", REDIS, "--config", "mklang.toml",
                    "--log-format", "json", "--events", "events.jsonl")  # fmt: skip
    code, _, stderr = served_batch(project, postgres_uri, REDIS, logging)
    assert code == 0, stderr
    lines = [json.loads(line) for line in logging.stderr.read().splitlines() if line.startswith("{")]
    taken = sorted(line["run"] for line in lines if line["event"] == "run-taken")
    finished = {line["run"]: line for line in lines if line["event"] == "run-finished"}
    assert taken == sorted(finished) == [f"item-{n}" for n in range(3)]
    assert {(line["level"], line["status"], line["worker"].split("@")[0]) for line in finished.values()} == {
        ("INFO", "done", str(logging.pid))
    }
    assert all(line["tokens"] > 0 and "time" in line for line in finished.values())
    events = [json.loads(line) for line in (project / "events.jsonl").read_text().splitlines()]
    schema = jsonschema.Draft202012Validator(json.loads((ROOT / "docs" / "events.schema.json").read_text("utf-8")))
    for event in events:
        schema.validate(event)
    ends = {event["run"]: event for event in events if event["event"] == "run.finished"}
    assert sorted(ends) == [f"item-{n}" for n in range(3)]  # each event names the run it belongs to
    assert {event["run"] for event in events} == set(ends)
    assert all(ends[run]["usage"]["input_tokens"] + ends[run]["usage"]["output_tokens"] == finished[run]["tokens"]
               for run in ends)  # fmt: skip


def test_redis_works_as_the_broker(project, server, postgres_uri):
    require_server("Redis")
    write_items(project, 10)
    one = worker(project, postgres_uri, REDIS)
    code, stdout, stderr = served_batch(project, postgres_uri, REDIS, one)
    assert code == 0, stderr
    assert json.loads(stdout)["done"] == 10 and server.count == 10 * CALLS


def test_sigterm_suspends_a_workers_runs_and_gives_them_back_to_the_queue(project, server, postgres_uri):
    require_server("RabbitMQ")
    release = threading.Event()

    def held(request):  # every call waits until the test lets it answer
        release.wait(timeout=120)
        return reply(request)

    server.handler = held
    write_items(project, 8)
    first = worker(project, postgres_uri, RABBITMQ)
    said = Lines(first)
    running = batch(project, postgres_uri, RABBITMQ)
    workers = [first]
    try:
        # Every thread of the worker is inside a run's first call: 4 runs in flight, none finished.
        wait_for(lambda: server.count >= WORKER_CONCURRENCY, running, "the worker started its runs", timeout=120)
        first.send_signal(signal.SIGTERM)
        wait_for(lambda: said.having("stopping"), running, "the worker heard SIGTERM", timeout=60)
        release.set()  # the calls in flight answer; each run stops at its next loop-top
        first.wait(timeout=120)
        said.done()  # every line it printed is read
        given_back = sorted(
            line.split(": run ")[1].split(":")[0]
            for line in said.having("suspended by the worker")
            if line.startswith("mklang worker")
        )
        assert len(given_back) == WORKER_CONCURRENCY, "\n".join(said.lines)
        assert not [line for line in said.lines if "Traceback" in line or "Error" in line], "\n".join(said.lines)
        store = open_store(postgres_uri)
        try:
            for run in given_back:  # suspended by the interrupt, its first call paid and kept
                envelope = parse(store.read(run), run)
                assert (envelope.status, envelope.reason, len(envelope.frames[-1]["trace"])) == (
                    "suspended",
                    "interrupted",
                    1,
                )
                assert read_note(store, run) is None  # given back, not reported
            assert server.count == WORKER_CONCURRENCY  # nothing else ran
            second = worker(project, postgres_uri, RABBITMQ)
            workers.append(second)
            stdout, stderr = running.communicate(timeout=180)
            assert running.returncode == 0, stderr
            assert json.loads(stdout)["done"] == 8
            for run in given_back:  # requeued and finished by the other worker
                note = read_note(store, run)
                assert (note["worker"].split("@")[0], note["outcome"]["status"]) == (str(second.pid), "done")
        finally:
            store.close()
    finally:
        release.set()
        stop(running, *workers)
    assert server.count == 8 * CALLS  # the calls paid before the SIGTERM were not paid again
    assert [line["result"] for line in results(project / "out.jsonl")] == [f"answer {n}" for n in range(8)]


def test_a_run_a_worker_cannot_set_up_is_failed_once_and_the_batch_ends(project, server, postgres_uri):
    require_server("RabbitMQ")
    write_items(project, 3)
    broken = worker(project, postgres_uri, RABBITMQ, config="missing.toml")  # this worker's host cannot be built
    said = Lines(broken)
    try:
        done = followed(project, postgres_uri, RABBITMQ)
        assert done.returncode == 1, done.stderr  # failed runs: as with the local executor
        totals = json.loads(done.stdout)
        assert (totals["failed"], totals["done"], totals["pending"], totals["exit_code"]) == (3, 0, 0, 1)
        out = results(project / "out.jsonl")
        assert {line["status"] for line in out} == {"failed"}
        assert all("missing.toml" in line["reason"] and "\n" not in line["reason"] for line in out), out
        assert queue_depth(postgres_uri) == 0  # acknowledged: not redelivered
    finally:
        stop(broken)
    assert len([line for line in said.done() if " failed: " in line]) == 3  # each run failed once
    assert server.count == 0


def test_a_checkpoint_that_fails_verification_on_the_worker_is_failed(project, server, postgres_uri):
    require_server("RabbitMQ")
    write_items(project, 3)
    foreign = project / "foreign"  # item-0 was suspended by someone holding another key
    foreign.mkdir()
    suspended = cli(
        "run", "twostep.mk", "--set", "topic=t-0", "--config", "mklang.toml", "--checkpoint", f"{postgres_uri}#item-0",
        "--max-tokens", "1", "--format", "json",
        cwd=project,
        env=cli_env(MKLANG_CHECKPOINT_KEY="another user's checkpoint key, 32 bytes or more", XDG_CONFIG_HOME=str(foreign)),
    )  # fmt: skip
    assert suspended.returncode == 3, suspended.stderr
    one = worker(project, postgres_uri, RABBITMQ)
    code, stdout, stderr = served_batch(project, postgres_uri, RABBITMQ, one)
    assert code == 1, stderr
    out = {line["id"]: line for line in results(project / "out.jsonl")}
    assert out["item-0"]["status"] == "failed" and "key" in out["item-0"]["reason"], out["item-0"]
    assert (out["item-1"]["status"], out["item-2"]["status"]) == ("done", "done")
    assert json.loads(stdout)["failed"] == 1


def test_a_batch_no_worker_serves_stops_following_after_its_stall_timeout(project, postgres_uri):
    require_server("RabbitMQ")
    write_items(project, 3)
    try:
        done = followed(project, postgres_uri, RABBITMQ, "--stall-timeout", "1s")
        assert done.returncode == 3, done.stderr  # not finished: re-run to continue
        assert json.loads(done.stdout)["pending"] == 3
        assert "no run was reported for 1s" in done.stderr and queue_of(postgres_uri) in done.stderr
        assert queue_depth(postgres_uri) == 3  # the runs stay queued for a worker
    finally:
        drop_queue(postgres_uri)


@pytest.mark.parametrize("ceiling_option", ["--batch-max-tokens", "--batch-max-cost"])
def test_batch_wide_ceilings_hold_across_two_workers_and_a_rerun_with_more_finishes(
    project, server, postgres_uri, ceiling_option
):
    """At $1 a token (a price of 1,000,000 USD per million) the dollar ceiling is the token one in dollars."""
    require_server("RabbitMQ")
    items, ceiling, tokens_per_call = 20, 150, 15
    with (project / "mklang.toml").open("a", encoding="utf-8") as config:
        config.write('\n[prices."local:m"]\ninput = 1000000\noutput = 1000000\n')
    write_items(project, items)
    workers = [worker(project, postgres_uri, RABBITMQ) for _ in range(2)]
    serving(postgres_uri, *workers)  # both spend against the ceiling from the first run on
    try:
        first = followed(project, postgres_uri, RABBITMQ, ceiling_option, str(ceiling))
        assert first.returncode == 3, first.stderr  # some suspended: a re-run with more continues them
        totals = json.loads(first.stdout)
        spent = server.count * tokens_per_call
        assert totals["usage"]["input_tokens"] + totals["usage"]["output_tokens"] == spent
        # Over the ceiling by at most the calls in flight when it was reached: one per worker thread.
        assert ceiling <= spent <= ceiling + 2 * WORKER_CONCURRENCY * tokens_per_call
        out = results(project / "out.jsonl")
        assert {line["reason"] for line in out if line["status"] == "suspended"} == {"batch-ceiling"}
        assert totals["suspended"] > 0 and totals["done"] + totals["suspended"] == items
        more = str(items * CALLS * tokens_per_call)
        again = followed(project, postgres_uri, RABBITMQ, ceiling_option, more)
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["done"] == items
    finally:
        stop(*workers)
    assert server.count == items * CALLS  # the re-run paid only what the first had not
    assert [line["result"] for line in results(project / "out.jsonl")] == [f"answer {n}" for n in range(items)]


def test_a_run_locked_elsewhere_waits_for_the_lock_when_it_is_soon_released(project, server, postgres_uri):
    require_server("RabbitMQ")
    write_items(project, 2)
    store = open_store(postgres_uri)
    held = store.lock("item-0")  # as a worker killed a moment ago whose session has not ended yet
    one = worker(project, postgres_uri, RABBITMQ)
    said = Lines(one)
    running = batch(project, postgres_uri, RABBITMQ)
    try:
        both = ('run-taken run="item-0"', 'run-finished run="item-1"')
        wait_for(lambda: all(map(said.having, both)), running, "item-0 was taken and item-1 run", timeout=120)
        assert read_note(store, "item-0") is None  # the worker waits for its lock
        held.release()
        stdout, stderr = running.communicate(timeout=120)
    finally:
        held.release()
        stop(running, one)
        store.close()
    assert running.returncode == 0, stderr
    assert json.loads(stdout)["done"] == 2 and server.count == 2 * CALLS
