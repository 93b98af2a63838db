"""The PostgreSQL store: runs shared by many hosts (psycopg 3, the `distributed` extra).

`postgresql://[user@]host[:port]/database#RUN`; libpq's URI options apply
(for a schema: `?options=-csearch_path%3Dmy_schema`). Runs are rows of
`mklang_runs(run, envelope)` and `mklang_journal(run, seq, line)`, batches
keep `mklang_notes(key, value)` and `mklang_spend(batch, run, tokens, cost)`;
tables are created on first use; every write is one committed transaction.

A run's lock is a session advisory lock held on a connection of its own,
so it is released when the lock is, or when the process holding it dies
or loses its connection: a worker killed by SIGKILL never blocks its run.
The lock connection is named after its holder (`pid@host`), which is what
`holder` reports.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading
from typing import Any

from mklang.checkpoint.file_store import still_running
from mklang.errors import CheckpointError, UsageError

SCHEMA = """
CREATE TABLE IF NOT EXISTS mklang_runs (run TEXT PRIMARY KEY, envelope BYTEA NOT NULL);
CREATE TABLE IF NOT EXISTS mklang_journal (run TEXT NOT NULL, seq BIGSERIAL PRIMARY KEY, line BYTEA NOT NULL);
CREATE INDEX IF NOT EXISTS mklang_journal_run ON mklang_journal (run, seq);
CREATE TABLE IF NOT EXISTS mklang_notes (key TEXT PRIMARY KEY, value BYTEA NOT NULL);
CREATE TABLE IF NOT EXISTS mklang_spend (
    batch TEXT NOT NULL, run TEXT NOT NULL, tokens BIGINT NOT NULL, cost DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (batch, run)
);
"""


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError:
        raise UsageError("the PostgreSQL store needs psycopg: pip install 'mklang[distributed]'") from None
    return psycopg


class PostgresStore:
    """Runs as rows of one PostgreSQL database; one data connection shared by this process's threads."""

    def __init__(self, conninfo: str):
        self.conninfo = conninfo
        self._guard = threading.Lock()
        self._db = self._connect()
        self._create_tables()

    @classmethod
    def from_uri(cls, uri: str) -> PostgresStore:
        return cls(uri)

    def _connect(self, name: str = "mklang") -> Any:
        psycopg = _psycopg()
        try:
            return psycopg.connect(self.conninfo, autocommit=True, application_name=name)
        except psycopg.Error as error:
            raise CheckpointError(
                f"{self._where()}: cannot connect to the PostgreSQL checkpoint store: {_first_line(error)}"
            ) from None

    def _create_tables(self) -> None:
        """Create the tables on first use; several workers doing it at once are serialized."""
        psycopg = _psycopg()
        try:
            with self._db.transaction():
                self._db.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
                self._db.execute(SCHEMA)
        except psycopg.Error as error:
            raise CheckpointError(f"{self._where()}: PostgreSQL checkpoint store: {_first_line(error)}") from None

    def _where(self) -> str:
        return self.conninfo.split("?", 1)[0]

    def _execute(self, sql: str, *args: object) -> list[tuple[Any, ...]]:
        psycopg = _psycopg()
        with self._guard:
            try:
                cursor = self._db.execute(sql, args or None)
                return cursor.fetchall() if cursor.description else []
            except psycopg.Error as error:
                raise CheckpointError(f"{self._where()}: PostgreSQL checkpoint store: {_first_line(error)}") from None

    def read(self, run: str) -> bytes | None:
        rows = self._execute("SELECT envelope FROM mklang_runs WHERE run = %s", run)
        return bytes(rows[0][0]) if rows else None

    def write(self, run: str, payload: bytes) -> None:
        self._execute(
            "INSERT INTO mklang_runs (run, envelope) VALUES (%s, %s) "
            "ON CONFLICT (run) DO UPDATE SET envelope = excluded.envelope",
            run,
            payload,
        )

    def read_journal(self, run: str) -> bytes:
        rows = self._execute("SELECT line FROM mklang_journal WHERE run = %s ORDER BY seq", run)
        return b"".join(bytes(row[0]) for row in rows)

    def start_journal(self, run: str, payload: bytes) -> None:
        psycopg = _psycopg()
        with self._guard:
            try:
                with self._db.transaction():  # the old generation or the new one, never a mix
                    self._db.execute("DELETE FROM mklang_journal WHERE run = %s", (run,))
                    self._db.execute("INSERT INTO mklang_journal (run, line) VALUES (%s, %s)", (run, payload))
            except psycopg.Error as error:
                raise CheckpointError(f"{self._where()}: PostgreSQL checkpoint store: {_first_line(error)}") from None

    def append(self, run: str, payload: bytes, *, durable: bool) -> None:
        # A committed row is durable (synchronous_commit): durable either way.
        self._execute("INSERT INTO mklang_journal (run, line) VALUES (%s, %s)", run, payload)

    def drop_journal(self, run: str) -> None:
        self._execute("DELETE FROM mklang_journal WHERE run = %s", run)

    def lock(self, run: str) -> AdvisoryLock:
        return AdvisoryLock(self, run)

    def holder(self, run: str) -> str | None:
        key = _lock_key(run) & 0xFFFFFFFFFFFFFFFF  # pg_locks shows the key's halves unsigned
        rows = self._execute(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND l.classid = %s AND l.objid = %s AND l.objsubid = 1",
            key >> 32,
            key & 0xFFFFFFFF,
        )
        return str(rows[0][0]).removeprefix("mklang ") if rows else None

    def runs(self) -> list[str]:
        return [str(row[0]) for row in self._execute("SELECT run FROM mklang_runs ORDER BY run")]

    def read_note(self, key: str) -> bytes | None:
        rows = self._execute("SELECT value FROM mklang_notes WHERE key = %s", key)
        return bytes(rows[0][0]) if rows else None

    def write_note(self, key: str, payload: bytes) -> None:
        self._execute(
            "INSERT INTO mklang_notes (key, value) VALUES (%s, %s) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            key,
            payload,
        )

    def record_spend(self, batch: str, run: str, tokens: int, cost: float) -> None:
        self._execute(
            "INSERT INTO mklang_spend (batch, run, tokens, cost) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (batch, run) DO UPDATE SET tokens = GREATEST(mklang_spend.tokens, excluded.tokens), "
            "cost = GREATEST(mklang_spend.cost, excluded.cost)",
            batch,
            run,
            tokens,
            cost,
        )

    def spend(self, batch: str) -> tuple[int, float]:
        rows = self._execute(
            "SELECT COALESCE(SUM(tokens), 0), COALESCE(SUM(cost), 0.0) FROM mklang_spend WHERE batch = %s", batch
        )
        return int(rows[0][0]), float(rows[0][1])

    def close(self) -> None:
        with self._guard:
            self._db.close()


SCHEMA_LOCK_KEY = 0x6D6B6C616E67  # "mklang": serializes creating the tables


def _lock_key(run: str) -> int:
    """The run's 64-bit advisory lock key (signed, as PostgreSQL takes it)."""
    return int.from_bytes(hashlib.sha256(f"mklang run {run}".encode()).digest()[:8], "big", signed=True)


class AdvisoryLock:
    """A session advisory lock on a connection of its own (module docstring)."""

    def __init__(self, store: PostgresStore, run: str):
        self._key = _lock_key(run)
        self._db = store._connect(f"mklang {os.getpid()}@{socket.gethostname()}")
        row = self._db.execute("SELECT pg_try_advisory_lock(%s)", (self._key,)).fetchone()
        if not row[0]:
            self._db.close()
            raise still_running(f"{store._where()}#{run}", store.holder(run) or "?")

    def release(self) -> None:
        if not self._db.closed:
            # Unlocked at once: the server ends a closed session's backend (and its locks) a moment later.
            with contextlib.suppress(_psycopg().Error):
                self._db.execute("SELECT pg_advisory_unlock(%s)", (self._key,))
            self._db.close()


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
