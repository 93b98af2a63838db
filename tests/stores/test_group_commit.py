"""SQLite's group commit (ADR 0043): the writes of many threads in one transaction, one sync each.

What it must keep: a writer returns only once its rows are committed (a
process killed right after finds them), a group holding a durable write is
synced, a statement that fails fails its own writer and no other, and a
commit that fails fails every writer it held and leaves the store usable.
To put several writers in one group deterministically, a test holds the
connection so that the first writer's commit waits, then lets it go once
the others are queued behind it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import ROOT

from mklang.errors import CheckpointError
from mklang.stores.sqlite import SqliteStore


@pytest.fixture
def store(tmp_path) -> Iterator[SqliteStore]:
    opened = SqliteStore(tmp_path / "runs.db")
    yield opened
    opened.close()


def traced(store: SqliteStore) -> list[str]:
    """The statements the store's writing connection runs from now on."""
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    return statements


def one_group(store: SqliteStore, writes: list[Callable[[], Any]]) -> list[Any]:
    """Run `writes` each in a thread of its own, all but the first in the commit after the first one's:
    the connection is held until they are all queued. Each write's outcome: its result, or what it raised."""
    outcomes: list[Any] = [None] * len(writes)

    def write(number: int) -> None:
        try:
            outcomes[number] = writes[number]()
        except BaseException as error:  # the outcome under test, KeyboardInterrupt included
            outcomes[number] = error

    first = threading.Thread(target=write, args=(0,))
    with store._writes._connection:
        first.start()
        until(lambda: store._writes._leading)  # the first leads, and waits for the connection
        others = [threading.Thread(target=write, args=(number,)) for number in range(1, len(writes))]
        for thread in others:
            thread.start()
        until(lambda: len(store._writes._queue) == len(others))
    for thread in (first, *others):
        thread.join()
    return outcomes


def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "the writers never queued"
        time.sleep(0.001)


def test_writers_queued_behind_a_commit_share_the_next_one(store):
    statements = traced(store)
    writes = [lambda n=n: store.append("a", f"line {n}\n".encode(), durable=False) for n in range(8)]
    assert one_group(store, writes) == [None] * 8
    assert statements.count("COMMIT") == 2  # the first writer's, then the seven queued behind it
    assert sorted(store.read_journal("a").splitlines()) == [f"line {n}".encode() for n in range(8)]


def test_a_group_holding_one_durable_write_is_synced_and_one_without_is_not(store):
    statements = traced(store)
    store.append("a", b"not durable\n", durable=False)
    assert statements[:2] == ["PRAGMA synchronous=NORMAL", "BEGIN IMMEDIATE"]
    statements.clear()
    writes = [lambda: store.append("a", b"first\n", durable=False)]
    writes += [lambda: store.append("a", b"step\n", durable=False), lambda: store.append("a", b"call\n", durable=True)]
    assert one_group(store, writes) == [None] * 3
    commits = [n for n, statement in enumerate(statements) if statement == "COMMIT"]
    assert len(commits) == 2
    assert "PRAGMA synchronous=FULL" not in statements[: commits[0]]  # the first writer's alone: not durable
    assert "PRAGMA synchronous=FULL" in statements[commits[0] : commits[1]]


def test_a_statement_that_fails_fails_its_own_writer_and_the_group_commits(store):
    store.start_journal("bad", b"old generation\n")
    store._db.execute(
        "CREATE TRIGGER refuse BEFORE INSERT ON mklang_journal WHEN NEW.run = 'bad' BEGIN SELECT RAISE(ABORT, 'refused'); END"
    )
    writes = [
        lambda: store.append("a", b"first\n", durable=True),
        lambda: store.append("a", b"second\n", durable=True),
        lambda: store.append("bad", b"refused\n", durable=True),
        lambda: store.start_journal("bad", b"new generation\n"),  # its DELETE ran, then its INSERT failed
        lambda: store.append("b", b"third\n", durable=False),
    ]
    outcomes = one_group(store, writes)
    assert outcomes[:2] == [None, None] and outcomes[4] is None
    for refused in outcomes[2:4]:
        assert isinstance(refused, CheckpointError)
        assert str(refused) == f"{store.path}: SQLite checkpoint store: refused"
    assert store.read_journal("a") == b"first\nsecond\n"
    assert store.read_journal("b") == b"third\n"
    assert store.read_journal("bad") == b"old generation\n"  # the failed writer's DELETE was undone


