"""The PostgreSQL store: runs shared by many hosts (psycopg 3, the `distributed` extra).

`postgresql://[user@]host[:port]/database#RUN`; libpq's URI options apply
(for a schema: `?options=-csearch_path%3Dmy_schema`). Runs are rows of
`mklang_runs(run, envelope, generation, <summary>)`, `mklang_journal(run, seq, line)` and
`mklang_segments(run, name, body)` (trace segments, flushed like envelopes), batches
keep `mklang_notes(key, value)` and `mklang_spend(batch, run, tokens, cost)`,
`mklang_generations(run_id, generation)` how far each run id got (ADR 0052),
budget pools `mklang_pools`, `mklang_pool_holds` and `mklang_pool_waits` (ADR 0067);
tables are created on first use; every write is one committed transaction.

A committed transaction is on the server, so it survives the client's
death. Envelopes and durable journal lines also wait until the server has
flushed them (`synchronous_commit`: they survive a crash of the server or
its host); other journal lines are asynchronous commits, as they reach the
OS without an fsync in the file store, so the durability setting decides
the flushes of a step (`MKLANG_DURABILITY`). A flushed commit flushes the
ones before it too: the server's write-ahead log is written in order.
Journal lines, the statements of every step, are prepared once on each
connection and run through libpq's calls (ADR 0037).

A run's lock is a session advisory lock held on a connection of its own,
so it is released when the lock is, or when the process holding it dies
or loses its connection: a worker killed by SIGKILL never blocks its run.
The lock connection is named after its holder (`mklang pid@host`), which is
what `holder` reports; the shared one is `mklang-data pid@host`. While the
lock is held, the run's own writes and reads go through its lock
connection: runs in flight commit side by side (the server flushes
concurrent commits together) instead of queueing on one connection, and a
run that lost its lock cannot write. Released lock connections are kept for
the next run's lock, so a batch does not open a connection per run; other
reads share one connection.

A connection whose session the server ended (a restart, a failover, an idle
timeout) is replaced: a kept lock connection on the lock's first try, the
shared connection on the statement after the one that failed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from mklang.errors import CheckpointError, UsageError, first_line, redacted
from mklang.stores.file import still_running
from mklang.stores.sql import (
    APPEND_LINE,
    DROP_LINES,
    RECOUNTED,
    SUMMARY_COLUMNS,
    SUMMARY_INDEXES,
    UNCOUNTED,
    SqlPools,
    SqlStore,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS mklang_runs (run TEXT PRIMARY KEY, envelope BYTEA NOT NULL);
ALTER TABLE mklang_runs ADD COLUMN IF NOT EXISTS generation BIGINT NOT NULL DEFAULT 0;
ALTER TABLE mklang_runs ADD COLUMN IF NOT EXISTS journal_bytes BIGINT NOT NULL DEFAULT 0;
{summary}
{indexes}
CREATE TABLE IF NOT EXISTS mklang_journal (run TEXT NOT NULL, seq BIGSERIAL PRIMARY KEY, line BYTEA NOT NULL);
CREATE INDEX IF NOT EXISTS mklang_journal_run ON mklang_journal (run, seq);
CREATE TABLE IF NOT EXISTS mklang_segments (
    run TEXT NOT NULL, name TEXT NOT NULL, body BYTEA NOT NULL, PRIMARY KEY (run, name)
);
CREATE TABLE IF NOT EXISTS mklang_notes (key TEXT PRIMARY KEY, value BYTEA NOT NULL);
CREATE TABLE IF NOT EXISTS mklang_generations (run_id TEXT PRIMARY KEY, generation BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS mklang_spend (
    batch TEXT NOT NULL, run TEXT NOT NULL, tokens BIGINT NOT NULL, cost DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (batch, run)
);
CREATE TABLE IF NOT EXISTS mklang_pools (
    name TEXT PRIMARY KEY, max_cost DOUBLE PRECISION, max_tokens BIGINT, concurrency BIGINT, rpm BIGINT, tpm BIGINT,
    spent_cost DOUBLE PRECISION NOT NULL DEFAULT 0, spent_tokens BIGINT NOT NULL DEFAULT 0,
    reserved_cost DOUBLE PRECISION NOT NULL DEFAULT 0, reserved_tokens BIGINT NOT NULL DEFAULT 0,
    in_flight BIGINT NOT NULL DEFAULT 0, paused_until DOUBLE PRECISION NOT NULL DEFAULT 0,
    rpm_level DOUBLE PRECISION NOT NULL DEFAULT 0, tpm_level DOUBLE PRECISION NOT NULL DEFAULT 0,
    bucket_at DOUBLE PRECISION NOT NULL DEFAULT 0,
    created DOUBLE PRECISION
);
CREATE TABLE IF NOT EXISTS mklang_pool_holds (
    pool TEXT NOT NULL, key TEXT NOT NULL, run TEXT NOT NULL, cost DOUBLE PRECISION NOT NULL, tokens BIGINT NOT NULL,
    expires DOUBLE PRECISION NOT NULL, PRIMARY KEY (pool, key)
);
CREATE TABLE IF NOT EXISTS mklang_pool_waits (
    pool TEXT NOT NULL, run TEXT NOT NULL, since DOUBLE PRECISION, PRIMARY KEY (pool, run)
);
""".replace(
    "{summary}",
    "\n".join(f"ALTER TABLE mklang_runs ADD COLUMN IF NOT EXISTS {name} {kind};" for name, _, kind in SUMMARY_COLUMNS),
).replace("{indexes}", "\n".join(f"{index};" for index in SUMMARY_INDEXES))


