"""What the SQL stores (SQLite, PostgreSQL) share: their tables' rows and the statements on them.

Statements are written once, with `?` placeholders; each store runs them
through its `_rows` (its connection, its placeholder style, its error
messages) and keeps to itself what differs: connecting, replacing a journal
in one transaction, and locks.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from mklang.errors import CheckpointError, JournalCut
from mklang.stores.pools import POOL_COLUMNS, Hold, Pool
from mklang.stores.pools import Caps as PoolCaps
from mklang.stores.summary import TALLIED, RunQuery, RunSummary, Tally, peek_summary

# The summary of a run (`RunSummary`), columns of its `mklang_runs` row: name, and type as
# (SQLite, PostgreSQL). A database made before summaries gets them on open (`summary_columns`).
SUMMARY_COLUMNS = (
    ("run_id", "TEXT", "TEXT"),
    ("machine", "TEXT", "TEXT"),
    ("status", "TEXT", "TEXT"),
    ("reason", "TEXT", "TEXT"),
    ("tokens", "INTEGER", "BIGINT"),
    ("cost", "REAL", "DOUBLE PRECISION"),
    ("started", "REAL", "DOUBLE PRECISION"),
    ("updated", "REAL", "DOUBLE PRECISION"),
    ("asks", "TEXT", "TEXT"),  # JSON; `null` when the run asks nothing, NULL: summarized before it was kept
    ("deadline", "REAL", "DOUBLE PRECISION"),
    ("budget_tokens", "INTEGER", "BIGINT"),
    ("budget_cost", "REAL", "DOUBLE PRECISION"),
    ("over_budget", "INTEGER", "INTEGER"),
)
# The columns a summary sets as an envelope is written (`started` is kept while the run id stays
# the same, `updated` is now), in the order of `_summary_values`; the first six, then the rest.
KEPT = ("run_id", "machine", "status", "reason", "tokens", "cost")
KEPT_LATER = ("asks", "deadline", "budget_tokens", "budget_cost", "over_budget")
SUMMARY_SELECT = f"SELECT run, {', '.join(KEPT + KEPT_LATER)}, started, updated FROM mklang_runs"
SUMMARIZED = "".join(f", {name}" for name in KEPT + KEPT_LATER)
SUMMARIZED_SET = (
    ", started = CASE WHEN mklang_runs.run_id = excluded.run_id AND mklang_runs.started IS NOT NULL "
    "THEN mklang_runs.started ELSE excluded.started END"
    + "".join(f", {name} = excluded.{name}" for name in KEPT + KEPT_LATER)
)
ASKING = "asks IS NOT NULL AND asks <> 'null'"
NEWEST_FIRST = "COALESCE(started, 0) DESC, run"  # the listing's order: the index below reads it in order
UNSUMMARIZED = "status IS NULL OR asks IS NULL"  # the rows `_backfill` summarizes, found at every open
# The indexes of the summaries (SQLite and PostgreSQL alike): a page of the listing reads its rows in
# order, and an open finds the rows to backfill, each without reading every row of a large store.
SUMMARY_INDEXES = (
    "CREATE INDEX IF NOT EXISTS mklang_runs_status ON mklang_runs (status)",
    "CREATE INDEX IF NOT EXISTS mklang_runs_updated ON mklang_runs (updated)",
    f"CREATE INDEX IF NOT EXISTS mklang_runs_newest ON mklang_runs ({NEWEST_FIRST})",
    f"CREATE INDEX IF NOT EXISTS mklang_runs_unsummarized ON mklang_runs (run) WHERE {UNSUMMARIZED}",
)
NEVER_DUE = 1e18  # the deadline a run without one sorts by (`summary.NEVER`)


# A journal and the count of its bytes in the run's row change in one transaction (ADR 0052).
APPEND_LINE = "INSERT INTO mklang_journal (run, line) VALUES (?, ?)"
COUNT_LINE = "UPDATE mklang_runs SET journal_bytes = journal_bytes + ? WHERE run = ?"
DROP_LINES = "DELETE FROM mklang_journal WHERE run = ?"
UNCOUNTED = "UPDATE mklang_runs SET journal_bytes = 0 WHERE run = ?"
RECOUNTED = "UPDATE mklang_runs SET journal_bytes = ? WHERE run = ?"


class SqlStore:
    """The row operations of every store capability over `mklang_runs`, `mklang_journal`,
    `mklang_segments`, `mklang_notes`, `mklang_spend` and `mklang_generations` (a run id's
    generation, kept when the run is removed)."""

    GREATEST = "MAX"  # the dialect's maximum of two values

    def _rows(self, sql: str, *args: object, run: str | None = None, durable: bool = True) -> list[tuple[Any, ...]]:
        """Run one statement that writes (about `run`, when it is; fsynced unless not `durable`): its rows."""
        raise NotImplementedError

    def _select(self, sql: str, *args: object, run: str | None = None) -> list[tuple[Any, ...]]:
        """Run one query (about `run`, when it is): its rows. A store may read apart from its writes."""
        return self._rows(sql, *args, run=run)

    def _blob(self, sql: str, key: str, run: str | None = None) -> bytes | None:
        """The one value `sql` selects for `key`, or None."""
        rows = self._select(sql, key, run=run)
        return bytes(rows[0][0]) if rows else None

    def read(self, run: str) -> bytes | None:
        return self._blob("SELECT envelope FROM mklang_runs WHERE run = ?", run, run=run)

    def write(self, run: str, payload: bytes, *, generation: int, summary: RunSummary | None = None) -> None:
        """The row keeps the generation written last and refuses an older one (ADR 0022), when the
        run was first and last written, and `summary`, all in one statement."""
        now = time.time()
        summarized = () if summary is None else _summary_values(summary)
        written = self._rows(
            f"INSERT INTO mklang_runs (run, envelope, generation, started, updated{SUMMARIZED * bool(summarized)}) "
            f"VALUES (?, ?, ?, ?, ?{', ?' * len(summarized)}) "
            "ON CONFLICT (run) DO UPDATE SET envelope = excluded.envelope, generation = excluded.generation, "
            f"updated = excluded.updated{SUMMARIZED_SET * bool(summarized)} "
            "WHERE mklang_runs.generation <= excluded.generation RETURNING generation",
            run,
            payload,
            generation,
            now,
            now,
            *summarized,
            run=run,
        )
        if not written:
            raise CheckpointError(
                f"run {run} holds generation {self.generation(run)}: refusing to write the older generation "
                f"{generation} over it (a restored older checkpoint?)"
            )

    def generation(self, run: str) -> int:
        rows = self._select("SELECT generation FROM mklang_runs WHERE run = ?", run, run=run)
        return int(rows[0][0]) if rows else 0

    def generation_seen(self, run_id: str) -> int:
        rows = self._select("SELECT generation FROM mklang_generations WHERE run_id = ?", run_id)
        return int(rows[0][0]) if rows else 0

    def record_generation(self, run_id: str, generation: int) -> None:
        # Not synced of its own: the envelope written with it is, and the run's row refuses an older one.
        self._rows(
            "INSERT INTO mklang_generations (run_id, generation) VALUES (?, ?) ON CONFLICT (run_id) "
            f"DO UPDATE SET generation = {self.GREATEST}(mklang_generations.generation, excluded.generation)",
            run_id,
            generation,
            durable=False,
        )

    def read_journal(self, run: str) -> bytes:
        """The journal's lines, refused when fewer bytes than the run's row says were committed to it
        (`journal_bytes`, kept in the transaction of each line: ADR 0052); read in one statement, so
        the lines and the count are of one moment."""
        rows = self._select(
            "SELECT r.journal_bytes, j.line FROM mklang_runs r LEFT JOIN mklang_journal j ON j.run = r.run "
            "WHERE r.run = ? ORDER BY j.seq",
            run,
            run=run,
        )
        if not rows:  # a journal of a run with no envelope yet: nothing counts it
            rows = self._select("SELECT 0, line FROM mklang_journal WHERE run = ? ORDER BY seq", run, run=run)
        journal = b"".join(bytes(line) for _, line in rows if line is not None)
        committed = int(rows[0][0] or 0) if rows else 0
        if committed > len(journal):
            raise JournalCut(f"{self._where()}#{run}", journal, committed)
        return journal

    def append(self, run: str, payload: bytes, *, durable: bool) -> None:
        self._statements([(APPEND_LINE, (run, payload)), (COUNT_LINE, (len(payload), run))], run=run, durable=durable)

    def drop_journal(self, run: str) -> None:
        # Not synced: should a power cut undo it, a journal older than its envelope's generation is never read.
        self._statements([(DROP_LINES, (run,)), (UNCOUNTED, (run,))], run=run, durable=False)

    def _statements(self, statements: list[tuple[str, tuple[object, ...]]], *, run: str, durable: bool) -> None:
        """Run `statements` in one transaction (about `run`; synced unless not `durable`)."""
        raise NotImplementedError

    def _where(self) -> str:
        """How errors name the store."""
        raise NotImplementedError

    def write_segment(self, run: str, name: str, payload: bytes) -> None:
        self._rows(
            "INSERT INTO mklang_segments (run, name, body) VALUES (?, ?, ?) ON CONFLICT (run, name) DO NOTHING",
            run,
            name,
            payload,
            run=run,
        )

    def read_segment(self, run: str, name: str) -> bytes | None:
        rows = self._select("SELECT body FROM mklang_segments WHERE run = ? AND name = ?", run, name, run=run)
        return bytes(rows[0][0]) if rows else None

    def segment_names(self, run: str) -> set[str]:
        return {str(row[0]) for row in self._rows("SELECT name FROM mklang_segments WHERE run = ?", run, run=run)}

    def runs(self) -> list[str]:
        return [str(row[0]) for row in self._select("SELECT run FROM mklang_runs ORDER BY run")]

    def summarize(self, run: str, summary: RunSummary) -> None:
        # Display only: not worth an fsync of its own (the envelope's, or the next one, carries it).
        now = time.time()
        self._rows(
            "UPDATE mklang_runs SET started = CASE WHEN run_id = ? AND started IS NOT NULL THEN started ELSE ? END, "
            + "".join(f"{name} = ?, " for name in KEPT + KEPT_LATER)
            + "updated = ? WHERE run = ?",
            summary.run_id,
            now,
            *_summary_values(summary),
            now,
            run,
            run=run,
            durable=False,
        )

    def summaries(self, query: RunQuery) -> list[RunSummary]:
        where, args = _filters(query)
        sql = SUMMARY_SELECT + where
        if query.order == "question":
            sql += f" ORDER BY COALESCE(machine, ''), COALESCE(reason, ''), COALESCE(deadline, {NEVER_DUE}),"
        else:
            sql += " ORDER BY"
        sql += f" {NEWEST_FIRST}"
        if query.limit is not None:
            sql += f" LIMIT {int(query.limit)}"
        if query.offset:
            sql += f" OFFSET {int(query.offset)}"
        return [_summary_of_row(row) for row in self._select(sql, *args)]

    def tally(self, query: RunQuery, by: tuple[str, ...]) -> list[Tally]:
        """`RunQuery.tally` in one statement."""
        assert by and set(by) <= set(TALLIED), f"a tally groups by summary columns of {TALLIED}"
        where, args = _filters(query)
        grouped = ", ".join(by)
        ordered = ", ".join(f"COALESCE({name}, '')" for name in by)
        sql = (
            f"SELECT {grouped}, COUNT(*), COALESCE(SUM(tokens), 0), COALESCE(SUM(cost), 0), "
            f"COALESCE(SUM(over_budget), 0), MIN(deadline) FROM mklang_runs{where} "
            f"GROUP BY {grouped} ORDER BY {ordered}"
        )
        n = len(by)
        return [
            Tally(
                tuple(row[:n]),
                int(row[n]),
                int(row[n + 1]),
                float(row[n + 2]),
                int(row[n + 3]),
                None if row[n + 4] is None else float(row[n + 4]),
            )
            for row in self._select(sql, *args)
        ]

    def _backfill(self) -> None:
        """Summarize the runs a database holds from before summaries, or from before summaries kept
        what a run asks and its budgets, from their envelopes (once: such a run has `asks` then);
        their times stay unknown, and the status of one summarized already is left as it is."""
        rows = self._select(f"SELECT run, envelope, status FROM mklang_runs WHERE {UNSUMMARIZED}")
        for run, envelope, status in rows:
            peeked = peek_summary(str(run), bytes(envelope), None)
            if peeked.status is None:
                continue  # not an envelope this version reads: the listing shows it as unknown
            values = _summary_values(peeked)
            columns = KEPT + KEPT_LATER if status is None else KEPT_LATER
            self._rows(
                f"UPDATE mklang_runs SET {', '.join(f'{name} = ?' for name in columns)} WHERE run = ?",
                *values[-len(columns) :],
                run,
                durable=False,
            )

    def remove(self, run: str) -> None:
        self._rows("DELETE FROM mklang_journal WHERE run = ?", run, run=run)
        self._rows("DELETE FROM mklang_segments WHERE run = ?", run, run=run)
        self._rows("DELETE FROM mklang_runs WHERE run = ?", run, run=run)

    def read_note(self, key: str) -> bytes | None:
        return self._blob("SELECT value FROM mklang_notes WHERE key = ?", key)

    def write_note(self, key: str, payload: bytes) -> None:
        self._rows(
            "INSERT INTO mklang_notes (key, value) VALUES (?, ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            key,
            payload,
        )

    def add_note(self, key: str, payload: bytes) -> bytes:
        self._rows("INSERT INTO mklang_notes (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING", key, payload)
        return self._blob("SELECT value FROM mklang_notes WHERE key = ?", key) or payload

    def record_spend(self, batch: str, run: str, tokens: int, cost: float) -> None:
        """A run's spend in a batch only grows (a resumed run replays from a smaller total)."""
        self._rows(
            "INSERT INTO mklang_spend (batch, run, tokens, cost) VALUES (?, ?, ?, ?) ON CONFLICT (batch, run) "
            f"DO UPDATE SET tokens = {self.GREATEST}(mklang_spend.tokens, excluded.tokens), "
            f"cost = {self.GREATEST}(mklang_spend.cost, excluded.cost)",
            batch,
            run,
            tokens,
            cost,
        )

    def drop_note(self, key: str) -> None:
        self._rows("DELETE FROM mklang_notes WHERE key = ?", key)

    def spend(self, batch: str) -> tuple[int, float]:
        rows = self._select(
            "SELECT COALESCE(SUM(tokens), 0), COALESCE(SUM(cost), 0.0) FROM mklang_spend WHERE batch = ?", batch
        )
        return int(rows[0][0]), float(rows[0][1])


