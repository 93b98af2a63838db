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