# What `SCHEMA` declares, as `_has_schema` looks for it: tables, (table, column) pairs, indexes.
_DECLARED = (
    r"CREATE TABLE IF NOT EXISTS (\w+)",
    r"ALTER TABLE (\w+) ADD COLUMN IF NOT EXISTS (\w+)",
    r"CREATE (?:UNIQUE )?INDEX IF NOT EXISTS (\w+)",
)


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError:
        raise UsageError("the PostgreSQL store needs psycopg: pip install 'mklang[distributed]>=2'") from None
    return psycopg


class PostgresStore(SqlStore, SqlPools):
    """Runs as rows of one PostgreSQL database; one data connection shared by this process's threads."""

    GREATEST = "GREATEST"
    LEAST = "LEAST"
    WRITABLE_CTE = True

    def __init__(self, conninfo: str, *, create: bool = True):
        self.conninfo = conninfo
        self._guard = threading.Lock()
        self._who = f"{os.getpid()}@{socket.gethostname()}"
        self._db = self._connect(f"mklang-data {self._who}")
        if not create and self._select("SELECT to_regclass('mklang_runs')")[0][0] is None:
            self._db.close()
            raise UsageError(
                f"{self._where()}: no mklang checkpoint store in this database and schema (no table mklang_runs): "
                "check the URI's database and search_path; a batch or `mklang run --checkpoint` creates one"
            )
        self._create_tables()  # and the columns a store of an earlier release lacks
        self._backfill()
        # Locks are per database; runs of the same name in two schemas must not share one.
        self._schema = str(self._select("SELECT current_schema()")[0][0])
        self._held: dict[str, Any] = {}  # run -> the connection holding its lock
        self._idle: list[Any] = []  # released lock connections, kept for the next lock
        self._pool_guard = threading.Lock()
        self._prepared: weakref.WeakSet[Any] = weakref.WeakSet()  # connections holding the `Prepared` ones
        self._closed = False

    @classmethod
    def from_uri(cls, uri: str, *, create: bool) -> PostgresStore:
        return cls(uri, create=create)

    def _connect(self, name: str) -> Any:
        psycopg = _psycopg()
        try:
            return psycopg.connect(self.conninfo, autocommit=True, application_name=name)
        except psycopg.Error as error:
            raise CheckpointError(
                f"{self._where()}: cannot connect to the PostgreSQL checkpoint store: {first_line(error)} "
                "(is the server up, and the URI's host, port, user and database right?)"
            ) from None

    def _create_tables(self) -> None:
        """Create the tables on first use; several workers doing it at once are serialized.

        A store that has every table, column and index of `SCHEMA` runs none of it: `ALTER TABLE
        ... IF NOT EXISTS` and `CREATE INDEX IF NOT EXISTS` take their table's lock even when they
        change nothing, so a process opening the store would queue behind every transaction in
        flight, and deadlock with a journal line's (which writes `mklang_journal`, then `mklang_runs`)."""
        psycopg = _psycopg()
        try:
            if self._has_schema():
                return
            with self._db.transaction():
                self._db.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
                self._db.execute(SCHEMA)
        except psycopg.errors.InvalidSchemaName:
            raise UsageError(
                f"{self._where()}: the schema the URI's search_path names does not exist: create it "
                "(CREATE SCHEMA name) or fix options=-csearch_path%3Dname"
            ) from None
        except psycopg.Error as error:
            raise CheckpointError(f"{self._where()}: PostgreSQL checkpoint store: {first_line(error)}") from None

    def _has_schema(self) -> bool:
        """Whether the search path's schema has every table, column and index `SCHEMA` declares
        (read from the catalog, which takes no table's lock)."""
        tables, columns, indexes = (set(re.findall(pattern, SCHEMA)) for pattern in _DECLARED)
        found = self._db.execute(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name LIKE %s",
            ("mklang%",),
        ).fetchall()
        indexed = self._db.execute("SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()").fetchall()
        return (
            tables <= {table for table, _ in found}
            and columns <= set(found)
            and indexes <= {name for (name,) in indexed}
        )

    def _where(self) -> str:
        """The URI as errors name it: its password hidden."""
        return redacted(self.conninfo.partition("?")[0])

    @contextlib.contextmanager
    def _connection(self, run: str | None) -> Iterator[Any]:
        """The connection for a statement about `run`: its lock connection while held here, else the shared one.

        A psycopg connection serializes its own users, so a run's fan-out branches may share it."""
        psycopg = _psycopg()
        held = self._held.get(run) if run is not None else None
        try:
            if held is not None:
                yield held
            else:
                with self._guard:
                    if self._db.broken:  # its session ended since it last failed
                        self._db = self._connect(f"mklang-data {self._who}")
                    yield self._db
        except psycopg.Error as error:
            raise CheckpointError(f"{self._where()}: PostgreSQL checkpoint store: {first_line(error)}") from None

    def _rows(self, sql: str, *args: object, run: str | None = None, durable: bool = True) -> list[tuple[Any, ...]]:
        with self._connection(run) as db:
            if durable:
                cursor = db.execute(sql.replace("?", "%s"), args or None)
            else:  # the flush wait turned off for its own transaction, in the same message: one round trip
                cursor = _psycopg().ClientCursor(db)  # binding on the client allows several statements
                cursor.execute(UNFLUSHED + sql.replace("?", "%s"), args or None)
                cursor.nextset()
            return cursor.fetchall() if cursor.description else []

    def append(self, run: str, payload: bytes, *, durable: bool) -> None:
        """The statement of every step: prepared once on each connection and run with libpq's calls rather
        than a cursor's, at a third of the CPU on each side (ADR 0037)."""
        statement = APPEND if durable else UNFLUSHED_APPEND
        with self._connection(run) as db, db.lock:  # one thread at a time on a connection, as psycopg's own calls
            if db not in self._prepared:
                for each in (APPEND, UNFLUSHED_APPEND):
                    _exchange(db, db.pgconn.send_prepare, each.name, each.sql, LINE_TYPES)
                self._prepared.add(db)
            _exchange(db, db.pgconn.send_query_prepared, statement.name, (run.encode(), payload), LINE_FORMATS)

    def start_journal(self, run: str, payload: bytes) -> None:
        """One statement, so one transaction and one round trip: the old generation or the new one,
        never a mix (the delete does not see the line inserted beside it)."""
        self._rows(
            f"WITH dropped AS ({DROP_LINES}), line AS ({APPEND_LINE}) {RECOUNTED}",
            run,
            run,
            payload,
            len(payload),
            run,
            run=run,
        )

    def drop_journal(self, run: str) -> None:
        """One statement (one round trip): the lines go and the row's count with them, unflushed."""
        self._rows(f"WITH dropped AS ({DROP_LINES}) {UNCOUNTED}", run, run, run=run, durable=False)

    def lock(self, run: str) -> AdvisoryLock:
        return AdvisoryLock(self, run)

    def _lock_connection(self, kept: bool = True) -> Any:
        """A connection to hold a lock on: a released one (when `kept`), else a new one named after this process."""
        with self._pool_guard:
            while kept and self._idle:
                db = self._idle.pop()
                if not db.closed and not db.broken:
                    return db
                db.close()
        return self._connect(f"mklang {self._who}")

    def _hold(self, run: str, db: Any) -> None:
        with self._pool_guard:
            self._held[run] = db

    def _give_back(self, run: str, db: Any, unlocked: bool) -> None:
        """A lock connection whose lock is released: kept for the next lock, or closed when in doubt."""
        with self._pool_guard:
            if self._held.get(run) is db:
                del self._held[run]
            if unlocked and not db.closed and not db.broken and not self._closed:
                self._idle.append(db)
                return
        db.close()

    def lock_key(self, run: str) -> int:
        """The run's 64-bit advisory lock key in this schema (signed, as PostgreSQL takes it)."""
        named = f"mklang run {self._schema} {run}".encode()
        return int.from_bytes(hashlib.sha256(named).digest()[:8], "big", signed=True)

    def holder(self, run: str) -> str | None:
        key = self.lock_key(run) & 0xFFFFFFFFFFFFFFFF  # pg_locks shows the key's halves unsigned
        rows = self._select(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND l.classid = ? AND l.objid = ? AND l.objsubid = 1",
            key >> 32,
            key & 0xFFFFFFFF,
        )
        return str(rows[0][0]).removeprefix("mklang ") if rows else None

    def close(self) -> None:
        with self._pool_guard:
            self._closed = True
            idle, self._idle = self._idle, []
        for db in idle:
            db.close()
        with self._guard:
            self._db.close()


