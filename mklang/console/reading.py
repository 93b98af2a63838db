"""What the console's pages show of a store's runs, as plain data for the templates.

The runs list shows the summaries the store keeps (`stores.summaries_of`, as `mklang runs` does), so
a page reads no envelope. A run's own page and the inbox read it through `mklang.runs` the way
`mklang show` does (`runs.inspection.described`), so a run that cannot be verified shows as
`failed` with why, and nothing it holds is rendered.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from mklang.errors import MklangError
from mklang.runs import location
from mklang.runs.inspection import described, held
from mklang.stores import RunQuery, RunStore, summaries_of
from mklang.stores.summary import RunSummary

PAGE = 50  # runs on one page of the list
WHOLE_TRACE = 1_000_000  # `describe`'s `last`: every step


@dataclass(frozen=True)
class Page:
    """One page of the runs list, newest first; `more`: older runs follow it."""

    number: int
    rows: list[dict[str, Any]]
    more: bool


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
        "started": when(summary.started),
        "updated": when(summary.updated),
        "waiting": summary.status == "suspended",
    }


def waits_for_reply(described: dict[str, Any]) -> bool:
    """A run parked on a human question (as `described` tells): what the inbox lists and a reply resumes."""
    return (
        described["status"] == "suspended"
        and described.get("reason") == "escalated"
        and bool(described.get("reply_to"))
    )


def runs_page(store: RunStore, number: int) -> Page:
    """Page `number` (from 1) of the store's runs: summaries only, one more than a page to tell
    whether older ones follow."""
    summaries = summaries_of(store, RunQuery(limit=PAGE + 1, offset=(number - 1) * PAGE))
    return Page(number, [row(summary) for summary in summaries[:PAGE]], len(summaries) > PAGE)


class Inbox:
    """The runs waiting on a human reply, newest first, with the context the question is about.

    Only suspended runs are read (the store's summaries say which), each again only when the store
    wrote it since."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[float | None, dict[str, Any] | None]] = {}  # run -> (updated, its entry)

    def entries(self, store: RunStore, uri: str) -> list[dict[str, Any]]:
        seen = {}
        for summary in summaries_of(store, RunQuery(statuses=("suspended",))):
            known = self._seen.get(summary.run)
            if known is None or known[0] != summary.updated:
                known = (summary.updated, _entry(store, uri, summary))
            seen[summary.run] = known
        self._seen = seen
        return [entry for _, entry in seen.values() if entry is not None]


def _entry(store: RunStore, uri: str, summary: RunSummary) -> dict[str, Any] | None:
    described_run = described(store, uri, summary.run)
    if not waits_for_reply(described_run):
        return None
    return {**row(summary), "reply_to": described_run["reply_to"], **held(store, uri, summary.run)}


def run_view(store: RunStore, uri: str, run: str) -> dict[str, Any]:
    """Everything the run page shows: status, spend against budgets, the whole trace, frames and ask."""
    summary = described(store, uri, run, last=WHOLE_TRACE)
    kept = held(store, uri, run) if summary["status"] != "failed" else {"context": {}, "result": None}
    return {"run": run, **summary, **kept, "waiting": waits_for_reply(summary)}


def drawing(store: RunStore, uri: str, run: str, trace: list[dict[str, Any]]) -> Any:
    """The run's machine as a graph with the path it took (`mklang.graph.build`), or why there is none."""
    from mklang.graph import build
    from mklang.runs.inspection import machine_of

    try:
        return build(machine_of(location(store, uri, run)), trace)
    except MklangError as error:
        return str(error).splitlines()[0]
