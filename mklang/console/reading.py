"""What the console's pages show of a store's runs, as plain data for the templates.

The runs list and the inbox show the summaries the store keeps (`stores.summaries_of`, as `mklang
runs` does), so a page reads no envelope; they are display only (ADR 0064): an answer is bound to
the question's id and the digest of the value its card showed, and decided from the signed
envelope under the run's lock. A run's own page reads it through `mklang.runs` the way `mklang
show` does (`runs.inspection.described`), so a run that cannot be verified shows as `failed` with
why, and nothing it holds is rendered.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from mklang.engine.decisions import digest
from mklang.errors import MklangError, first_line, redacted
from mklang.runs import location
from mklang.runs.driving import BUDGET_REASONS
from mklang.runs.inspection import described, held
from mklang.stores import RunQuery, RunStore, Tally, pools_of, summaries_of, tallies_of
from mklang.stores.pools import Pool
from mklang.stores.summary import SUMMARY_STATUSES, RunSummary, epoch
from mklang.vocabulary import duration_seconds, lookup

PAGE = 50  # runs on one page of the list
WHOLE_TRACE = 1_000_000  # `describe`'s `last`: every step


@dataclass(frozen=True)
class Page:
    """One page of the runs list, newest first; `more`: older runs follow it. `counts`: the runs the
    filters keep, by status, with their spend (`Tally`); `filters`: as the page was asked."""

    number: int
    rows: list[dict[str, Any]]
    more: bool
    counts: list[Tally] = field(default_factory=list)
    filters: dict[str, str] = field(default_factory=dict)
    problem: str | None = None  # a filter that could not be read, and is left out
    pools: list[Pool] = field(default_factory=list)  # the store's budget pools, whatever the filters

    @property
    def total(self) -> Tally:
        """Every run the filters keep, counted together."""
        return Tally(
            (),
            sum(t.runs for t in self.counts),
            sum(t.tokens for t in self.counts),
            sum(t.cost_usd for t in self.counts),
            sum(t.over_budget for t in self.counts),
        )


def when(seconds: float | None) -> str:
    """A store's time as UTC text; empty when it has none."""
    if not seconds:
        return ""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S")


def row(summary: RunSummary) -> dict[str, Any]:
    """A run as one line of the runs list and the inbox, from its summary (display only)."""
    return {
        "run": summary.run,
        "machine": summary.machine or "",
        "status": summary.status or "unknown",
        "why": summary.reason or "",
        "tokens": summary.tokens,
        "cost": summary.cost_usd,
        "budget_tokens": summary.budget_tokens,
        "budget_cost": summary.budget_cost,
        "over_budget": summary.over_budget,
        "started": when(summary.started),
        "updated": when(summary.updated),
        "waiting": summary.asks is not None,
    }


def waits_for_reply(described: dict[str, Any]) -> bool:
    """A run parked on a human question (as `described` tells): what the inbox lists and a reply resumes."""
    return (
        described["status"] == "suspended"
        and described.get("reason") == "escalated"
        and bool(described.get("reply_to"))
    )


RUN_FILTERS = ("status", "machine", "since", "q", "over")


def runs_page(store: RunStore, number: int, asked: Mapping[str, str] | None = None, now: float = 0.0) -> Page:
    """Page `number` (from 1) of the store's runs the filters `asked` keep (`RUN_FILTERS`: a status,
    a machine, `since` a duration ago, a search of run names and questions, over budget only):
    summaries only, one more than a page to tell whether older ones follow, and their counts."""
    filters = {name: asked[name].strip() for name in RUN_FILTERS if asked and asked.get(name, "").strip()}
    problem = None
    since = None
    if "since" in filters:
        seconds = duration_seconds(filters["since"])
        if seconds is None:
            problem = f"since {filters.pop('since')!r} is not a duration (30m, 6h, 2d): left out"
        else:
            since = (now or time.time()) - seconds
    status = filters.get("status")
    query = RunQuery(
        statuses=(status,) if status in SUMMARY_STATUSES else (),
        machine=filters.get("machine"),
        since=since,
        search=filters.get("q"),
        over_budget="over" in filters,
    )
    summaries = summaries_of(store, replace(query, limit=PAGE + 1, offset=(number - 1) * PAGE))
    counts = tallies_of(store, replace(query, statuses=()), ("status",))
    rows = [row(summary) for summary in summaries[:PAGE]]
    return Page(number, rows, len(summaries) > PAGE, counts, filters, problem, pools_of(store))


