"""The SQLite store: many runs in one database file, safe for several processes on one host.

`sqlite:///runs.db#RUN` (a relative path) or `sqlite:////abs/runs.db#RUN`.
The database runs in WAL mode, so readers never block the writer. Every
commit reaches the OS (it survives the process dying); envelopes and
durable journal lines are also synced (`synchronous=FULL`: they survive a
power cut), other journal lines are not (`NORMAL`), so the durability
setting decides the fsyncs of a step as in the file store. A synced commit
syncs the ones before it too: the WAL is one file, written in order.

Writes are group-committed (ADR 0043): the writes that this process's
threads make while a commit is under way wait in a queue, and the next
commit takes all of them in one transaction with one sync (synced when any
of them asks to be). Each writer returns only once the commit holding its
rows is done, so what a caller was told is written is committed, as
before; a write that fails fails its own caller, and a commit that fails
fails the callers whose rows it held. Reads go through a connection of
their own and never wait for a commit. Processes sharing the database take
turns at its one writer on an `flock` of `<database>.locks/writer.lock`,
so the next is woken when the writer is free, not when SQLite's busy
handler next polls. Runs
are rows: `mklang_runs(run, envelope, generation, <summary>)`, `mklang_journal(run, seq, line)` and
`mklang_segments(run, name, body)` (trace segments, synced like envelopes);
batches keep `mklang_notes(key, value)` and `mklang_spend(batch, run, tokens, cost)`;
`mklang_generations(run_id, generation)` is how far each run id got (ADR 0052);
budget pools are `mklang_pools`, `mklang_pool_holds` and `mklang_pool_waits` (ADR 0067).

SQLite has no lock that dies with its process, so a run's lock is the file
store's `flock` on `<database>.locks/<run>.lock`: released by the kernel
when the process dies, never unlinked, opened without following symlinks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from mklang.errors import CheckpointError, UsageError
from mklang.stores.file import FileLock, hashed_name, lock_holder, open_lock_file
from mklang.stores.sql import APPEND_LINE, DROP_LINES, RECOUNTED, SUMMARY_COLUMNS, SUMMARY_INDEXES, SqlPools, SqlStore

SCHEMA = """
CREATE TABLE IF NOT EXISTS mklang_runs (
    run TEXT PRIMARY KEY, envelope BLOB NOT NULL, generation INTEGER NOT NULL DEFAULT 0, started REAL, updated REAL,
    journal_bytes INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS mklang_journal (
    run TEXT NOT NULL, seq INTEGER PRIMARY KEY AUTOINCREMENT, line BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS mklang_journal_run ON mklang_journal (run, seq);
CREATE TABLE IF NOT EXISTS mklang_segments (
    run TEXT NOT NULL, name TEXT NOT NULL, body BLOB NOT NULL, PRIMARY KEY (run, name)
);
CREATE TABLE IF NOT EXISTS mklang_notes (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS mklang_generations (run_id TEXT PRIMARY KEY, generation INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS mklang_spend (
    batch TEXT NOT NULL, run TEXT NOT NULL, tokens INTEGER NOT NULL, cost REAL NOT NULL, PRIMARY KEY (batch, run)
);
CREATE TABLE IF NOT EXISTS mklang_pools (
    name TEXT PRIMARY KEY, max_cost REAL, max_tokens INTEGER, concurrency INTEGER, rpm INTEGER, tpm INTEGER,
    spent_cost REAL NOT NULL DEFAULT 0, spent_tokens INTEGER NOT NULL DEFAULT 0,
    reserved_cost REAL NOT NULL DEFAULT 0, reserved_tokens INTEGER NOT NULL DEFAULT 0,
    in_flight INTEGER NOT NULL DEFAULT 0, paused_until REAL NOT NULL DEFAULT 0,
    rpm_level REAL NOT NULL DEFAULT 0, tpm_level REAL NOT NULL DEFAULT 0, bucket_at REAL NOT NULL DEFAULT 0,
    created REAL
);
CREATE TABLE IF NOT EXISTS mklang_pool_holds (
    pool TEXT NOT NULL, key TEXT NOT NULL, run TEXT NOT NULL, cost REAL NOT NULL, tokens INTEGER NOT NULL,
    expires REAL NOT NULL, PRIMARY KEY (pool, key)
);
CREATE TABLE IF NOT EXISTS mklang_pool_waits (
    pool TEXT NOT NULL, run TEXT NOT NULL, since REAL, PRIMARY KEY (pool, run)
);
"""


class SqliteStore(SqlStore, SqlPools):
    """Runs as rows of one SQLite database: one connection that writes, its commits shared by this
    process's threads (`GroupCommit`), and one that reads."""

    def __init__(self, path: Path, *, create: bool = True):
        self.path = path
        if not create and not path.is_file():
            raise UsageError(
                f"sqlite:///{path}: no such SQLite checkpoint store: {path} does not exist "
                "(check the path: sqlite:///runs.db is relative to the current folder, sqlite:////abs/runs.db absolute)"
            )
        try:
            _create_private(path)
            self._db = self._connect()
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
            self._migrate()
            self._reader = self._connect()
        except (sqlite3.Error, OSError) as error:
            why = error.strerror if isinstance(error, OSError) else error
            raise CheckpointError(f"{path}: cannot open the SQLite checkpoint store: {why}") from None
        locks = path.with_name(f"{path.name}.locks")
        if create:
            locks.mkdir(mode=0o700, exist_ok=True)
        self._writes = GroupCommit(self._db, self._failed, locks / "writer.lock")
        self._read_guard = threading.Lock()
        self._backfill()

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)

    def _migrate(self) -> None:
        """Add the columns a database of an earlier release lacks (one process at a time)."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(mklang_runs)")}
            if "generation" not in columns:  # a database written before runs kept their generation
                self._db.execute("ALTER TABLE mklang_runs ADD COLUMN generation INTEGER NOT NULL DEFAULT 0")
            if "journal_bytes" not in columns:  # ... or counted their journals' bytes
                self._db.execute("ALTER TABLE mklang_runs ADD COLUMN journal_bytes INTEGER NOT NULL DEFAULT 0")
            for name, kind, _ in SUMMARY_COLUMNS:  # a database written before runs kept a summary
                if name not in columns:
                    self._db.execute(f"ALTER TABLE mklang_runs ADD COLUMN {name} {kind}")
            for index in SUMMARY_INDEXES:
                self._db.execute(index)

    @classmethod
    def from_uri(cls, uri: str, *, create: bool) -> SqliteStore:
        parts = urlsplit(uri)
        if parts.netloc or not parts.path.startswith("/") or len(parts.path) < 2:
            raise UsageError(f"{uri}: expected sqlite:///relative/path.db or sqlite:////absolute/path.db")
        return cls(Path(unquote(parts.path[1:])), create=create)

    def _failed(self, error: object) -> CheckpointError:
        return CheckpointError(f"{self.path}: SQLite checkpoint store: {error}")

    def _rows(self, sql: str, *args: object, run: str | None = None, durable: bool = True) -> list[tuple[Any, ...]]:
        return self._writes.commit([(sql, args)], durable=durable)

    def _select(self, sql: str, *args: object, run: str | None = None) -> list[tuple[Any, ...]]:
        with self._read_guard:
            try:
                return self._reader.execute(sql, args).fetchall()
            except sqlite3.Error as error:
                raise self._failed(error) from None

    def _statements(self, statements: list[Statement], *, run: str, durable: bool) -> None:
        self._writes.commit(statements, durable=durable)

    def _transaction(self, statements: list[Statement]) -> list[tuple[Any, ...]]:
        return self._writes.commit(statements, durable=True)

    def _where(self) -> str:
        return f"sqlite:///{self.path}"

    def start_journal(self, run: str, payload: bytes) -> None:
        # One writer's rows: the old generation or the new one, never a mix.
        self._statements(
            [(DROP_LINES, (run,)), (APPEND_LINE, (run, payload)), (RECOUNTED, (len(payload), run))],
            run=run,
            durable=True,
        )

    def _lock_path(self, run: str) -> Path:
        return self.path.with_name(f"{self.path.name}.locks") / f"{hashed_name(run)}.lock"

    def lock(self, run: str) -> FileLock:
        return FileLock(self._lock_path(run), f"sqlite:///{self.path}#{run}")

    def holder(self, run: str) -> str | None:
        return lock_holder(self._lock_path(run))

    def close(self) -> None:
        self._writes.close()
        with self._read_guard:
            self._reader.close()


Statement = tuple[str, tuple[object, ...]]


@dataclass
class Writer:
    """One caller's statements waiting for a commit, and what became of them."""

    statements: list[Statement]
    durable: bool
    turn: threading.Event = field(default_factory=threading.Event)  # set: committed, or its turn to lead
    done: bool = False
    rows: list[tuple[Any, ...]] = field(default_factory=list)  # what its last statement returned
    error: CheckpointError | None = None


class GroupCommit:
    """The writes of many threads committed together on one connection, one sync per commit.

    A writer queues its statements. One that finds no commit under way leads: it takes every writer
    queued so far, runs their statements in one transaction, commits it (synced when any of them is
    `durable`), releases each of them and hands the lead to the first writer that queued meanwhile,
    so no thread goes on committing for others once its own rows are in. A statement that fails is
    undone alone and fails its own writer; a commit that fails fails every writer it held.
    """

    def __init__(self, db: sqlite3.Connection, failed: Callable[[object], CheckpointError], turns: Path):
        self._db = db
        self._failed = failed  # the one-line error a failure is reported as
        self._turns = _lock_file(turns)  # None where it cannot be made: SQLite's busy handler alone then
        self._queue: list[Writer] = []
        self._leading = False  # a writer leads the next commit, or one is under way
        self._guard = threading.Lock()  # the queue and the lead
        self._connection = threading.Lock()  # the connection: the leader's, or close()'s
        self._synced = True  # the connection's setting: FULL (True) or NORMAL

    def commit(self, statements: list[Statement], *, durable: bool) -> list[tuple[Any, ...]]:
        """Run `statements` in the next commit, all or none; their last one's rows once it is done."""
        writer = Writer(statements, durable)
        with self._guard:
            self._queue.append(writer)
            leads, self._leading = not self._leading, True
        if not leads:
            writer.turn.wait()
        if not writer.done:
            self._lead()
        if writer.error is not None:
            raise writer.error
        return writer.rows

    def _lead(self) -> None:
        with self._guard:
            group, self._queue = self._queue, []
        finished = False
        try:
            with self._connection, self._turn():
                self._transaction(group)
            finished = True
        finally:
            for writer in group:
                if not finished:  # the leader was interrupted (KeyboardInterrupt) mid-commit
                    writer.error = writer.error or self._failed("the commit was interrupted")
                writer.done = True
                writer.turn.set()
            with self._guard:
                if self._queue:
                    self._queue[0].turn.set()
                else:
                    self._leading = False

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """This process's turn at the database's one writer among the processes sharing it, waited for
        in the kernel, which wakes the next process when it is released; SQLite's own busy handler
        sleeps and polls (1, 2, 5, 10 ms ...), and every writer of the process waits with it."""
        if self._turns is None:
            yield
            return
        fcntl.flock(self._turns, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._turns, fcntl.LOCK_UN)

    def _transaction(self, group: list[Writer]) -> None:
        db = self._db
        try:
            if db.in_transaction:  # left open by an interrupted commit
                db.execute("ROLLBACK")
            self._sync(any(writer.durable for writer in group))
            db.execute("BEGIN IMMEDIATE")
            for writer in group:
                self._run(writer)
            db.execute("COMMIT")
        except sqlite3.Error as error:
            with contextlib.suppress(sqlite3.Error):
                if db.in_transaction:
                    db.execute("ROLLBACK")
            for writer in group:
                writer.error = writer.error or self._failed(error)

    def _run(self, writer: Writer) -> None:
        """Run one writer's statements; one that fails is undone with the others of its writer, unless
        the transaction itself is lost (SQLite rolled it back), which fails the whole group."""
        db = self._db
        several = len(writer.statements) > 1  # a savepoint undoes all of them; SQLite undoes one alone
        if several:
            db.execute("SAVEPOINT writer")
        try:
            for sql, args in writer.statements:
                writer.rows = db.execute(sql, args).fetchall()
        except sqlite3.Error as error:
            if not db.in_transaction:
                raise
            if several:
                db.execute("ROLLBACK TO writer")
            writer.error, writer.rows = self._failed(error), []
        if several:
            db.execute("RELEASE writer")

    def _sync(self, synced: bool) -> None:
        """Whether the next commit is fsynced (set outside a transaction)."""
        if synced != self._synced:
            self._db.execute(f"PRAGMA synchronous={'FULL' if synced else 'NORMAL'}")
            self._synced = synced

    def close(self) -> None:
        with self._connection:
            self._db.close()
            if self._turns is not None:
                os.close(self._turns)
                self._turns = None


def _lock_file(path: Path) -> int | None:
    """A descriptor of the lock file at `path` (`open_lock_file`), or None where it cannot be made."""
    try:
        return open_lock_file(path)
    except OSError:
        return None


def _create_private(path: Path) -> None:
    """Create a new database file owner-only, as checkpoint files are (SQLite gives its -wal and -shm
    files the database's mode); an existing one is left as it is."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
