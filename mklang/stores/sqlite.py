"""The SQLite store: many runs in one database file, safe for several processes on one host.

`sqlite:///runs.db#RUN` (a relative path) or `sqlite:////abs/runs.db#RUN`.
The database runs in WAL mode, so readers never block the writer. Every
commit reaches the OS (it survives the process dying); envelopes and
durable journal lines are also synced (`synchronous=FULL`: they survive a
power cut), other journal lines are not (`NORMAL`), so the durability
setting decides the fsyncs of a step as in the file store. A synced commit
syncs the ones before it too: the WAL is one file, written in order. Runs
are rows: `mklang_runs(run, envelope, generation, <summary>)`, `mklang_journal(run, seq, line)` and
`mklang_segments(run, name, body)` (trace segments, synced like envelopes);
batches keep `mklang_notes(key, value)` and `mklang_spend(batch, run, tokens, cost)`.

SQLite has no lock that dies with its process, so a run's lock is the file
store's `flock` on `<database>.locks/<run>.lock`: released by the kernel
when the process dies, never unlinked, opened without following symlinks.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from mklang.errors import CheckpointError, UsageError
from mklang.stores.file import FileLock, hashed_name, lock_holder
from mklang.stores.sql import SUMMARY_COLUMNS, SqlStore

SCHEMA = """
CREATE TABLE IF NOT EXISTS mklang_runs (
    run TEXT PRIMARY KEY, envelope BLOB NOT NULL, generation INTEGER NOT NULL DEFAULT 0, started REAL, updated REAL
);
CREATE TABLE IF NOT EXISTS mklang_journal (
    run TEXT NOT NULL, seq INTEGER PRIMARY KEY AUTOINCREMENT, line BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS mklang_journal_run ON mklang_journal (run, seq);
CREATE TABLE IF NOT EXISTS mklang_segments (
    run TEXT NOT NULL, name TEXT NOT NULL, body BLOB NOT NULL, PRIMARY KEY (run, name)
);
CREATE TABLE IF NOT EXISTS mklang_notes (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS mklang_spend (
    batch TEXT NOT NULL, run TEXT NOT NULL, tokens INTEGER NOT NULL, cost REAL NOT NULL, PRIMARY KEY (batch, run)
);
"""


class SqliteStore(SqlStore):
    """Runs as rows of one SQLite database; one connection shared by this process's threads."""

    def __init__(self, path: Path, *, create: bool = True):
        self.path = path
        self._guard = threading.Lock()
        if not create and not path.is_file():
            raise UsageError(
                f"sqlite:///{path}: no such SQLite checkpoint store: {path} does not exist "
                "(check the path: sqlite:///runs.db is relative to the current folder, sqlite:////abs/runs.db absolute)"
            )
        try:
            _create_private(path)
            self._db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._synced = True  # the connection's setting: FULL (True) or NORMAL
            self._db.executescript(SCHEMA)
            self._migrate()
        except (sqlite3.Error, OSError) as error:
            why = error.strerror if isinstance(error, OSError) else error
            raise CheckpointError(f"{path}: cannot open the SQLite checkpoint store: {why}") from None
        self._backfill()
        if create:
            path.with_name(f"{path.name}.locks").mkdir(mode=0o700, exist_ok=True)

    def _migrate(self) -> None:
        """Add the columns a database of an earlier release lacks (one process at a time)."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(mklang_runs)")}
            if "generation" not in columns:  # a database written before runs kept their generation
                self._db.execute("ALTER TABLE mklang_runs ADD COLUMN generation INTEGER NOT NULL DEFAULT 0")
            for name, kind, _ in SUMMARY_COLUMNS:  # a database written before runs kept a summary
                if name not in columns:
                    self._db.execute(f"ALTER TABLE mklang_runs ADD COLUMN {name} {kind}")
            self._db.execute("CREATE INDEX IF NOT EXISTS mklang_runs_status ON mklang_runs (status)")
            self._db.execute("CREATE INDEX IF NOT EXISTS mklang_runs_updated ON mklang_runs (updated)")

    @classmethod
    def from_uri(cls, uri: str, *, create: bool = True) -> SqliteStore:
        parts = urlsplit(uri)
        if parts.netloc or not parts.path.startswith("/") or len(parts.path) < 2:
            raise UsageError(f"{uri}: expected sqlite:///relative/path.db or sqlite:////absolute/path.db")
        return cls(Path(unquote(parts.path[1:])), create=create)

    def _rows(self, sql: str, *args: object, run: str | None = None, durable: bool = True) -> list[tuple[Any, ...]]:
        with self._guard:
            try:
                self._sync(durable)
                return self._db.execute(sql, args).fetchall()
            except sqlite3.Error as error:
                raise CheckpointError(f"{self.path}: SQLite checkpoint store: {error}") from None

    def _sync(self, synced: bool) -> None:
        """Whether the next commit is fsynced (the caller holds the guard, outside a transaction)."""
        if synced != self._synced:
            self._db.execute(f"PRAGMA synchronous={'FULL' if synced else 'NORMAL'}")
            self._synced = synced

    def start_journal(self, run: str, payload: bytes) -> None:
        with self._guard:
            try:
                self._sync(True)
                with self._db:  # one transaction: the old generation or the new one
                    self._db.execute("BEGIN IMMEDIATE")
                    self._db.execute("DELETE FROM mklang_journal WHERE run = ?", (run,))
                    self._db.execute("INSERT INTO mklang_journal (run, line) VALUES (?, ?)", (run, payload))
            except sqlite3.Error as error:
                raise CheckpointError(f"{self.path}: SQLite checkpoint store: {error}") from None

    def _lock_path(self, run: str) -> Path:
        return self.path.with_name(f"{self.path.name}.locks") / f"{hashed_name(run)}.lock"

    def lock(self, run: str) -> FileLock:
        return FileLock(self._lock_path(run), f"sqlite:///{self.path}#{run}")

    def holder(self, run: str) -> str | None:
        return lock_holder(self._lock_path(run))

    def close(self) -> None:
        with self._guard:
            self._db.close()


def _create_private(path: Path) -> None:
    """Create a new database file owner-only, as checkpoint files are (SQLite gives its -wal and -shm
    files the database's mode); an existing one is left as it is."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
