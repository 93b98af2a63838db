"""What `mklang mcp` does for each of its seven tools, in plain synchronous code (docs/mcp.md, ADR 0048).

The server's owner decides what runs and how far: machines come only from the
folders the server was started with, a caller may lower the owner's budgets
but never raise them, and the untrusted-flow policy and the host (provider,
script, plugins, MCP servers) are the owner's. Every run goes through the run
service (`mklang.runs`): started at a name of the server's store, continued
with the run's lock held, a human's answer applied only while the run waits
on that very question.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from mklang.engine import RunResult, decisions
from mklang.engine.events import EventSink
from mklang.errors import UsageError
from mklang.model import Machine
from mklang.stores import RunStore
from mklang.vocabulary import SUFFIXES

if TYPE_CHECKING:
    from mklang.engine.decisions import Decision

BUDGETS = ("max_tokens", "max_cost", "max_time")  # what a caller may lower, never raise past the owner's


@dataclass
class Owner:
    """What the person who started the server decided: the folders machines come from, the store,
    the ceilings, the untrusted-flow policy and the host settings every run is answered with."""

    folders: Sequence[Path]
    store: RunStore
    uri: str
    ceilings: dict[str, float | None] = field(default_factory=dict)
    untrusted_flow: str | None = None
    hosting: dict[str, Any] = field(default_factory=dict)

    def machine_path(self, given: str) -> Path:
        """The machine file `given` names inside one of the folders (relative to it, or absolute
        within it), symlinks followed: anything that lands outside them is refused."""
        if not given or "\x00" in given:
            raise UsageError("machine: give the path of a machine file inside the server's folders")
        for folder in self.folders:
            root = folder.resolve()
            candidate = Path(given) if Path(given).is_absolute() else root / given
            found = candidate.resolve()
            if found.is_relative_to(root) and found.is_file():
                if found.suffix.lower() not in SUFFIXES:
                    raise UsageError(f"machine {given!r} is not a machine file ({', '.join(SUFFIXES)})")
                return found
        shown = ", ".join(str(folder) for folder in self.folders)
        raise UsageError(f"machine {given!r} is not a machine file inside the folders this server runs ({shown})")

    def bounds(self, asked: dict[str, float | None]) -> dict[str, Any]:
        """The run's budgets: the caller's where given (each at most the owner's ceiling), else the owner's."""
        chosen: dict[str, Any] = {}
        for name in BUDGETS:
            ceiling, wanted = self.ceilings.get(name), asked.get(name)
            if wanted is not None and (wanted <= 0 or (ceiling is not None and wanted > ceiling)):
                limit = "above 0" if ceiling is None else f"above 0 and at most this server's {ceiling:g}"
                raise UsageError(f"{name} {wanted:g} is refused: a caller may only lower a budget ({limit})")
            chosen[name] = wanted if wanted is not None else ceiling
        return chosen


def check(owner: Owner, machine: str) -> dict[str, Any]:
    """The static checks of a machine: `mklang check --format json`'s diagnostics."""
    from mklang.checker import check_file

    path = owner.machine_path(machine)
    found = [diagnostic.to_json() for diagnostic in check_file(path)]
    return {"machine": str(path), "ok": not any(d["severity"] == "error" for d in found), "diagnostics": found}


def describe(owner: Owner, machine: str) -> dict[str, Any]:
    """A machine's states, gates, budgets and graph (Mermaid): what a caller needs to run it."""
    from mklang.graph import condition_text, face_text, policy_text, render

    loaded = _runnable(owner.machine_path(machine))
    states = [
        {
            "name": state.name,
            "does": face_text(state),
            "output": state.output,
            "gates": [
                {
                    "when": condition_text(gate),
                    "policy": policy_text(gate) or gate.policy,
                    "to": gate.target,
                    "ask": gate.ask,
                    "reply_to": gate.effective_reply_to if gate.policy == "escalate" else None,
                }
                for gate in state.gates
            ],
        }
        for state in loaded.states
    ]
    return {
        "name": loaded.name,
        "entry": loaded.entry,
        "budget": loaded.budget,
        "result": loaded.result,
        "context": loaded.context,
        "tools": [tool.name for tool in loaded.tools],
        "states": states,
        "budgets": owner.bounds({}),
        "mermaid": render(loaded, "mermaid"),
    }


def run(
    owner: Owner, machine: str, context: dict[str, Any], asked: dict[str, float | None], observer: EventSink | None
) -> dict[str, Any]:
    """Start `machine` as a new run of the store, under a fresh name, waiting at every question."""
    from mklang import runs

    loaded = _runnable(owner.machine_path(machine))
    name = f"mcp-{secrets.token_hex(16)}"  # unguessable: a caller cannot aim at another caller's run
    bounds = owner.bounds(asked)
    with runs.build_host(runs.RunRequest(hosting=owner.hosting, max_cost=bounds["max_cost"])) as host:
        result = runs.start(
            loaded,
            context,
            host,
            checkpoint=runs.location(owner.store, owner.uri, name),
            hitl=True,
            untrusted_flow=owner.untrusted_flow,
            observer=observer,
            **bounds,
        )
    return outcome(name, result)


class Answering(NamedTuple):
    """An answer to the question a run waits on: its id, and a free-text `reply` or a decision's
    `choice` (with a `note`)."""

    question: str
    reply: str | None = None
    choice: str | None = None
    note: str | None = None


def resume(
    owner: Owner,
    name: str,
    answering: Answering | None,
    asked: dict[str, float | None],
    observer: EventSink | None,
) -> dict[str, Any]:
    """Continue a run of the store (`runs.resume`). `answering` answers the question the run waits
    on: a decision's `choice` as `resume --answer CHOICE --note NOTE --question ID` does (the
    decision's own id, checked by `decisions.refusal`), a free-text `reply` set where the run expects
    it as `resume --set REPLY_TO=REPLY` does, only while the run waits on that very question. Both
    are checked once the run's lock is held, so of two answers one wins, and the other changes
    nothing and is told, in the line the command line prints."""
    from mklang import runs
    from mklang.limits import parse_value
    from mklang.session import Host
    from mklang.stores import run_name

    where = runs.location(owner.store, owner.uri, run_name(name, "run"))
    bounds = owner.bounds(asked)
    reply: dict[str, Any] = {}
    decision: Decision | None = None
    if answering is not None and answering.choice is not None:
        decision = {"choice": answering.choice, "note": answering.note, "question": answering.question, "by": "human"}
    elif answering is not None:
        from mklang.runs.inspection import describe

        reply_to = describe(where, last=0).get("reply_to")  # read unlocked: checked again under the lock
        reply = {str(reply_to): parse_value(answering.reply or "")} if reply_to else {}
    request = runs.RunRequest(
        source=where,
        reply=reply,
        decision=decision,
        hitl=True,
        untrusted_flow=owner.untrusted_flow,
        hosting=owner.hosting,
        **{key: value for key, value in bounds.items() if asked.get(key) is not None},
    )
    hosts: list[Host] = []

    def host_for(resumable: runs.Resumable) -> Host:
        if answering is not None and decision is None and not decisions.is_decision(resumable.chain[-1].ask):
            waiting = question_id(name, resumable.chain)
            if waiting != answering.question:
                now = "waits on no question" if waiting is None else f"waits on question {waiting}"
                raise UsageError(
                    f"run {name} does not wait on question {answering.question} (it {now}): nothing changed"
                )
        hosts.append(runs.build_host(request, resumable))
        return hosts[-1]

    try:
        result = runs.resume(request, host_for, observer=observer)
    finally:
        for host in hosts:
            host.close()
    return outcome(name, result)


def show(owner: Owner, name: str, last: int) -> dict[str, Any]:
    """What `mklang show STORE#RUN` says of a run: status, reason, frames, spend, last steps, pending question."""
    from mklang.runs import location
    from mklang.runs.inspection import describe as described
    from mklang.stores import run_name

    return described(location(owner.store, owner.uri, run_name(name, "run")), last=last)


def listing(owner: Owner, statuses: list[str], limit: int) -> dict[str, Any]:
    """The store's runs, newest first, as `mklang runs --format json` lists them (without their paths)."""
    from mklang.stores import RunQuery, summaries_of

    found = summaries_of(owner.store, RunQuery(statuses=tuple(statuses), limit=limit))
    return {"runs": [summary.to_json() for summary in found]}


def outcome(name: str, result: RunResult) -> dict[str, Any]:
    """How a run ended, and what a caller needs to go on: the run's name and the question it waits on."""
    waiting = question_id(name, result.frames) if result.status == "suspended" and result.reply_to else None
    asked = result.frames[-1].ask if waiting is not None and result.frames else None
    decision = asked if decisions.is_decision(asked) else None
    question: dict[str, Any] | None = None
    if waiting is not None:
        question = {"id": waiting, "ask": result.ask, "reply_to": result.reply_to, "answer_with": "answer"}
    if decision is not None:  # named by its own id, as `mklang resume --question` names it
        question = {**(question or {}), "id": decision["question"], "choices": decision.get("choices")}
        question["deadline"] = decision.get("deadline")
    return {
        "run": name,
        "status": result.status,
        "reason": result.reason,
        "error": result.error if result.status == "halted" else None,
        "at": result.at,
        "result": result.result if result.status == "done" else None,
        "question": question,
        "usage": result.usage.to_json(),
    }


def question_id(name: str, frames: Sequence[Any]) -> str | None:
    """The question a run waits on, named by the run, where each level stands and what is asked:
    an answer names it, so an answer meant for an earlier question never answers a later one."""
    ask = frames[-1].ask if frames else None
    if not ask or not ask.get("reply_to"):
        return None
    where = [[frame.machine.name, frame.state, frame.steps] for frame in frames]
    text = json.dumps([name, where, ask.get("ask"), ask.get("reply_to")], sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _runnable(path: Path) -> Machine:
    from mklang.checker import require_runnable
    from mklang.syntax import load_file

    return require_runnable(load_file(path))
