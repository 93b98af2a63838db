"""`mklang batch --processes N`: one batch spread over N real processes sharing a SQLite or PostgreSQL store.

The model is the fake HTTP server, so every paid call is counted where it is
paid. The parent is a real `mklang batch` process where a signal is sent to
it or to one of its children; elsewhere it runs in the test process (its
children are real processes all the same).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.batches import CALLS, reply, results, write_items
from support.batches import batch_project as batch_project  # the fixture `project`
from support.batches import batch_server as batch_server  # the fixture `server`
from support.commands import cli, cli_env, refused, wait_for
from support.fakeserver import answer
from support.forks import Forked, start
from support.services import postgres_schema

BATCH = ("batch", "twostep.mk", "--inputs", "items.jsonl", "--config", "mklang.toml")


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest) -> Iterator[str]:
    """A store of each kind that several processes share (the file store where a test asks for it)."""
    if request.param != "postgresql":
        yield {"files": "runs", "sqlite": "sqlite:///runs.db"}[request.param]
        return
    with postgres_schema() as uri:
        yield uri


def started(project: Path, *options: str) -> Forked:
    """A real `mklang batch` process of the project's items, JSON on stdout (forked: without an
    interpreter's start-up; its children start as a user's do)."""
    return start([*BATCH, "--format", "json", *options], cli_env(), project)


def children(pid: int) -> list[int]:
    """The processes `pid` started and has not reaped (Linux)."""
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("store", ["files", "sqlite", "postgresql"], indirect=True)
def test_two_processes_run_every_item_once_and_report_what_one_process_does(project, server, store):
    write_items(project, 24)
    one = cli(*BATCH, "--store", "sqlite:///one.db", "--out", "one.jsonl", "--format", "json", cwd=project)
    assert one.returncode == 0, one.stderr
    assert server.count == 24 * CALLS
    two = cli(
        *BATCH,
        *("--store", store, "--processes", "2", "--concurrency", "4", "--out", "two.jsonl", "--format", "json"),
        *("--events", "events.jsonl"),
        cwd=project,
    )
    assert two.returncode == 0, two.stderr
    assert server.count == 2 * 24 * CALLS  # each item paid once more, by one process
    assert json.loads(two.stdout) == json.loads(one.stdout)
    assert results(project / "two.jsonl") == results(project / "one.jsonl")  # in input order
    finished = [line["run"] for line in results(project / "events.jsonl") if line["event"] == "run.finished"]
    assert sorted(finished) == sorted(f"item-{n}" for n in range(24))  # both processes' events, whole lines
    again = cli(*BATCH, "--store", store, "--format", "json", cwd=project)
    assert (again.returncode, json.loads(again.stdout)["done"]) == (0, 24)
    assert server.count == 2 * 24 * CALLS  # a re-run (here in one process) pays nothing


def test_a_child_killed_mid_batch_is_reported_and_a_rerun_pays_no_completed_call_twice(project, server, store):
    items = 60
    write_items(project, items)
    process = started(project, "--store", store, "--processes", "2", "--concurrency", "4", "--out", "out.jsonl")
    wait_for(lambda: server.count >= 10, process, "calls were paid")
    killed = children(process.pid)[0]
    os.kill(killed, signal.SIGKILL)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 3, err  # some runs not finished: a re-run continues them
    said = re.search(rf"process (\d) of 2 \(pid {killed}\) was killed by SIGKILL: the (\d+) run\(s\)", err)
    assert said is not None, err
    totals = json.loads(out)
    assert totals["pending"] == int(said.group(2)) > 0 and totals["done"] + totals["pending"] == items
    lost = [line for line in results(project / "out.jsonl") if line["status"] == "pending"]
    assert {line["reason"] for line in lost} == {f"process {said.group(1)} of 2 was killed by SIGKILL"}
    paid = server.count
    assert paid < items * CALLS
    again = cli(*BATCH, "--store", store, "--concurrency", "4", "--out", "out.jsonl", cwd=project)
    assert again.returncode == 0, again.stderr
    assert [line["result"] for line in results(project / "out.jsonl")] == [f"answer {n}" for n in range(items)]
    # Calls journaled before the kill are answered from the journal; only the killed process's calls in
    # flight (its 2 runs) are paid again.
    assert items * CALLS <= server.count <= items * CALLS + 2


@pytest.mark.parametrize(
    ("store", "signum"),
    [("sqlite", signal.SIGINT), ("postgresql", signal.SIGTERM)],
    ids=["SIGINT-sqlite", "SIGTERM-postgresql"],
    indirect=["store"],
)
def test_ctrl_c_suspends_the_runs_of_every_process_and_a_rerun_finishes_them(project, server, store, signum):
    release = threading.Event()  # every call is held until the signal has reached each process
    server.handler = lambda request: answer("ok", input_tokens=10, output_tokens=5) if release.wait(30) else None
    write_items(project, 6)
    options = ("--store", store, "--concurrency", "2", "--out", "out.jsonl")
    process = started(project, *options, "--processes", "2")
    try:
        wait_for(lambda: server.count >= 2, process, "a call of each process (one run each) was in flight")
        process.send_signal(signum)
        time.sleep(0.5)
    finally:
        release.set()
    out, err = process.communicate(timeout=30)
    assert process.returncode == 3 and "Traceback" not in err, err
    assert err.count("interrupt received") == 1, err  # said once, by the parent
    assert json.loads(out)["pending"] == 6
    assert [line["status"] for line in results(project / "out.jsonl")] == ["pending"] * 6
    assert server.count == 2  # the calls in flight ended; no run went on to its next call, none started
    again = cli(*BATCH, *options, cwd=project)
    assert again.returncode == 0, again.stderr
    assert server.count == 6 * CALLS  # the paid calls were not paid again


def test_a_second_ctrl_c_ends_the_parent_and_every_child_at_once(project, server):
    server.handler = lambda request: answer("ok", input_tokens=10, output_tokens=5, delay=30)
    write_items(project, 2)
    process = started(project, "--store", "sqlite:///runs.db", "--processes", "2", "--concurrency", "2")
    wait_for(lambda: server.count >= 2, process, "a call of each process was in flight")
    spread = children(process.pid)
    process.send_signal(signal.SIGINT)
    assert "interrupt received" in process.stderr_line(
        "interrupt received"
    )  # the first was handled: the second is another
    process.send_signal(signal.SIGINT)
    began = time.monotonic()
    _, err = process.communicate(timeout=10)
    assert process.returncode == 130 and time.monotonic() - began < 5 and "interrupted again: exiting now" in err
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in spread) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in spread)


def test_a_killed_parent_leaves_no_process_running_on_and_a_rerun_finishes(project, server):
    server.handler = lambda request: answer("ok", input_tokens=10, output_tokens=5, delay=0.5)
    write_items(project, 8)
    options = ("--store", "sqlite:///runs.db", "--concurrency", "2")
    process = started(project, *options, "--processes", "2")
    wait_for(lambda: server.count >= 2, process, "a call of each process was in flight")
    spread = children(process.pid)
    process.kill()
    process.communicate()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in spread) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in spread)  # each stopped at its next loop-top
    assert server.count < 8 * CALLS
    server.handler = reply  # the re-run's calls are answered at once
    again = cli(*BATCH, *options, cwd=project)
    assert again.returncode == 0, again.stderr
    assert server.count == 8 * CALLS  # the calls of the stopped runs were kept


def test_the_batch_ceiling_bounds_the_spend_of_every_process_together(project, server, store):
    write_items(project, 10)
    ceiling, per_call, in_flight = 90, 15, 2
    options = ("--store", store, "--processes", "2", "--concurrency", str(in_flight))
    first = cli(*BATCH, *options, "--batch-max-tokens", str(ceiling), "--format", "json", cwd=project)
    assert first.returncode == 3, first.stderr  # suspended on the ceiling: a re-run continues them
    assert json.loads(first.stdout)["suspended"] > 0
    # Over the ceiling by at most one call per run in flight over both processes (each alone would
    # allow the ceiling: together they would pay about twice it).
    assert ceiling <= server.count * per_call <= ceiling + in_flight * per_call
    listed = json.loads(cli("runs", "--store", store, "--format", "json", cwd=project).stdout)["runs"]
    # A run the ceiling stopped after it started says which ceiling and how far. Whether any run was in
    # the middle when the ceiling was reached depends on how the two processes' calls interleave (with
    # whole runs done at 90 tokens none is); test_batch.py's one-process test always makes one.
    cut = [run["checkpoint"] for run in listed if run["reason"] == "batch-ceiling"]
    for checkpoint in cut:
        detail = json.loads(cli("show", checkpoint, "--format", "json", cwd=project).stdout)["detail"]
        spent = re.fullmatch(r"batch tokens (\d+) of 90", detail)
        assert spent and ceiling <= int(spent.group(1)) <= server.count * per_call, detail
    again = cli(*BATCH, *options, "--batch-max-tokens", "1000", "--out", "out.jsonl", cwd=project)
    assert again.returncode == 0, again.stderr
    assert server.count == 10 * CALLS  # the re-run paid only what the first had not
    assert all(line["status"] == "done" for line in results(project / "out.jsonl"))


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        (("--processes", "0"), "--processes expects a whole number of at least 1, got '0'"),
        (("--processes", "3", "--concurrency", "2"), "--processes 3 needs --concurrency 3 or more"),
        (
            ("--processes", "2", "--executor", "celery", "--broker", "amqp://127.0.0.1//"),
            "--processes spreads a local batch: with --executor celery the workers are the processes",
        ),
    ],
    ids=["none", "more-than-concurrency", "celery"],
)
def test_a_batch_that_cannot_be_spread_is_refused_before_any_run(project, server, options, needle):
    write_items(project, 2)
    refused(cli(*BATCH, "--store", "sqlite:///runs.db", *options, cwd=project), needle)
    assert server.count == 0 and not (project / "runs.db").exists()


def test_each_process_gets_every_nth_item_and_its_even_part_of_the_concurrency():
    from mklang.batching import Item
    from mklang.cli.local_batch import shares

    items = [Item(f"r-{n}", {}) for n in range(5)]
    split = [([item.run for item in share], runs) for share, runs in shares(items, 5, 2)]
    assert split == [(["r-0", "r-2", "r-4"], 3), (["r-1", "r-3"], 2)]
    assert [runs for _, runs in shares(items, 7, 3)] == [3, 2, 2]
    assert [len(share) for share, _ in shares(items[:2], 8, 4)] == [1, 1]  # a process with no item is not started


def test_a_line_a_killed_process_left_half_written_is_not_read_as_an_outcome():
    import io
    import queue
    from types import SimpleNamespace

    from mklang.cli.local_batch import _read_lines

    killed = SimpleNamespace(process=SimpleNamespace(stdout=io.StringIO('{"id": "r-0"}\n{"id": "r-')))
    lines: queue.Queue = queue.Queue()
    _read_lines(killed, lines)
    assert [lines.get_nowait()[1] for _ in range(lines.qsize())] == ['{"id": "r-0"}\n', None]