INBOX_PAGE = 25  # cards on one page of the inbox: a page of them stays well under 200 KB
INBOX_FILTERS = ("machine", "question", "older", "due")


@dataclass(frozen=True)
class InboxPage:
    """One page of the inbox: its cards in groups of one machine and question (soonest deadline
    first), every group the filters keep with its count, and the filters as asked."""

    number: int
    groups: list[dict[str, Any]]  # the groups of this page's cards, in order, each with its `cards`
    questions: list[Tally]  # (machine, question) -> how many wait, the soonest deadline
    more: bool
    filters: dict[str, str]
    problem: str | None = None

    @property
    def waiting(self) -> int:
        return sum(group.runs for group in self.questions)


def inbox_page(
    store: RunStore, uri: str, number: int, asked: Mapping[str, str] | None = None, now: float = 0.0
) -> InboxPage:
    """Page `number` of the runs parked on a human question that the filters `asked` keep
    (`INBOX_FILTERS`: a machine, a question, parked `older` than a duration, `due` within one),
    from their summaries: no envelope of a decision is read to list it (a free-text question's
    card shows the context it is about, read from its envelope)."""
    now = now or time.time()
    filters = {name: asked[name].strip() for name in INBOX_FILTERS if asked and asked.get(name, "").strip()}
    problems = []
    bounds: dict[str, float] = {}
    for name, sign in (("older", -1), ("due", 1)):
        if name in filters:
            seconds = duration_seconds(filters[name])
            if seconds is None:
                problems.append(f"{name} {filters.pop(name)!r} is not a duration (30m, 6h, 2d): left out")
            else:
                bounds[name] = now + sign * seconds
    query = RunQuery(
        statuses=("suspended",),
        asking=True,
        machine=filters.get("machine"),
        reason=filters.get("question"),
        until=bounds.get("older"),
        due_by=bounds.get("due"),
        order="question",
    )
    summaries = summaries_of(store, replace(query, limit=INBOX_PAGE + 1, offset=(number - 1) * INBOX_PAGE))
    groups: list[dict[str, Any]] = []
    for summary in summaries[:INBOX_PAGE]:
        if not groups or (groups[-1]["machine"], groups[-1]["question"]) != (summary.machine, summary.reason):
            groups.append({"machine": summary.machine, "question": summary.reason, "cards": [], "index": len(groups)})
        shown = card(summary, now)
        if not shown["decision"]:
            shown["context"] = held(store, uri, summary.run)["context"]
        groups[-1]["cards"].append(shown)
    for group in groups:
        choices = {tuple(c["choices"]) for c in group["cards"] if c["choices"]}
        group["choices"] = list(next(iter(choices))) if len(choices) == 1 else []  # one set: answered at once
    questions = tallies_of(store, query, ("machine", "reason"))
    return InboxPage(number, groups, questions, len(summaries) > INBOX_PAGE, filters, "; ".join(problems) or None)


def card(summary: RunSummary, now: float) -> dict[str, Any]:
    """What a card of the inbox shows of a parked run, from its summary: the question, the value it
    shows as text, its choices, the time left, and what an answer is bound to (the question's id
    and the digest of the value shown: an answer is refused unless the run still shows that)."""
    asks = summary.asks or {}
    decision = "choices" in asks
    shown = asks.get("shown")
    text = None if asks.get("too_long") or not asks.get("show") else as_text(shown)
    return {
        **row(summary),
        "ask": asks.get("ask") or summary.reason or "",
        "reply_to": asks.get("reply_to"),
        "decision": decision,
        "question": asks.get("question") if decision else None,
        "choices": [str(choice) for choice in asks.get("choices") or []] if decision else [],
        "show": asks.get("show"),
        "text": text,
        "binding": f"{summary.run} {asks.get('question')} {digest(shown) if text is not None else '-'}",
        "left": time_left(summary.deadline, now),
        "overdue": summary.deadline is not None and summary.deadline <= now,
    }


