"""What `mklang show`, `mklang runs` and the console tell about a stored run, as plain data; they only read.

It loads the envelope's module (pydantic) as it is imported, so `mklang.runs` does not import it:
its readers do.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mklang.checkpoint.envelope import Budgets, load
from mklang.checkpoint.journal import read_journal, resume_change
from mklang.checkpoint.paths import located_host, root_file
from mklang.checkpoint.segments import recorded_trace
from mklang.checkpoint.signing import SEAL_TEXT
from mklang.checkpoint.texts import machine_root
from mklang.checkpoint.trust import recorded_host
from mklang.engine import decisions
from mklang.engine.frame import Frame
from mklang.engine.trace import Trace
from mklang.errors import CheckpointError, MklangError, first_line, redacted
from mklang.model import Machine
from mklang.providers.base import Usage
from mklang.runs.opening import open_run
from mklang.runs.places import location
from mklang.stores import Location, RunStore, locate, run_name


def describe(target: str | Path | Location, last: int = 5) -> dict[str, Any]:
    """Status, reason, frame chain, spend against budgets, last steps, pending ask.

    A `running` checkpoint belongs to a process that is still going or that
    died; its journal says how far it got. One not signed with this user's
    key is `failed` (`unverified`): nothing it holds is reported.
    """
    location = locate(target, create=False)
    run_name(location.run)  # a row or file no mklang run would write
    try:
        envelope = load(location)
    except CheckpointError:  # no checkpoint, or a run that holds its lock and has not written its first
        held_by = location.store.holder(location.run)
        if held_by is None or location.store.read(location.run) is not None:
            raise
        raise CheckpointError(
            f"{location}: no checkpoint yet: the run in process {held_by} has not written its first one"
        ) from None
    if envelope.seal != "signed":
        return {
            **unverified(
                redacted(str(location)),
                f"the checkpoint is {SEAL_TEXT[envelope.seal]}: `mklang resume --trust` runs it as untrusted data",
                envelope.seal,
            ),
            "host": recorded_host(envelope.host),  # what --trust would be asked to run: shown, never used
        }
    frames, root_trace = _recorded(location, envelope.frames)
    usage = Usage.from_json(envelope.usage)
    steps_after = 0
    if envelope.status == "running" or resume_change(location.store, location.run, envelope) is not None:
        # The process died (or still runs): replay its journal to say where it really is.
        steps_after = sum(1 for r in read_journal(location, envelope.generation) if r.get("k") == "step")
        resumable = open_run(location, force=True, trust=True, lock=False)
        envelope, chain = resumable.envelope, resumable.chain
        frames, root_trace = _rebuilt(chain)
        usage = sum((frame.usage for frame in chain), Usage())
    # The question the run waits on: its innermost frame's, even when it died before saying so.
    pending = (frames[-1].get("ask") if frames else None) or {"ask": envelope.ask, "reply_to": envelope.reply_to}
    tokens, cost = usage.tokens, usage.cost_usd
    budgets = envelope.budgets

    def remaining(limit: float | None, spent: float) -> float | None:
        return None if limit is None else max(0, limit - spent)

    summary = {
        "path": redacted(str(location)),
        "status": envelope.status,
        "reason": envelope.reason,
        "detail": envelope.detail,
        "error": envelope.error,
        "at": envelope.at,
        "run_id": envelope.run_id,
        "machine": envelope.machine.model_dump(),
        "frames": [
            {
                "machine": f["machine"],
                "state": f["state"],
                "steps": f["steps"],
                "budget": f["budget"],
                "remaining": max(0, f["budget"] - f["steps"]),
            }
            for f in frames
        ],
        "tokens": {"spent": tokens, "budget": budgets.max_tokens, "remaining": remaining(budgets.max_tokens, tokens)},
        "cost_usd": {"spent": cost, "budget": budgets.max_cost, "remaining": remaining(budgets.max_cost, cost)},
        "max_time": budgets.max_time,
        "last_steps": root_trace.last(last),
        "ask": pending["ask"],
        "reply_to": pending["reply_to"],
        "resumable": envelope.status in ("running", "suspended"),
        "signature": {"seal": envelope.seal, "text": SEAL_TEXT[envelope.seal]},
        "host": recorded_host(located_host(envelope.host, location.anchor)),
        # The runs it was forked from, oldest first, and what their prefixes spent (inherited, in its spend);
        # an entry with the run's own id is its migration to a new machine version (ADR 0061), not a fork.
        "lineage": [
            {
                "run_id": a.run_id,
                "checkpoint": redacted(a.checkpoint),
                "step": a.step,
                "inherited": dict(a.inherited),
                "migration": a.run_id == envelope.run_id,
            }
            for a in envelope.lineage
        ],
        # What operators did to it from outside (a cancel, a raised budget), oldest first (ADR 0068).
        "actions": [action.model_dump(exclude_none=True) for action in envelope.actions],
    }
    question = decisions.public(pending)
    if question is not None:  # a human decision: its id, choices, what it shows, its deadline
        summary["question"] = question
    if envelope.status == "suspended":
        innermost = dict(frames[-1]) if frames else {}
        if envelope.reason == "budget-exhausted":
            innermost["ahead"] = _steps_ahead(location)
        summary["ran_out"], summary["continue_with"] = how_to_continue(
            redacted(str(location)), envelope.reason, innermost, usage, budgets, envelope.reply_to, pending
        )
    if envelope.status == "running":
        innermost = frames[-1]
        held_by = location.store.holder(location.run)
        pid = int(held_by) if held_by is not None and held_by.isdigit() else held_by
        where = f"{innermost['machine']}:{innermost['state']}"
        if pid is not None:
            summary["running_pid"] = pid
            summary["interrupted"] = f"the run is still going in process {pid}, last durable at {where}"
        else:
            summary["interrupted"] = (
                f"the run was interrupted at {where} ({steps_after} journaled step(s) past the last "
                f"snapshot); `mklang resume {location}` continues from there"
            )
        summary["resumable"] = pid is None
    return summary


def _recorded(location: Location, records: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], Trace]:
    """The frames an envelope records, and its root level's trace (its segments read when it is read)."""
    frames = [dict(frame) for frame in records]
    return frames, recorded_trace(location, frames[0], trusted=True) if frames else Trace()


