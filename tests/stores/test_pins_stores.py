"""Pins for the stores: the file store, SQLite and PostgreSQL.

Each test fails when the rule it names is dropped (docs/mutation.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import psycopg
import pytest
from support.services import postgres_schema

from mklang.errors import CheckpointError, RunBusy
from mklang.stores.file import FileStore, lock_holder
from mklang.stores.postgres import PostgresStore
from mklang.stores.sqlite import SqliteStore

# --- SQLite: durable lines are synced, the others reach the OS only ------------


def synchronous(store: SqliteStore) -> str:
    """The connection's sync setting: what its next commit will be."""
    return {1: "NORMAL", 2: "FULL"}[store._db.execute("PRAGMA synchronous").fetchone()[0]]


def test_sqlite_syncs_envelopes_and_durable_lines_and_not_the_others(tmp_path):
    store = SqliteStore(tmp_path / "runs.db")
    try:
        assert synchronous(store) == "FULL"
        store.append("a", b"step\n", durable=False)
        assert synchronous(store) == "NORMAL"
        store.append("a", b"more\n", durable=False)
        assert synchronous(store) == "NORMAL"
        store.write("a", b"{}", generation=1)
        assert synchronous(store) == "FULL"
        store.append("a", b"step\n", durable=False)
        store.append("a", b"call\n", durable=True)
        assert synchronous(store) == "FULL"
        store.append("a", b"step\n", durable=False)
        store.start_journal("a", b"gen\n")
        assert synchronous(store) == "FULL"
        assert store.read_journal("a") == b"gen\n"
    finally:
        store.close()


def test_sqlite_store_at_an_unopenable_path_is_one_checkpoint_error(tmp_path):
    (tmp_path / "runs.db").mkdir()
    with pytest.raises(CheckpointError, match=r"runs\.db: cannot open the SQLite checkpoint store"):
        SqliteStore(tmp_path / "runs.db")


# --- the file store: spend files, lock files ---------------------------------


def test_a_file_stores_spend_ignores_a_half_written_spend_file(tmp_path):
    store = FileStore(tmp_path)
    store.record_spend("batch", "run 1", 10, 0.5)
    store.record_spend("batch", "run 2", 5, 0.25)
    (folder,) = (tmp_path / ".mklang-spend").iterdir()
    (folder / ".run 3.tmp").write_text("1000 9.0")  # an atomic write cut before its rename
    assert store.spend("batch") == (15, 0.75)
    assert store.spend("another batch") == (0, 0.0)


def test_a_file_stores_notes_and_spend_are_owner_only_at_every_level(tmp_path):
    store = FileStore(tmp_path)
    store.record_spend("batch", "run", 10, 0.5)
    store.write_note("key", b"note")
    written = list(tmp_path.rglob("*"))
    assert {path.relative_to(tmp_path).parts[0] for path in written} == {".mklang-spend", ".mklang-notes"}
    assert len(written) == 5  # the two folders, the batch's folder, the spend file, the note
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) in (0o700, 0o600), path


def test_a_runs_spend_never_goes_down_in_tokens_or_in_cost(tmp_path):
    store = FileStore(tmp_path)
    store.record_spend("batch", "run", 10, 0.5)
    store.record_spend("batch", "run", 4, 0.75)
    assert store.spend("batch") == (10, 0.75)
    store.record_spend("batch", "run", 20, 0.1)
    assert store.spend("batch") == (20, 0.75)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_file_journal_holds_one_open_file_per_run_across_generations(tmp_path):
    store = FileStore(tmp_path)
    store.start_journal("run", b"gen 1\n")
    opened = open_descriptors()
    for generation in range(2, 7):
        store.start_journal("run", f"gen {generation}\n".encode())
        store.append("run", b"step\n", durable=False)
    assert open_descriptors() == opened
    assert store.read_journal("run") == b"gen 6\nstep\n"
    store.drop_journal("run")
    assert open_descriptors() == opened - 1
    store.close()