def as_text(value: Any, indent: str = "") -> str:
    """A value a question shows, as a human reads it: text as itself, a map as `key: value` lines,
    a list as `- item` lines, nested ones indented (not JSON, whose escapes hide the text)."""
    if isinstance(value, str):
        return value
    if value is None:
        return "(nothing)"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            inner = as_text(item, indent + "  ")
            nested = isinstance(item, (dict, list)) and item
            lines.append(f"{indent}{key}:\n{inner}" if nested else f"{indent}{key}: {inner}")
        return "\n".join(lines) or "(empty)"
    if isinstance(value, list):
        items = [as_text(item, indent + "  ").lstrip() for item in value]
        return "\n".join(f"{indent}- {item}" for item in items) or "(empty)"
    return str(value)


def time_left(deadline: float | None, now: float) -> str:
    """How long a question may still wait: `2d 3h left`, `14m left`; past it, what takes it."""
    if deadline is None:
        return ""
    seconds = int(deadline - now)
    if seconds <= 0:
        return "timed out: the next sweep takes it"
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes = rest // 60
    parts = [f"{days}d"] * bool(days) + [f"{hours}h"] * bool(hours) + [f"{minutes}m"] * bool(minutes and not days)
    return (" ".join(parts) or "under a minute") + " left"


def run_view(store: RunStore, uri: str, run: str) -> dict[str, Any]:
    """Everything the run page shows: status, spend against budgets, the whole trace, frames and ask;
    for a run waiting on a decision, its card, made from the envelope (the whole value it shows)."""
    summary = described(store, uri, run, last=WHOLE_TRACE)
    kept = held(store, uri, run) if summary["status"] != "failed" else {"context": {}, "result": None}
    view = {"run": run, **summary, **kept, "waiting": waits_for_reply(summary)}
    if summary["status"] == "suspended":
        view["migration"] = migration(store, uri, run)
    # The run page's actions (ADR 0068): what the operator may do to it; each is decided again under its lock.
    view["cancellable"] = summary["status"] in ("running", "suspended")
    view["raisable"] = summary["status"] == "suspended" and summary.get("reason") in BUDGET_REASONS
    asked = summary.get("question")
    if view["waiting"] and isinstance(asked, dict):
        show = asked.get("show")
        asks = {**asked, "ask": summary.get("ask"), "reply_to": summary.get("reply_to")}
        asks["shown"] = lookup(kept["context"], show) if isinstance(show, str) else None
        machine = summary.get("machine", {}).get("name")
        parked = RunSummary(run, machine=machine, status="suspended", asks=asks, deadline=epoch(asked.get("deadline")))
        view["card"] = card(parked, time.time())
    return view


def migration(store: RunStore, uri: str, run: str) -> dict[str, str] | None:
    """A parked run of an older version of its machine files (edited since it parked): the file
    and its class against them as they are now, as `mklang runs migrate --dry-run` says it
    (`runs.migrating.against_its_files`); None when its files are unchanged."""
    from mklang.runs.migrating import against_its_files

    try:
        classified = against_its_files(location(store, uri, run))
    except MklangError as error:
        return {"kind": "refused", "text": f"refused: {redacted(first_line(error))}", "machine": ""}
    if classified is None:
        return None
    root, verdict = classified
    return {"kind": verdict.kind, "text": verdict.text(), "machine": str(root)}


def fork_preview(store: RunStore, uri: str, run: str, at: str) -> dict[str, Any]:
    """What "fork from here" shows before anything is paid, as `mklang fork --dry-run` says it
    (`forking.preview`): where the fork starts and the effectful tool states the run ran from there
    on, which the fork may run again; and a name for the fork. A step the run did not take, or a
    run that cannot be forked, is one UsageError or CheckpointError line."""
    from mklang.forking import preview, read_source, step_path

    shown = preview(read_source(location(store, uri, run)), step_path(at))
    return {**shown.to_json(), "run": run, "name": f"{run}-fork-{shown.step.replace('.', '-')}"}


def drawing(store: RunStore, uri: str, run: str, trace: list[dict[str, Any]]) -> Any:
    """The run's machine as a graph with the path it took (`mklang.graph.build`), or why there is none."""
    from mklang.graph import build
    from mklang.runs.inspection import machine_of

    try:
        return build(machine_of(location(store, uri, run)), trace)
    except MklangError as error:
        return str(error).splitlines()[0]