def _summary_values(summary: RunSummary) -> tuple[object, ...]:
    """What a summary keeps, in the order of `KEPT` then `KEPT_LATER`."""
    return (
        summary.run_id,
        summary.machine,
        summary.status,
        summary.reason,
        summary.tokens,
        summary.cost_usd,
        json.dumps(summary.asks, ensure_ascii=False, default=str),
        summary.deadline,
        summary.budget_tokens,
        summary.budget_cost,
        int(summary.over_budget),
    )


def _summary_of_row(row: tuple[Any, ...]) -> RunSummary:
    """A summary from a row `SUMMARY_SELECT` selects; display only, so a malformed `asks` is none."""
    run, run_id, machine, status, reason, tokens, cost, asks, deadline, budget_tokens, budget_cost, over, *times = row
    try:
        asked = json.loads(asks) if asks else None
    except ValueError:
        asked = None
    started, updated = times
    return RunSummary(
        str(run),
        run_id,
        machine,
        status,
        reason,
        int(tokens or 0),
        float(cost or 0.0),
        None if started is None else float(started),
        None if updated is None else float(updated),
        asks=asked if isinstance(asked, dict) else None,
        deadline=None if deadline is None else float(deadline),
        budget_tokens=None if budget_tokens is None else int(budget_tokens),
        budget_cost=None if budget_cost is None else float(budget_cost),
        over_budget=bool(over),
    )


