"""What a listing shows of a stored run (`RunSummary`) and which runs it asks for (`RunQuery`).

A store keeps a run's summary beside its envelope (SQL: columns of its row;
the file store: a small file), written by the checkpoint layer with every
envelope, so that listing many runs reads no envelope. A summary is display
only: nothing is decided from it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Any, Literal

from mklang.limits import COST_SLACK

# What a run's status is in its summary: as its envelope says, `running` also while a resume runs.
SUMMARY_STATUSES = ("running", "suspended", "done", "halted")
SHOWN_MAX = 8192  # characters of canonical JSON: a value a decision shows that is longer is not summarized


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
    # What a run parked on a human asks (`asked_summary`), for the inbox's cards; None: nothing.
    asks: dict[str, Any] | None = field(default=None, compare=False)
    deadline: float | None = None  # of the decision it waits on (seconds since the epoch)
    budget_tokens: int | None = None  # the run's caps, for spend against budget
    budget_cost: float | None = None
    over_budget: bool = False  # its spend reached a cap (`over_budget`)

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
        asks = data.get("asks")
        budget_tokens = number("budget_tokens")
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
            asks=asks if isinstance(asks, dict) else None,
            deadline=number("deadline"),
            budget_tokens=None if budget_tokens is None else int(budget_tokens),
            budget_cost=number("budget_cost"),
            over_budget=data.get("over_budget") is True,
        )


Order = Literal["newest", "question"]
NEVER = 1e18  # the deadline a run without one sorts by: after every real one
# What a tally may group summaries by (`RunQuery.tally`): summary fields that are columns too.
TALLIED = ("status", "machine", "reason")


@dataclass(frozen=True)
class RunQuery:
    """Which summaries a listing wants, filtered, ordered and cut to one page: `newest` started
    first (then by run name), or by `question`: machine, question, soonest deadline, newest."""

    statuses: tuple[str, ...] = ()  # any of these; empty: every status
    machine: str | None = None  # the root machine's name
    since: float | None = None  # updated at or after (seconds since the epoch)
    limit: int | None = None
    offset: int = 0
    until: float | None = None  # updated at or before: parked at least this long
    due_by: float | None = None  # waiting on a deadline at or before this
    search: str | None = None  # in the run's name or its reason (the question it asks), any case
    reason: str | None = None  # exactly this reason (one question of the inbox)
    asking: bool = False  # only runs that ask a human (their `asks`)
    over_budget: bool = False  # only runs whose spend reached a cap
    order: Order = "newest"

    def keeps(self, summary: RunSummary) -> bool:
        """Whether `summary` passes the filters (for stores that filter in Python)."""
        needle = (self.search or "").lower()
        return (
            (not self.statuses or summary.status in self.statuses)
            and (self.machine is None or summary.machine == self.machine)
            and (self.since is None or (summary.updated or 0.0) >= self.since)
            and (self.until is None or (summary.updated or 0.0) <= self.until)
            and (self.due_by is None or (summary.deadline is not None and summary.deadline <= self.due_by))
            and (not needle or needle in summary.run.lower() or needle in (summary.reason or "").lower())
            and (self.reason is None or summary.reason == self.reason)
            and (not self.asking or summary.asks is not None)
            and (not self.over_budget or summary.over_budget)
        )

    def page(self, summaries: list[RunSummary]) -> list[RunSummary]:
        """Filter, order and cut `summaries` as the query says (for stores that do it in Python)."""
        kept = sorted((s for s in summaries if self.keeps(s)), key=lambda s: s.run)
        kept.sort(key=lambda s: s.started or 0.0, reverse=True)
        if self.order == "question":
            kept.sort(key=lambda s: (s.machine or "", s.reason or "", NEVER if s.deadline is None else s.deadline))
        end = None if self.limit is None else self.offset + self.limit
        return kept[self.offset : end]

    def tally(self, summaries: list[RunSummary], by: tuple[str, ...]) -> list[Tally]:
        """The summaries the query keeps (all pages), counted in groups of the fields `by` (of
        `TALLIED`), ordered by them (for stores that do it in Python)."""
        groups: dict[tuple[str | None, ...], list[RunSummary]] = {}
        for summary in summaries:
            if self.keeps(summary):
                groups.setdefault(tuple(getattr(summary, name) for name in by), []).append(summary)
        return [
            Tally(
                key,
                len(runs),
                sum(s.tokens for s in runs),
                sum(s.cost_usd for s in runs),
                sum(s.over_budget for s in runs),
                min((s.deadline for s in runs if s.deadline is not None), default=None),
            )
            for key, runs in sorted(groups.items(), key=lambda item: tuple(part or "" for part in item[0]))
        ]


@dataclass(frozen=True)
class Tally:
    """One group of a tally: how many runs, what they spent, how many are over budget, and the
    soonest deadline among them."""

    key: tuple[str | None, ...]
    runs: int
    tokens: int
    cost_usd: float
    over_budget: int
    soonest: float | None = None


def asked_summary(asked: Any, ask: str | None, context: Any) -> dict[str, Any] | None:
    """What a summary keeps of the question a parked run asks (its frame's `ask` record, the run's
    `ask` text, the frame's context), for a card of the inbox: the text and where a free-text reply
    goes, and for a decision its id, choices, deadline, the digest it recorded and the value it
    shows when that is short (`SHOWN_MAX`). None when the run asks nothing. Display only."""
    if not isinstance(asked, dict) or not ask:
        return None
    kept: dict[str, Any] = {"ask": ask, "reply_to": asked.get("reply_to")}
    if "choices" not in asked:
        return kept
    from mklang.vocabulary import lookup

    kept.update({key: asked.get(key) for key in ("question", "choices", "show", "digest", "asked_at", "deadline")})
    shown = asked.get("show")
    if isinstance(shown, str) and isinstance(context, dict):
        value = lookup(context, shown)
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
        kept["shown"] = value if len(text) <= SHOWN_MAX else None
        kept["too_long"] = len(text) > SHOWN_MAX
    return kept


def epoch(stamp: Any) -> float | None:
    """An ISO 8601 time (a deadline) as seconds since the epoch; None when it is not one."""
    try:
        return datetime.fromisoformat(stamp).timestamp() if isinstance(stamp, str) else None
    except ValueError:
        return None


def over_budget(tokens: int, cost: float, budget_tokens: int | None, budget_cost: float | None) -> bool:
    """Whether a run's spend reached one of its caps (the rule `Caps.reached` applies as it runs)."""
    return (budget_tokens is not None and tokens >= budget_tokens) or (
        budget_cost is not None and cost >= budget_cost - COST_SLACK
    )


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
    budgets: dict[str, Any] = data["budgets"] if isinstance(data.get("budgets"), dict) else {}
    frames = data.get("frames")
    frame: dict[str, Any] = frames[-1] if isinstance(frames, list) and frames and isinstance(frames[-1], dict) else {}
    caps = [budgets.get(name) for name in ("max_tokens", "max_cost")]
    budget_tokens = caps[0] if isinstance(caps[0], int) and not isinstance(caps[0], bool) else None
    budget_cost = float(caps[1]) if isinstance(caps[1], (int, float)) and not isinstance(caps[1], bool) else None
    spent = float(cost) if isinstance(cost, (int, float)) else 0.0
    return summarized(
        RunSummary(
            run,
            run_id=text(data.get("run_id")),
            machine=text(machine.get("name")),
            status=status if status in SUMMARY_STATUSES else None,
            reason=summary_reason(status, text(data.get("reason")), text(data.get("error")), text(data.get("ask"))),
            tokens=tokens,
            cost_usd=spent,
            started=when,
            updated=when,
            budget_tokens=budget_tokens,
            budget_cost=budget_cost,
        ),
        frame.get("ask"),
        text(data.get("ask")),
        frame.get("context"),
    )


def summarized(summary: RunSummary, asked: Any, ask: str | None, context: Any) -> RunSummary:
    """`summary` with what it keeps of the question the run asks (a suspended run's) and whether it
    is over budget."""
    asks = asked_summary(asked, ask, context) if summary.status == "suspended" else None
    return replace(
        summary,
        asks=asks,
        deadline=epoch(asks.get("deadline")) if asks else None,
        over_budget=over_budget(summary.tokens, summary.cost_usd, summary.budget_tokens, summary.budget_cost),
    )


def summary_reason(status: str | None, reason: str | None, error: str | None, ask: str | None) -> str | None:
    """The reason a summary shows: the question a parked run asks, why one is suspended, a halt's error."""
    if status == "suspended":
        return ask or reason
    return error if status == "halted" else None
