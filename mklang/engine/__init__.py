"""Running machines: `run` starts a run, `continue_run` resumes a frame chain."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypedDict, Unpack

from mklang.effects import FlowPolicy, check_policy
from mklang.engine import decisions, events
from mklang.engine.events import EventSink
from mklang.engine.frame import Frame
from mklang.engine.launch import ran_out
from mklang.engine.records import TraceStep
from mklang.engine.runner import run_frame
from mklang.engine.runtime import AnswerWatch, Caps, Control, Journal, Level, Runtime
from mklang.engine.signals import Stop
from mklang.host.registry import BUILTIN_TOOLS, HostCallables, as_registry
from mklang.model import Machine
from mklang.providers.base import Provider, Usage
from mklang.syntax.machines import MachineLoader
from mklang.vocabulary import DEFAULT_RUN_CONCURRENCY

__all__ = ["Control", "RunOptions", "RunResult", "Toolbox", "continue_run", "make_runtime", "run"]


@dataclass
class RunResult:
    """The outcome of a run: done, halted or suspended (SPEC sections 4 and 7)."""

    status: str  # "done" | "halted" | "suspended"
    error: str | None
    at: str | None
    result: Any
    context: dict[str, Any]
    root_trace: Sequence[TraceStep] = field(repr=False)  # the root level's `Trace`, its segments unread
    usage: Usage
    frames: list[Frame] = field(default_factory=list)  # root..innermost, when suspended
    ask: str | None = None
    reply_to: str | None = None
    detail: str | None = None  # the provider error behind a suspension, the budget that ran out and how far
    calls: dict[str, int] = field(default_factory=dict)  # model and tool calls this process paid for

    @cached_property
    def trace(self) -> list[TraceStep]:
        """The root level's trace (SPEC section 6); a stored run's sealed segments are read here, once
        (ADR 0040), so a run that nothing reads the trace of never reads them."""
        return list(self.root_trace)

    @property
    def reason(self) -> str | None:
        return self.error if self.status == "suspended" else None

    def to_json(self) -> dict[str, Any]:
        data = {
            "status": self.status,
            "error": None if self.status == "suspended" else self.error,  # a suspension is no error: see reason
            "at": self.at,
            "result": self.result,
            "context": self.context,
            "trace": self.trace,
            "usage": self.usage.to_json(),
        }
        data["calls"] = dict(self.calls)
        if self.status == "suspended":
            data.update(
                reason=self.error,
                ask=self.ask,
                reply_to=self.reply_to,
                frames=[{"machine": f.machine.name, "state": f.state} for f in self.frames],
            )
            question = decisions.public(self.frames[-1].ask) if self.frames else None
            if question is not None:
                data["question"] = question
        if self.detail:
            data["detail"] = self.detail
        return data


class Toolbox(TypedDict, total=False):
    """What a run takes from its host beside its provider (`Host.toolbox`): its tools and hooks,
    and which tools the host classifies read-only besides its callables' own mark."""

    tools: HostCallables
    hooks: HostCallables
    read_only_tools: frozenset[str]


class RunOptions(Toolbox, total=False):
    """What every way of starting a run takes beside its provider (`run`,
    `mklang.runs.start`): its toolbox, the token, dollar and
    time budgets, calls in flight (default `DEFAULT_RUN_CONCURRENCY`), whether escalations wait for a
    human, the interrupt flag, the observer told of the run's events, and what a
    tainted decision reaching an effectful tool does (`untrusted_flow`: report,
    the default, or halt)."""

    max_tokens: int | None
    max_cost: float | None
    max_time: float | None
    concurrency: int
    hitl: bool
    control: Control | None
    observer: EventSink | None
    untrusted_flow: FlowPolicy


def make_runtime(
    provider: Provider,
    *,
    journal: Journal | None = None,
    loader: MachineLoader | None = None,
    run_id: str | None = None,
    answers: AnswerWatch | None = None,
    **options: Unpack[RunOptions],
) -> Runtime:
    """Assemble what every level of a run shares; `max_time` starts counting now; `answers` is
    told of produce answers as they stream while a page watches the run (`runs.live`).

    Tools and hooks may be registries or maps.
    """
    control = options.get("control") or Control()
    max_time = options.get("max_time")
    if max_time is not None:
        control.deadline, control.max_time = time.monotonic() + max_time, max_time
    return Runtime(
        provider=provider,
        tools=as_registry("mklang.tools", BUILTIN_TOOLS, options.get("tools")),
        hooks=as_registry("mklang.hooks", None, options.get("hooks")),
        load_machine=loader or MachineLoader(),
        concurrency=max(1, int(options.get("concurrency", DEFAULT_RUN_CONCURRENCY))),
        hitl=options.get("hitl", False),
        control=control,
        journal=journal,
        observer=options.get("observer"),
        trace_content=events.traces_content(options.get("observer")),
        stream_deltas=events.wants_deltas(options.get("observer")),
        delta_text=events.traces_content(options.get("observer")) or events.wants_text(options.get("observer")),
        answers=answers,
        run_id=run_id or uuid.uuid4().hex,
        untrusted_flow=check_policy(options.get("untrusted_flow") or "report"),
        read_only_tools=frozenset(options.get("read_only_tools") or ()),
    )