def _filters(query: RunQuery) -> tuple[str, list[object]]:
    """The WHERE clause of `query`'s filters (empty, or starting with a space) and its arguments."""
    where: list[str] = []
    args: list[object] = []
    if query.statuses:
        where.append(f"status IN ({', '.join('?' for _ in query.statuses)})")
        args.extend(query.statuses)
    for column, test, value in (
        ("machine", "=", query.machine),
        ("updated", ">=", query.since),
        ("updated", "<=", query.until),
        ("deadline", "<=", query.due_by),
        ("reason", "=", query.reason),
    ):
        if value is not None:
            where.append(f"{column} {test} ?")
            args.append(value)
    if query.search:
        pattern = "%" + re.sub(r"([\\%_])", r"\\\1", query.search.lower()) + "%"
        where.append("(LOWER(run) LIKE ? ESCAPE '\\' OR LOWER(COALESCE(reason, '')) LIKE ? ESCAPE '\\')")
        args.extend((pattern, pattern))
    if query.asking:
        where.append(ASKING)
    if query.over_budget:
        where.append("over_budget = 1")
    return (f" WHERE {' AND '.join(where)}" if where else ""), args


# --- Budget pools (`mklang.stores.pools`, ADR 0067) ---------------------------------------------

# The one conditional statement of a reservation: the pool's row takes a call's worst case only when
# it fits within every cap beside what is spent and reserved, a call-in-flight slot is free, the
# rate buckets (refilled for the time since they were last drawn) have room, no pause holds, and
# the row's numbers are ones a pool can hold. `{least}` is the dialect's minimum of two values; the
# arguments are `_reserve_args`.
_RPM_LEVEL = "{least}(rpm, rpm_level + (? - bucket_at) * rpm / 60.0)"
_TPM_LEVEL = "{least}(tpm, tpm_level + (? - bucket_at) * tpm / 60.0)"
RESERVE = (
    "UPDATE mklang_pools SET reserved_cost = reserved_cost + ?, reserved_tokens = reserved_tokens + ?, "
    "in_flight = in_flight + 1, "
    f"rpm_level = CASE WHEN rpm IS NULL THEN 0 ELSE {_RPM_LEVEL} - 1 END, "
    f"tpm_level = CASE WHEN tpm IS NULL THEN 0 ELSE {_TPM_LEVEL} - ? END, bucket_at = ? "
    "WHERE name = ? AND spent_cost >= 0 AND reserved_cost >= 0 AND spent_tokens >= 0 AND reserved_tokens >= 0 "
    "AND in_flight >= 0 AND (max_cost IS NULL OR spent_cost + reserved_cost + ? <= max_cost + 1e-9) "
    "AND (max_tokens IS NULL OR spent_tokens + reserved_tokens + ? <= max_tokens) "
    "AND (concurrency IS NULL OR in_flight < concurrency) AND paused_until <= ? "
    f"AND (rpm IS NULL OR {_RPM_LEVEL} >= 1) AND (tpm IS NULL OR {_TPM_LEVEL} >= {{least}}(?, tpm))"
)
HOLD_COLUMNS = "pool, key, run, cost, tokens, expires"
# Releasing holds (`{held}`: the holds released): their reservations go, and what they cost is
# charged: the call's actual spend when the first two arguments give it, else the full reservation.
# A charge is never more than the room the cap leaves beside the other holds: a call that cost more
# than its worst case (a provider billing past its answer cap, a price table wrong) leaves the pool
# full, never past its cap (`runs.pooling` says so). Dollars reserved are float sums: with no hold
# left nothing is reserved, and a sum never drops below 0 (a residue of -1e-17 would make the row one
# no reservation fits, and `Pool.from_row` refuses).
RELEASE = (
    "UPDATE mklang_pools SET reserved_cost = CASE WHEN in_flight = g.n THEN 0 "
    "ELSE {greatest}(reserved_cost - g.cost, 0) END, reserved_tokens = reserved_tokens - g.tokens, "
    "in_flight = in_flight - g.n, spent_cost = spent_cost + CASE WHEN max_cost IS NULL THEN g.charge "
    "ELSE {least}(g.charge, {greatest}(max_cost - spent_cost - reserved_cost + g.cost, 0)) END, "
    "spent_tokens = spent_tokens + CASE WHEN max_tokens IS NULL THEN g.charged_tokens "
    "ELSE {least}(g.charged_tokens, {greatest}(max_tokens - spent_tokens - reserved_tokens + g.tokens, 0)) END "
    "FROM (SELECT COALESCE(SUM(cost), 0) AS cost, COALESCE(SUM(tokens), 0) AS tokens, COUNT(*) AS n, "
    "CASE WHEN COUNT(*) > 0 THEN COALESCE(?, SUM(cost)) ELSE 0 END AS charge, "
    "CASE WHEN COUNT(*) > 0 THEN COALESCE(?, SUM(tokens)) ELSE 0 END AS charged_tokens FROM {held}) AS g "
    "WHERE name = ?"
)


