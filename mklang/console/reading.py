"""What the console's pages show of a store's runs, as plain data for the templates.

Every run is read the way `mklang runs` and `mklang show` read it (`batching.described`), so a
run that cannot be verified shows as `failed` with why, and nothing it holds is rendered.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from mklang.batching import described, location
from mklang.errors import MklangError
from mklang.stores import Store
from mklang.stores.stamps import Stamp

PAGE = 50  # runs on one page of the list
WHOLE_TRACE = 1_000_000  # `describe`'s `last`: every step


@dataclass(frozen=True)
class Page:
    """One page of the runs list, newest first."""

    number: int
    total: int
    rows: list[dict[str, Any]]

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // PAGE))


def when(seconds: float | None) -> str:
    """A store's time as UTC text; empty when it has none."""
    if not seconds:
        return ""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S")


def row(summary: dict[str, Any], stamp: Stamp) -> dict[str, Any]:
    """A run as one line of the runs list and the inbox."""
    machine = summary.get("machine") or {}
    return {
        "run": stamp.run,
        "machine": machine.get("name", ""),
        "status": summary["status"],
        "why": summary.get("ask") or summary.get("reason") or summary.get("error") or "",
        "tokens": (summary.get("tokens") or {}).get("spent"),
        "cost": (summary.get("cost_usd") or {}).get("spent"),
        "started": when(stamp.started),
        "updated": when(stamp.updated),
        "waiting": waits_for_reply(summary),
    }


def waits_for_reply(summary: dict[str, Any]) -> bool:
    """A run parked on a human question: what the inbox lists and a reply resumes."""
    return summary["status"] == "suspended" and summary.get("reason") == "escalated" and bool(summary.get("reply_to"))


def runs_page(store: Store, uri: str, number: int) -> Page:
    """Page `number` (from 1) of the store's runs: only its runs' envelopes are read."""
    total, stamps = store.listing((number - 1) * PAGE, PAGE)
    return Page(number, total, [row(described(store, uri, stamp.run), stamp) for stamp in stamps])


class Inbox:
    """The runs waiting on a human reply, newest first, with the context the question is about.

    Finding them reads every run once; after that only runs the store wrote since are read again."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[float, dict[str, Any] | None]] = {}  # run -> (updated, its entry if waiting)

    def entries(self, store: Store, uri: str) -> list[dict[str, Any]]:
        total, _ = store.listing(0, 0)
        _, stamps = store.listing(0, total)
        seen = {}
        for stamp in stamps:
            known = self._seen.get(stamp.run)
            seen[stamp.run] = (
                known if known and known[0] == stamp.updated else (stamp.updated, _entry(store, uri, stamp))
            )
        self._seen = seen
        return [entry for _, entry in seen.values() if entry is not None]


def _entry(store: Store, uri: str, stamp: Stamp) -> dict[str, Any] | None:
    summary = described(store, uri, stamp.run)
    if not waits_for_reply(summary):
        return None
    return {**row(summary, stamp), "reply_to": summary["reply_to"], **_held(store, uri, stamp.run)}


def _held(store: Store, uri: str, run: str) -> dict[str, Any]:
    """What a verified run holds besides what `describe` tells: the context of its innermost level
    (what a question is about) and its result."""
    from mklang.checkpoint.envelope import load

    try:
        envelope = load(location(store, uri, run))
    except MklangError:
        return {"context": {}, "result": None}
    frames = envelope.frames
    return {"context": frames[-1]["context"] if frames else {}, "result": envelope.result}


def run_view(store: Store, uri: str, run: str) -> dict[str, Any]:
    """Everything the run page shows: status, spend against budgets, the whole trace, frames and ask."""
    summary = described(store, uri, run, last=WHOLE_TRACE)
    held = _held(store, uri, run) if summary["status"] != "failed" else {"context": {}, "result": None}
    return {"run": run, **summary, **held, "waiting": waits_for_reply(summary)}


def drawing(store: Store, uri: str, run: str, trace: list[dict[str, Any]]) -> Any:
    """The run's machine as a graph with the path it took (`mklang.graph.build`), or why there is none."""
    from mklang.graph import build
    from mklang.inspection import machine_of

    try:
        return build(machine_of(location(store, uri, run)), trace)
    except MklangError as error:
        return str(error).splitlines()[0]


def can_draw_svg() -> bool:
    """Whether Graphviz's `dot` is there to draw a graph; without it the page lists states and edges."""
    return shutil.which("dot") is not None