class Prepared(NamedTuple):
    """A statement prepared by name on each connection that runs it (`append`)."""

    name: bytes
    sql: bytes


TEXT_OID, BYTEA_OID = 25, 17
TEXT_FORMAT, BINARY_FORMAT = 0, 1
# A journal line: its run (text) and the line (bytea, sent as the bytes it is).
LINE_TYPES, LINE_FORMATS = (TEXT_OID, BYTEA_OID), (TEXT_FORMAT, BINARY_FORMAT)
# A journal line, and its bytes counted in the run's row in the same statement (ADR 0052).
COUNTED = b"UPDATE mklang_runs SET journal_bytes = journal_bytes + octet_length($2) WHERE run = $1"
APPEND = Prepared(b"mklang_append", b"WITH line AS (INSERT INTO mklang_journal (run, line) VALUES ($1, $2)) " + COUNTED)
# A journal line whose commit does not wait for the flush: the setting is local to the statement's
# own transaction, so it costs no extra statement or round trip.
UNFLUSHED_APPEND = Prepared(
    b"mklang_append_unflushed",
    b"WITH unflushed AS (SELECT set_config('synchronous_commit', 'off', true)), "
    b"line AS (INSERT INTO mklang_journal (run, line) SELECT $1, $2 FROM unflushed) " + COUNTED,
)
# Put before a statement that need not wait for the flush (`_rows`), as `UNFLUSHED_APPEND` does for lines.
UNFLUSHED = "SELECT set_config('synchronous_commit', 'off', true); "
SCHEMA_LOCK_KEY = 0x6D6B6C616E67  # "mklang": serializes creating the tables