def _rebuilt(chain: list[Frame]) -> tuple[list[dict[str, Any]], Trace]:
    """The frames of a chain its journal brought up to date, without their traces, and the root's trace."""
    return [frame.to_json({}) for frame in chain], chain[0].trace


def machine_of(location: Location) -> Machine:
    """The root machine a stored run signed for: its file when unchanged, else the text its store keeps
    (so a diagram shows what ran). A checkpoint not signed with this user's key names no file to read."""
    from mklang.syntax import load_file

    envelope = load(location)
    if envelope.seal != "signed" or not envelope.machine.path:
        raise CheckpointError(f"{location}: no verified machine file to draw ({SEAL_TEXT[envelope.seal]})")
    root = root_file(envelope.machine.path, location.anchor)
    path, _ = machine_root(location.store, root, {**envelope.texts, **envelope.machines}, changed=True)
    return load_file(path)


def run_document(target: str | Path | Location) -> dict[str, Any]:
    """What `mklang run --format json` printed for a stored run, from its signed envelope: status,
    error, result, context, trace, usage; a suspended run's reason, ask, frames and how to continue it.

    `calls` is left out: it counts what one process paid, which no store records. A run still going,
    or whose process died, is `running`, as its journal says (with `interrupted`, as `describe` has
    it). A run not signed with this user's key, or unreadable, is `describe`'s `failed` document:
    nothing it holds is reported.
    """
    location = locate(target, create=False)
    run_name(location.run)
    envelope = load(location)
    if envelope.seal != "signed":
        return describe(location, last=0)
    status: str = envelope.status
    frames, root_trace = _recorded(location, envelope.frames)
    usage = dict(envelope.usage)
    if status == "running" or resume_change(location.store, location.run, envelope) is not None:
        status = "running"
        chain = open_run(location, force=True, trust=True, lock=False).chain
        frames, root_trace = _rebuilt(chain)
        usage = sum((frame.usage for frame in chain), Usage()).to_json()
    root = frames[0] if frames else {}
    document: dict[str, Any] = {
        "status": status,
        "error": envelope.error if status in ("done", "halted") else None,
        "at": envelope.at if status != "running" else None,
        "result": envelope.result,
        "context": root.get("context", {}),
        "trace": list(root_trace),
        "usage": usage,
    }
    if status in ("suspended", "running"):
        summary = describe(location, last=0)  # the question pending, even when the run died before saying so
        document.update(
            reason=envelope.reason,
            ask=summary["ask"],
            reply_to=summary["reply_to"],
            **({"question": summary["question"]} if "question" in summary else {}),
            frames=[{"machine": frame["machine"], "state": frame["state"]} for frame in frames],
        )
        if envelope.detail:
            document["detail"] = envelope.detail
        document["checkpoint"] = summary["path"]
        for key in ("ran_out", "continue_with", "interrupted", "running_pid"):
            if key in summary:
                document[key] = summary[key]
    return document