def run(
    machine: Machine,
    context: dict[str, Any] | None = None,
    *,
    provider: Provider,
    suspendable: bool = False,
    journal: Journal | None = None,
    loader: MachineLoader | None = None,
    **options: Unpack[RunOptions],
) -> RunResult:
    """Run `machine` from its entry with host `context` (tainted) under the host budgets."""
    loader = loader or MachineLoader()
    loader.add(machine)
    rt = make_runtime(provider, journal=journal, loader=loader, **options)
    frame = Frame.start(machine, context or {})
    return continue_run(rt, [frame], Caps(options.get("max_tokens"), options.get("max_cost")), suspendable)


def continue_run(
    rt: Runtime, frames: list[Frame], caps: Caps, suspendable: bool, *, resumed: bool = False, recovered: bool = False
) -> RunResult:
    """Run (or resume) the chain `frames`, root first, and report the outcome.

    A `resumed` suspension whose spend, the answers earlier processes paid for
    included, already meets a token or dollar cap launches nothing and suspends
    again as it was, so resuming it again and again spends nothing (ADR 0012).
    A run `recovered` after a crash continues like a resumed one, as its events say.
    """
    rt.caps = caps
    rt.spent = sum((frame.spent for frame in frames), Usage())
    machine = frames[0].machine.name
    observed = rt.observer is not None  # an event nobody is told of is not built
    if observed and (resumed or recovered):
        rt.emit(
            events.RunResumed(
                machine=machine,
                max_tokens=caps.tokens,
                max_cost=caps.cost,
                concurrency=rt.concurrency,
                hitl=rt.hitl,
                recovered=recovered,
                spent=rt.spent_so_far(),
            )
        )
    elif observed:
        rt.emit(
            events.RunStarted(
                machine=machine, max_tokens=caps.tokens, max_cost=caps.cost, concurrency=rt.concurrency, hitl=rt.hitl
            )
        )
    result = _outcome(rt, frames, caps, suspendable, resumed)
    if not observed:
        return result
    if result.status == "suspended":
        rt.emit(events.RunSuspended(reason=str(result.error), at=result.at, ask=result.ask, reply_to=result.reply_to))
    elif result.status == "halted":
        rt.emit(events.RunHalted(error=str(result.error), at=result.at))
    rt.emit(events.RunFinished(status=result.status, usage=result.usage, calls=result.calls))
    return result


def _outcome(rt: Runtime, frames: list[Frame], caps: Caps, suspendable: bool, resumed: bool) -> RunResult:
    """How the chain `frames` ends (`continue_run`)."""
    root = frames[0]
    if resumed and suspendable and caps.reached(rt.spent_so_far()):
        innermost = frames[-1]
        # The reason its loop-top gives, so the checkpoint stays as it was: steps are checked first.
        reason = "budget-exhausted" if innermost.steps >= innermost.budget else "cost-exhausted"
        spent = _spent(rt, root, suspended=True)
        detail = ran_out(rt, innermost, reason)
        return RunResult(
            "suspended", reason, innermost.state, None, root.context, root.trace, spent, frames, detail=detail
        )
    try:
        run_frame(rt, Level(root, 0, suspendable, False, "r", []), frames[1:] or None)
    except Stop as stop:  # halted, suspended, or interrupted: a halt no suspension could spare
        suspended = stop.kind == "suspended"
        result = RunResult(
            "suspended" if suspended else "halted",
            stop.reason,
            stop.at,
            None,
            root.context,
            root.trace,
            _spent(rt, root, suspended),
            stop.frames,
            stop.ask,
            stop.reply_to,
            stop.detail,
        )
    else:
        result = RunResult("done", None, None, root.result(), root.context, root.trace, _spent(rt, root, False))
    result.calls = dict(sorted(rt.live_calls.items()))
    return result


def _spent(rt: Runtime, root: Frame, suspended: bool) -> Usage:
    """The run's spend, read once at its end. A run that ended holds it all in its root
    frame: each step records what it cost, and a level that stops mid-step records what
    the step had paid. A suspended run's frames leave out its steps in flight, whose paid
    answers the journal keeps for the resume to replay: its spend is the runtime's live
    total plus what earlier processes paid that it has not replayed."""
    return rt.spent_so_far() if suspended else root.usage