class AdvisoryLock:
    """A session advisory lock on a connection of its own (module docstring)."""

    def __init__(self, store: PostgresStore, run: str):
        self._store, self._run = store, run
        self._key = store.lock_key(run)
        self._db: Any = store._lock_connection()
        taken = self._first_try()
        holder = None if taken else store.holder(run)
        if not taken and holder is None:  # released since the try: a dead client's session just ended
            taken = self._try()
        if not taken:
            store._give_back(run, self._db, unlocked=True)  # it never held this lock
            self._db = None
            raise still_running(f"{store._where()}#{run}", holder or "?")
        store._hold(run, self._db)

    def _first_try(self) -> bool:
        """The first try; on a kept connection whose session has ended, made again on a new connection."""
        try:
            return self._ask()
        except _psycopg().OperationalError:
            self._db.close()  # no lock lives on an ended session
            self._db = self._store._lock_connection(kept=False)
            return self._try()

    def _try(self) -> bool:
        try:
            return self._ask()
        except _psycopg().Error as error:
            self._db.close()
            where = self._store._where()
            raise CheckpointError(f"{where}: PostgreSQL checkpoint store: {first_line(error)}") from None

    def _ask(self) -> bool:
        return bool(self._db.execute("SELECT pg_try_advisory_lock(%s)", (self._key,)).fetchone()[0])

    def release(self) -> None:
        db, self._db = self._db, None
        if db is None:
            return
        unlocked = False
        if not db.closed:
            # Unlocked at once (a closed session's backend ends, and drops its locks, only a moment later);
            # the connection is reused only when the server says this lock is gone.
            with contextlib.suppress(_psycopg().Error):
                row = db.execute("SELECT pg_advisory_unlock(%s)", (self._key,)).fetchone()
                unlocked = bool(row and row[0])
        self._store._give_back(self._run, db, unlocked)


def _exchange(db: Any, send: Callable[..., None], *args: object) -> None:
    """`send(*args)` on `db` (its lock held), its result waited for as psycopg does (interruptibly)."""
    psycopg = _psycopg()
    from psycopg.generators import execute

    send(*args)
    result = db.wait(execute(db.pgconn))[-1]
    if result.status != psycopg.pq.ExecStatus.COMMAND_OK:
        raise psycopg.errors.error_from_result(result)