class SqlPools:
    """The pool statements of the SQL stores, in two dialects of composing them: SQLite runs a
    reservation's and a release's statements in one transaction (its writers are serialized);
    PostgreSQL runs each as one statement whose data-modifying CTE takes the rows it changes
    (concurrent transactions on one pool's row wait for each other's row lock, and re-check it)."""

    LEAST = "MIN"  # the dialect's minimum of two values
    GREATEST = "MAX"
    WRITABLE_CTE = False  # PostgreSQL's `WITH x AS (DELETE ... RETURNING ...)`

    def _rows(self, sql: str, *args: object, run: str | None = None, durable: bool = True) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def _select(self, sql: str, *args: object, run: str | None = None) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def _transaction(self, statements: list[tuple[str, tuple[object, ...]]]) -> list[tuple[Any, ...]]:
        """Run `statements` in one transaction, synced: the rows of the last one."""
        raise NotImplementedError

    def create_pool(self, name: str, caps: PoolCaps) -> bool:
        now = time.time()
        return bool(
            self._rows(
                "INSERT INTO mklang_pools (name, max_cost, max_tokens, concurrency, rpm, tpm, rpm_level, tpm_level, "
                "bucket_at, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (name) DO NOTHING RETURNING name",
                name,
                caps.max_cost,
                caps.max_tokens,
                caps.concurrency,
                caps.rpm,
                caps.tpm,
                caps.rpm or 0,
                caps.tpm or 0,
                now,
                now,
            )
        )

    def pool(self, name: str) -> Pool | None:
        rows = self._select(f"SELECT {POOL_COLUMNS} FROM mklang_pools WHERE name = ?", name)
        return Pool.from_row(rows[0]) if rows else None

    def pool_names(self) -> list[str]:
        return [str(row[0]) for row in self._select("SELECT name FROM mklang_pools ORDER BY name")]

    def top_up(self, name: str, cost: float, tokens: int) -> bool:
        return bool(
            self._rows(
                "UPDATE mklang_pools SET max_cost = max_cost + ?, max_tokens = max_tokens + ? "
                "WHERE name = ? RETURNING name",
                cost,
                tokens,
                name,
            )
        )

    def remove_pool(self, name: str) -> bool:
        self._rows("DELETE FROM mklang_pool_holds WHERE pool = ?", name)
        self._rows("DELETE FROM mklang_pool_waits WHERE pool = ?", name)
        return bool(self._rows("DELETE FROM mklang_pools WHERE name = ? RETURNING name", name))

    def reserve(self, hold: Hold, now: float) -> bool:
        update = RESERVE.replace("{least}", self.LEAST)
        args = _reserve_args(hold, now)
        held = (hold.pool, hold.key, hold.run, hold.cost, hold.tokens, hold.expires)
        if self.WRITABLE_CTE:
            sql = (
                f"WITH taken AS ({update} RETURNING name) INSERT INTO mklang_pool_holds ({HOLD_COLUMNS}) "
                "SELECT ?, ?, ?, ?, ?, ? FROM taken RETURNING key"
            )
            return bool(self._rows(sql, *args, *held))
        insert = (
            f"INSERT INTO mklang_pool_holds ({HOLD_COLUMNS}) SELECT ?, ?, ?, ?, ?, ? WHERE changes() = 1 RETURNING key"
        )
        return bool(self._transaction([(update, args), (insert, held)]))

    def settle(self, pool: str, key: str, cost: float, tokens: int) -> bool:
        return self._release(pool, "key = ?", (key,), (cost, tokens)) > 0

    def charge_held(self, pool: str, now: float, key: str | None = None) -> int:
        if key is None:
            return self._release(pool, "expires < ?", (now,), (None, None))
        return self._release(pool, "key = ?", (key,), (None, None))

    def _release(self, pool: str, where: str, args: tuple[object, ...], charged: tuple[object, object]) -> int:
        """Release the pool's holds that `where` picks, charging `charged` (None: their reservations)."""
        picked = f"mklang_pool_holds WHERE pool = ? AND {where}"
        release = RELEASE.replace("{greatest}", self.GREATEST).replace("{least}", self.LEAST)
        if self.WRITABLE_CTE:
            sql = f"WITH gone AS (DELETE FROM {picked} RETURNING cost, tokens) {release.replace('{held}', 'gone')}"
            rows = self._rows(sql + " RETURNING g.n", pool, *args, *charged, pool)
            return int(rows[0][0]) if rows else 0
        update = release.replace("{held}", picked)
        deleted = f"DELETE FROM {picked} RETURNING key"
        return len(self._transaction([(update, (*charged, pool, *args, pool)), (deleted, (pool, *args))]))

    def held(self, pool: str, run: str) -> list[str]:
        rows = self._select("SELECT key FROM mklang_pool_holds WHERE pool = ? AND run = ? ORDER BY key", pool, run)
        return [str(row[0]) for row in rows]

    def pause(self, pool: str, until: float) -> None:
        self._rows(
            f"UPDATE mklang_pools SET paused_until = {self.GREATEST}(paused_until, ?) WHERE name = ?",
            until,
            pool,
        )

    def note_waiting(self, run: str, pool: str | None) -> None:
        if pool is None:
            self._rows("DELETE FROM mklang_pool_waits WHERE run = ?", run)
        else:
            self._rows(
                "INSERT INTO mklang_pool_waits (pool, run, since) VALUES (?, ?, ?) ON CONFLICT (pool, run) DO NOTHING",
                pool,
                run,
                time.time(),
            )


def _reserve_args(hold: Hold, now: float) -> tuple[object, ...]:
    """The arguments of `RESERVE`, in the order of its placeholders."""
    return (
        hold.cost,
        hold.tokens,
        now,  # the rpm bucket's refill
        now,  # the tpm bucket's refill
        hold.tokens,
        now,  # bucket_at
        hold.pool,
        hold.cost,
        hold.tokens,
        now,  # paused_until
        now,
        now,
        hold.tokens,
    )