def unverified(path: str, reason: str, seal: str | None = None) -> dict[str, Any]:
    """What `show` and `runs` say of a run that cannot be read or verified: `failed` and why."""
    return {
        "path": path,
        "status": "failed",
        "reason": reason,
        "frames": [],
        "resumable": False,
        "signature": {"seal": seal, "text": SEAL_TEXT.get(seal or "", "unreadable")},
        "host": {},
    }


def _steps_ahead(location: Location) -> int:
    """The steps the state a run stopped at takes: its branches when it fans out, else 1.
    A suggested budget covers them, so one resume gets past a fan-out the budget cut short."""
    from mklang.vocabulary import lookup

    try:
        resumable = open_run(location, force=True, trust=True, lock=False)
    except MklangError:  # `show` still reports what it can; the suggestion falls back to the spend
        return 1
    try:
        frame = resumable.chain[-1]
    finally:
        resumable.release()
    state = frame.machine.state(frame.state)
    if state is None or state.over is None:
        return (state.sample or 1) if state is not None else 1
    items = lookup(frame.context, state.over)
    return max(1, len(items)) if isinstance(items, list) else 1


def how_to_continue(
    path: str | Path,
    reason: str | None,
    innermost: dict[str, Any],
    usage: Usage,
    budgets: Budgets,
    reply_to: str | None,
    pending: dict[str, Any] | None = None,
) -> tuple[str | None, str]:
    """Which budget a suspended run ran out of, with what it spent against it, and the
    exact command that continues it, raising that budget by as much as was spent (or by
    the budget, or the steps of the state ahead, when larger; by a round amount when all are 0)."""
    command = f"mklang resume {shlex.quote(str(path))}"
    if reason == "budget-exhausted":
        steps, budget = innermost.get("steps", 0), innermost.get("budget", 0)
        where = f" (machine {innermost['machine']})" if innermost.get("machine") else ""
        return (
            f"the step budget of {budget}{where} ran out: {steps} step{'' if steps == 1 else 's'} taken",
            f"{command} --budget {steps + (max(steps, budget, innermost.get('ahead', 0)) or 1)}",
        )
    if reason == "cost-exhausted" and budgets.max_tokens is not None and usage.tokens >= budgets.max_tokens:
        spent, limit = usage.tokens, budgets.max_tokens
        return (
            f"the token budget of {limit} ran out: {spent} tokens spent",
            f"{command} --max-tokens {spent + (max(spent, limit) or 1000)}",
        )
    if reason == "cost-exhausted" and budgets.max_cost is not None:
        spent_usd, limit_usd = usage.cost_usd, budgets.max_cost
        return (
            f"the dollar budget of ${limit_usd:g} ran out: ${spent_usd:.4f} spent",
            f"{command} --max-cost {spent_usd + (max(spent_usd, limit_usd) or 1):.4g}",
        )
    if reason == "time-exhausted" and budgets.max_time is not None:
        seconds = budgets.max_time
        return f"the time budget of {seconds:g}s ran out", f"{command} --max-time {seconds:g}s"
    if reason == "escalated" and pending is not None and decisions.public(pending) is not None:
        return None, f"{command} {decisions.answer_hint(pending)}"
    if reason == "escalated" and reply_to:
        return None, f"{command} --set {reply_to}=<reply>"
    return None, command


def described(store: RunStore, uri: str, run: str, last: int = 0) -> dict[str, Any]:
    """What `mklang show` tells of a run of the store opened from `uri` (its `last` steps); a run that
    cannot be read or verified is `failed` with why, so one bad run does not hide the others."""
    where = location(store, uri, run)
    try:
        return describe(where, last=last)
    except MklangError as error:
        return unverified(str(where), first_line(error))


def held(store: RunStore, uri: str, run: str) -> dict[str, Any]:
    """What a run holds besides what `describe` tells: the context of its innermost level (what a
    question is about) and its result; nothing when it cannot be read."""
    try:
        envelope = load(location(store, uri, run))
    except MklangError:
        return {"context": {}, "result": None}
    frames = envelope.frames
    return {"context": frames[-1]["context"] if frames else {}, "result": envelope.result}