def test_a_commit_that_fails_fails_every_writer_it_held_and_the_next_commit_goes_on(store):
    # A deferred foreign key is checked at COMMIT: a row breaking it fails the whole transaction.
    store._db.execute("PRAGMA foreign_keys=ON")
    store._db.execute("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
    store._db.execute("CREATE TABLE child (parent INTEGER REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)")
    writes = [
        lambda: store.append("a", b"first\n", durable=True),
        lambda: store.append("a", b"second\n", durable=False),
        lambda: store._rows("INSERT INTO child (parent) VALUES (42)"),
        lambda: store.write("a", b"{}", generation=1),
    ]
    outcomes = one_group(store, writes)
    assert outcomes[0] is None  # the first writer's commit, before the others queued
    for failed in outcomes[1:]:
        assert isinstance(failed, CheckpointError)
        assert str(failed) == f"{store.path}: SQLite checkpoint store: FOREIGN KEY constraint failed"
    assert (store.read_journal("a"), store.read("a")) == (b"first\n", None)
    store.append("a", b"third\n", durable=True)
    assert store.read_journal("a") == b"first\nthird\n"


def test_a_leader_interrupted_mid_commit_fails_the_writers_it_held_and_the_store_goes_on(store, monkeypatch):
    run = store._writes._run

    def interrupted(writer: Any) -> None:
        run(writer)
        if writer.statements[0][1][1] == b"interrupting\n":
            raise KeyboardInterrupt  # its statement ran: the transaction is left open

    monkeypatch.setattr(store._writes, "_run", interrupted)
    writes = [lambda: store.append("a", b"first\n", durable=True)]
    writes += [
        lambda: store.append("a", b"interrupting\n", durable=True),
        lambda: store.append("a", b"held\n", durable=True),
    ]
    first, *held = one_group(store, writes)
    assert first is None
    # Whichever of the two led the second commit was interrupted; the other learns its rows were not committed.
    assert sorted(type(outcome).__name__ for outcome in held) == ["CheckpointError", "KeyboardInterrupt"]
    (failed,) = (outcome for outcome in held if isinstance(outcome, CheckpointError))
    assert str(failed) == f"{store.path}: SQLite checkpoint store: the commit was interrupted"
    assert store.read_journal("a") == b"first\n"
    store.append("a", b"after\n", durable=True)
    assert store.read_journal("a") == b"first\nafter\n"


WRITER = textwrap.dedent(
    """
    import sys, threading
    from pathlib import Path
    from mklang.stores.sqlite import SqliteStore

    store = SqliteStore(Path(sys.argv[1]))
    said = threading.Lock()

    def write(thread):
        for number in range(10_000):
            line = f"{thread} {number}"
            store.append("run", line.encode() + b"\\n", durable=number % 3 == 0)
            with said:
                print(line, flush=True)

    for thread in range(16):
        threading.Thread(target=write, args=(thread,)).start()
    """
)


def test_a_process_killed_right_after_writers_were_released_loses_none_of_their_rows(tmp_path):
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path / "runs.db")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    released = [writer.stdout.readline().strip() for _ in range(500)]
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    released += writer.stdout.read().splitlines()  # what it printed before it died
    store = SqliteStore(tmp_path / "runs.db")
    try:
        committed = set(store.read_journal("run").decode().splitlines())
    finally:
        store.close()
    assert len(released) >= 500
    assert set(released) <= committed


def test_reads_do_not_wait_for_a_commit_under_way(store):
    store.write("a", b"{}", generation=1)
    with store._writes._connection:  # a commit that cannot finish
        blocked = threading.Thread(target=store.append, args=("a", b"line\n"), kwargs={"durable": True})
        blocked.start()
        until(lambda: store._writes._leading)
        assert (store.read("a"), store.read_journal("a")) == (b"{}", b"")
    blocked.join()
    assert store.read_journal("a") == b"line\n"


def test_a_reader_sees_what_another_connection_committed(store, tmp_path):
    other = sqlite3.connect(tmp_path / "runs.db", isolation_level=None)
    other.execute("INSERT INTO mklang_notes (key, value) VALUES ('k', x'6e6f7465')")
    other.close()
    assert store.read_note("k") == b"note"


def test_each_writer_learns_its_own_rows(store):
    writes = [lambda: store.write("a", b"{}", generation=2), lambda: store.write("b", b"{}", generation=1)]
    writes.append(lambda: store.write("a", b"{}", generation=1))  # older than the one queued before it
    outcomes = one_group(store, writes)
    assert outcomes[:2] == [None, None]
    assert isinstance(outcomes[2], CheckpointError)
    assert "holds generation 2: refusing to write the older generation 1" in str(outcomes[2])
    assert (store.generation("a"), store.generation("b")) == (2, 1)


def test_the_store_after_close_takes_no_write(tmp_path):
    store = SqliteStore(Path(tmp_path / "runs.db"))
    store.close()
    with pytest.raises(CheckpointError, match="Cannot operate on a closed database"):
        store.append("a", b"line\n", durable=True)


def test_processes_sharing_the_database_take_turns_at_its_writer_on_a_lock_file(store, tmp_path):
    turns = tmp_path / "runs.db.locks" / "writer.lock"
    other = os.open(turns, os.O_RDWR)  # another open file: as another process's, its flock excludes ours
    fcntl.flock(other, fcntl.LOCK_EX)
    waiting = threading.Thread(target=store.append, args=("a", b"line\n"), kwargs={"durable": True})
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive() and store.read_journal("a") == b""  # waits for its turn, not in a transaction
    fcntl.flock(other, fcntl.LOCK_UN)
    os.close(other)
    waiting.join(10)
    assert not waiting.is_alive() and store.read_journal("a") == b"line\n"
    assert stat.S_IMODE(turns.stat().st_mode) == 0o600


def test_a_store_without_its_locks_folder_writes_without_taking_turns(tmp_path):
    SqliteStore(tmp_path / "runs.db").close()
    shutil.rmtree(tmp_path / "runs.db.locks")
    store = SqliteStore(tmp_path / "runs.db", create=False)  # a command that only reads makes no folder
    try:
        store.write("a", b"{}", generation=1)
        assert store.read("a") == b"{}" and not (tmp_path / "runs.db.locks").exists()
    finally:
        store.close()