def test_appending_to_a_journal_never_started_names_its_file(tmp_path):
    store = FileStore(tmp_path)
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'run'}\.journal: the journal was not started$"):
        store.append("run", b"step\n", durable=True)


@pytest.fixture
def flocked(tmp_path) -> Iterator[Path]:
    """A lock file held by another open file (as another process would hold it), still empty."""
    path = tmp_path / "held.lock"
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(descriptor, fcntl.LOCK_EX)
    yield path
    os.close(descriptor)


def test_a_held_lock_file_still_empty_names_an_unknown_holder(flocked):
    assert lock_holder(flocked) == "?"
    flocked.write_text("4242\n")
    assert lock_holder(flocked) == "4242"


def test_a_lock_file_that_is_a_symlink_is_not_followed(flocked, tmp_path):
    flocked.write_text("4242\n")
    link = tmp_path / "run.lock"
    link.symlink_to(flocked)
    assert lock_holder(link) is None
    assert lock_holder(tmp_path / "missing.lock") is None


# --- PostgreSQL: lock connections kept, closed, and replaced -----------------


def me() -> str:
    """This process as the store names it (read at test time: the mutation runner forks after import)."""
    return f"{os.getpid()}@{socket.gethostname()}"


@pytest.fixture
def postgres(postgres_uri) -> Iterator[PostgresStore]:
    store = PostgresStore(postgres_uri)
    yield store
    store.close()


def sessions(uri: str, name: str) -> list[int]:
    """The server's sessions of this process named `name`."""
    with psycopg.connect(uri, autocommit=True) as db:
        rows = db.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", (name,)).fetchall()
    return [row[0] for row in rows]


def end_sessions(uri: str, name: str) -> None:
    """End this process's sessions named `name` from the server's side, as a restart or failover does."""
    with psycopg.connect(uri, autocommit=True) as db:
        ended = db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s", (name,)
        ).fetchall()
    assert ended, f"no session named {name}"


def test_a_released_lock_connection_is_kept_for_the_next_lock_and_closed_with_the_store(postgres, postgres_uri):
    assert sessions(postgres_uri, f"mklang-data {me()}")
    postgres.lock("a").release()
    (kept,) = sessions(postgres_uri, f"mklang {me()}")
    postgres.lock("b").release()
    assert sessions(postgres_uri, f"mklang {me()}") == [kept]
    held = postgres.lock("c")
    postgres.close()
    held.release()  # released after the store closed: its connection is closed, not kept
    assert sessions(postgres_uri, f"mklang {me()}") == []
    assert sessions(postgres_uri, f"mklang-data {me()}") == []


def test_a_run_whose_lock_session_ended_cannot_write_and_its_store_goes_on(postgres, postgres_uri):
    lock = postgres.lock("a")
    postgres.write("a", b"before", generation=1)
    end_sessions(postgres_uri, f"mklang {me()}")
    with pytest.raises(CheckpointError, match="PostgreSQL checkpoint store: terminating connection"):
        postgres.start_journal("a", b"gen\n")
    with pytest.raises(CheckpointError, match="PostgreSQL checkpoint store"):
        postgres.write("a", b"after", generation=2)
    lock.release()
    assert postgres.read("a") == b"before"
    assert postgres.read_journal("a") == b""
    postgres.lock("a").release()


def test_a_store_whose_sessions_the_server_ended_locks_and_reads_again(postgres, postgres_uri):
    postgres.write("a", b"envelope", generation=1)
    first, second = postgres.lock("a"), postgres.lock("b")
    first.release()
    second.release()  # two kept connections, both about to end
    end_sessions(postgres_uri, f"mklang {me()}")
    end_sessions(postgres_uri, f"mklang-data {me()}")
    lock = postgres.lock("a")  # the kept connections' sessions ended: a new one takes the lock
    with pytest.raises(CheckpointError):  # the statement that finds the shared session ended fails ...
        postgres.read("b")
    assert postgres.read("a") == b"envelope"  # ... and the next one runs on a new session
    assert postgres.holder("a") == me()
    lock.release()
    assert postgres.holder("a") is None


