"""What a process says to PostgreSQL, counted from libpq's own protocol trace.

`counted()` traces every psycopg connection opened inside it (libpq's
`PQtrace`, message by message) and counts, per connection and in all:

- exchanges: each answer that ends with the server's ReadyForQuery, i.e. each
  time the client waits for the server (a round trip, as nothing is pipelined);
- commits: exchanges that end a transaction which wrote (an INSERT, UPDATE or
  DELETE outside `BEGIN`, or a `COMMIT`);
- flushed commits: those of them that wait for the write-ahead log's flush,
  i.e. whose transaction did not turn `synchronous_commit` off.

The counts come from the bytes on the wire, not from the code that sends them.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import pq

UNFLUSHED = "set_config('synchronous_commit', 'off', true)"
WRITES = ("INSERT", "UPDATE", "DELETE", "COMMIT")


@dataclass
class Counts:
    exchanges: int = 0
    commits: int = 0
    flushed: int = 0

    def add(self, other: Counts) -> None:
        self.exchanges += other.exchanges
        self.commits += other.commits
        self.flushed += other.flushed


def messages(trace: str) -> Iterator[tuple[str, str, str]]:
    """(direction F or B, message type, the rest) of each message in a libpq trace; a string
    in a message may span lines."""
    current: list[str] | None = None
    for line in trace.split("\n"):
        fields = line.split("\t", 3)
        if len(fields) == 4 and fields[0] in ("F", "B") and fields[1].isdigit():
            if current is not None:
                yield current[0], current[2], current[3]
            current = fields
        elif current is not None:
            current[3] += "\n" + line
    if current is not None:
        yield current[0], current[2], current[3]


def count(trace: str) -> Counts:
    """The exchanges, commits and flushed commits of one connection's trace."""
    counts = Counts()
    prepared: dict[str, str] = {}  # statement name -> its text
    wrote = unflushed = False  # in the transaction in progress
    for direction, kind, rest in messages(trace):
        if direction == "F" and kind == "Parse":
            name, text = re.match(r' "([^"]*)" "(.*)" \d+', rest, re.S).groups()  # type: ignore[union-attr]
            prepared[name] = text
        elif direction == "F" and kind == "Bind":
            name = re.match(r' "[^"]*" "([^"]*)"', rest).group(1)  # type: ignore[union-attr]
            unflushed |= UNFLUSHED in prepared.get(name, "")  # an unknown name: refused
        elif direction == "F" and kind == "Query":
            unflushed |= UNFLUSHED in rest
        elif direction == "B" and kind == "CommandComplete":
            wrote |= rest.strip(' "').startswith(WRITES)
        elif direction == "B" and kind == "ReadyForQuery":
            counts.exchanges += 1
            if rest.strip() == "I":  # no transaction open: the one before ended here
                if wrote:
                    counts.commits += 1
                    counts.flushed += not unflushed
                wrote = unflushed = False
    return counts


@contextlib.contextmanager
def counted() -> Iterator[Counts]:
    """Counts of every connection `psycopg.connect` opens in the block, filled in when it ends."""
    total = Counts()
    traced: list[tuple[Any, Path]] = []
    connect = psycopg.connect

    def tracing(*args: Any, **kwargs: Any) -> Any:
        db = connect(*args, **kwargs)
        with tempfile.NamedTemporaryFile("w", prefix="pgtrace", delete=False) as handle:
            traced.append((db, Path(handle.name)))
            db.pgconn.trace(os.dup(handle.fileno()))  # libpq's own stream, left open as long as the process
        db.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        return db

    psycopg.connect = tracing
    try:
        yield total
    finally:
        psycopg.connect = connect
        for db, path in traced:
            db.pgconn.untrace()  # libpq writes what it read at its next send: now, for a connection still open
            total.add(count(path.read_text()))
        for _, path in traced:
            path.unlink()
