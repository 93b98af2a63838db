"""What a listing shows of a stored run (`RunSummary`) and which runs it asks for (`RunQuery`).

A store keeps a run's summary beside its envelope (SQL: columns of its row;
the file store: a small file), written by the checkpoint layer with every
envelope, so that listing many runs reads no envelope. A summary is display
only: nothing is decided from it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

# What a run's status is in its summary: as its envelope says, `running` also while a resume runs.
SUMMARY_STATUSES = ("running", "suspended", "done", "halted")


@dataclass(frozen=True)
class RunSummary:
    """What a listing shows of a run, kept beside its envelope so that listing many runs reads none.

    Display only: nothing is decided from it (a tampered summary misleads a listing, nothing more);
    `show`, `resume`, `runs rm` and `runs prune` decide from the signed envelope. Times are seconds
    since the epoch as the store recorded them: `started` when the run (this run id) was first
    summarized there, `updated` at its last write. None: not known (a run written before summaries).
    """

    run: str
    run_id: str | None = None
    machine: str | None = None
    status: str | None = None  # one of SUMMARY_STATUSES; None when unknown
    reason: str | None = None  # why it is suspended or halted; the question of a run parked on one
    tokens: int = 0
    cost_usd: float = 0.0
    started: float | None = None
    updated: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, run: str, data: dict[str, Any]) -> RunSummary:
        """A summary as `to_json` wrote it; a field of the wrong type is left unknown (a summary is
        display only, but a tampered one must not break a listing)."""

        def text(name: str) -> str | None:
            value = data.get(name)
            return value if isinstance(value, str) else None

        def number(name: str) -> float | None:
            value = data.get(name)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

        status = text("status")
        return cls(
            run,
            run_id=text("run_id"),
            machine=text("machine"),
            status=status if status in SUMMARY_STATUSES else None,
            reason=text("reason"),
            tokens=int(number("tokens") or 0),
            cost_usd=number("cost_usd") or 0.0,
            started=number("started"),
            updated=number("updated"),
        )


@dataclass(frozen=True)
class RunQuery:
    """Which summaries a listing wants: newest started first (then by run name), filtered, one page."""

    statuses: tuple[str, ...] = ()  # any of these; empty: every status
    machine: str | None = None  # the root machine's name
    since: float | None = None  # updated at or after (seconds since the epoch)
    limit: int | None = None
    offset: int = 0

    def keeps(self, summary: RunSummary) -> bool:
        """Whether `summary` passes the filters (for stores that filter in Python)."""
        return (
            (not self.statuses or summary.status in self.statuses)
            and (self.machine is None or summary.machine == self.machine)
            and (self.since is None or (summary.updated or 0.0) >= self.since)
        )

    def page(self, summaries: list[RunSummary]) -> list[RunSummary]:
        """Filter, order and cut `summaries` as the query says (for stores that do it in Python)."""
        kept = sorted((s for s in summaries if self.keeps(s)), key=lambda s: s.run)
        kept.sort(key=lambda s: s.started or 0.0, reverse=True)
        end = None if self.limit is None else self.offset + self.limit
        return kept[self.offset : end]


def peek_summary(run: str, raw: bytes, when: float | None) -> RunSummary:
    """A summary read from an envelope's bytes, for a run stored before summaries were kept
    (`when`: the time the store knows it by). Display only, like every summary: unverified."""
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        return RunSummary(run, started=when, updated=when)

    def text(value: Any) -> str | None:
        return value if isinstance(value, str) else None

    status = text(data.get("status"))
    usage: dict[str, Any] = data["usage"] if isinstance(data.get("usage"), dict) else {}
    machine: dict[str, Any] = data["machine"] if isinstance(data.get("machine"), dict) else {}
    counts = (usage.get("input_tokens"), usage.get("output_tokens"))
    tokens = sum(value for value in counts if isinstance(value, int) and not isinstance(value, bool))
    cost = usage.get("cost_usd")
    return RunSummary(
        run,
        run_id=text(data.get("run_id")),
        machine=text(machine.get("name")),
        status=status if status in SUMMARY_STATUSES else None,
        reason=summary_reason(status, text(data.get("reason")), text(data.get("error")), text(data.get("ask"))),
        tokens=tokens,
        cost_usd=float(cost) if isinstance(cost, (int, float)) else 0.0,
        started=when,
        updated=when,
    )


def summary_reason(status: str | None, reason: str | None, error: str | None, ask: str | None) -> str | None:
    """The reason a summary shows: the question a parked run asks, why one is suspended, a halt's error."""
    if status == "suspended":
        return ask or reason
    return error if status == "halted" else None