def test_a_failed_lock_keeps_its_connection_for_the_next_lock(postgres, postgres_uri):
    other = PostgresStore(postgres_uri)
    try:
        held = postgres.lock("a")
        with pytest.raises(RunBusy, match=f"still going in process {me()}"):
            other.lock("a")
        assert len(sessions(postgres_uri, f"mklang {me()}")) == 2  # the holder's and the one that tried
        other.lock("b").release()
        assert len(sessions(postgres_uri, f"mklang {me()}")) == 2
        held.release()
    finally:
        other.close()


def test_runs_of_one_name_in_two_schemas_are_locked_apart(postgres, postgres_uri):
    with postgres_schema() as elsewhere:
        other = PostgresStore(elsewhere)
        try:
            held = postgres.lock("a")
            other.lock("a").release()
            assert other.holder("a") is None
            assert postgres.holder("a") == me()
            held.release()
        finally:
            other.close()


def test_a_lock_whose_session_ended_releases_quietly(postgres, postgres_uri):
    lock = postgres.lock("r")
    end_sessions(postgres_uri, f"mklang {me()}")
    lock.release()
    assert postgres.holder("r") is None
    postgres.lock("r").release()


# --- PostgreSQL: durable lines wait for the flush, the others do not ----------


class CountedConnection(psycopg.Connection):  # type: ignore[type-arg]
    """A connection that records each write it commits and whether that commit waits for the flush."""

    commits: ClassVar[list[bool]] = []  # one per committed write: True when it waits

    def execute(self, query, params=None, **kwargs):  # type: ignore[no-untyped-def]
        text = str(query)
        if self.info.transaction_status == psycopg.pq.TransactionStatus.IDLE and "INSERT" in text:
            CountedConnection.commits.append("set_config('synchronous_commit', 'off', true)" not in text)
        return super().execute(query, params, **kwargs)

    @contextlib.contextmanager
    def transaction(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        with super().transaction(*args, **kwargs) as block:
            yield block
        CountedConnection.commits.append(True)


@pytest.mark.parametrize(("durability", "flushes_per_step"), [("step", 1), ("call", 2)])
def test_postgres_flushes_one_commit_per_judged_step_with_step_durability(
    postgres_uri, monkeypatch, durability, flushes_per_step
):
    from mklang.providers.scripted import ScriptedProvider
    from mklang.service import start
    from mklang.session import Host
    from mklang.syntax import parse

    steps = 20
    machine = parse(
        f'machine loop\nentry s\nbudget {steps}\nstate s {{\n  structure "x"\n  prompt "again"\n  output o\n'
        '  when "again" -> s\n  otherwise -> s\n}\n'
    )
    monkeypatch.setenv("MKLANG_DURABILITY", durability)
    monkeypatch.setattr(psycopg, "connect", CountedConnection.connect)
    monkeypatch.setattr(CountedConnection, "commits", [])
    host = Host(ScriptedProvider({"produce": ["ok"] * steps, "judge": [0]}))
    result = start(machine, {}, host, checkpoint=f"{postgres_uri}#run")
    assert len(result.trace) == steps
    commits = CountedConnection.commits
    assert len(commits) >= 3 * steps  # a produce line, a judge line and a step line per step
    # Besides the steps: the tables, the first envelope and journal, the last envelope.
    assert sum(commits) == flushes_per_step * steps + 4


def test_postgres_turns_off_the_flush_wait_for_one_line_only(postgres):
    postgres.start_journal("a", b"gen\n")
    lock = postgres.lock("a")
    postgres.append("a", b"step\n", durable=False)
    for db in (postgres._db, postgres._held["a"]):
        assert db.execute("SHOW synchronous_commit").fetchone() == ("on",)
    assert PostgresStore(postgres.conninfo).read_journal("a") == b"gen\nstep\n"  # committed: on the server
    lock.release()
