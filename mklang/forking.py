"""What a fork's prefix is answered with: the source run's own trace, call by call.

A fork (`mklang fork SOURCE --at STEP`) runs its machine again from the start, with the source's
inputs, and every model and tool call of a step before STEP is answered here from the source's
trace instead of by a provider: no call of the prefix is paid again, and since the engine runs the
prefix itself (gates, repairs, feedback, taint, budgets), the fork's state at STEP is the one the
engine reached, not one pieced together from records.

A call is found by its idempotency key (`engine.keys`): `<scope>:<step>.<part>.<n>`, a level below
a call state scoped by that state's key and `/`. The step names the trace entry; the part the
face (`0`: its produce answer or tool observation, or the sub-run of a call), a fan-out branch
(`<i>of<count>`: `branches[i - 1]`) or the judge (`g`: the n-th batch answers "none" while the
step's `judge_none` lasts, then "unparseable" when the step fell back, else the fired gate's place
among the conditions asked). A step's usage is given to its face call, or, when the face pays
nothing of its own (a tool, a sub-run, branches), what is left of it to its first judge call, so
each step of the prefix costs what it cost.

A key that names no recorded call, a judge asked conditions that do not hold the gate the source
took, or a call of a kind the step never made is a `PrefixMismatch`: the prefix is not the
source's (a hook answered otherwise, or the machine changed), and the fork stops before anything
is paid.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mklang.checkpoint.envelope import Ancestor, Edit, Envelope, UsageRecord
from mklang.engine import Control, RunResult
from mklang.engine.events import Event, StateEntered
from mklang.errors import CheckpointError, MklangError, UsageError
from mklang.model import Call, Machine, Produce, State, ToolUse, called_machines
from mklang.providers.base import NONE, UNPARSEABLE, Produced, Usage, Verdict
from mklang.runs.request import RunRequest, Tell, on_stderr
from mklang.session import Host
from mklang.stores import Location, locate, run_name
from mklang.syntax.machines import MachineLoader

_LEVEL = re.compile(r"^(\d+)\.(0|g|h|\d+of\d+)$")  # a level of a key: `<step>.<part>`
_PART = re.compile(r"^(\d+)of(\d+)$")


class PrefixMismatch(MklangError):
    """The fork's prefix asked for a call the source's trace does not hold as it was made."""


Load = Callable[[str, str | None], Machine]


@dataclass(frozen=True)
class _Place:
    """Where a call lies in a trace: the step's record (or a branch's), its part and number, and
    the state of its level's machine that made it."""

    step: Mapping[str, Any]
    part: str
    number: int
    branch: Mapping[str, Any] | None
    state: State


def _located(trace: Sequence[Mapping[str, Any]], machine: Machine, load: Load, key: str) -> _Place:
    """The recorded call a key names, walking down the sub-traces of call states and branches."""
    scope, _, rest = key.partition(":")
    if scope != "r" or not rest:
        raise PrefixMismatch(f"call {key}: not a key of this run's levels")
    levels = rest.split("/:")
    records = trace
    for depth, level in enumerate(levels):
        last = depth == len(levels) - 1
        head, _, number = level.rpartition(".") if last else (level, "", "0")
        found = _LEVEL.match(head)
        if found is None or not number.isdigit():
            raise PrefixMismatch(f"call {key}: not a key of this run's levels")
        index, part = int(found.group(1)), found.group(2)
        if not 1 <= index <= len(records):
            raise PrefixMismatch(f"call {key}: step {index} is not in the source's trace there")
        step = records[index - 1]
        state = machine.state(str(step.get("state")))
        if state is None:
            raise PrefixMismatch(f"call {key}: {machine.name} has no state {step.get('state')!r}")
        branch = _branch(step, part, key)
        if last:
            return _Place(step, part, int(number), branch, state)
        if not isinstance(state.face, Call):
            raise PrefixMismatch(f"call {key}: step {index} ({state.name}) calls no machine")
        machine = load(state.face.machine, machine.path)
        records = (branch if branch is not None else step).get("sub_trace") or []
    raise PrefixMismatch(f"call {key}: not a key of this run's levels")


def _branch(step: Mapping[str, Any], part: str, key: str) -> Mapping[str, Any] | None:
    found = _PART.match(part)
    if found is None:
        return None
    index, count = int(found.group(1)), int(found.group(2))
    branches = step.get("branches") or []
    if len(branches) != count or not 1 <= index <= count:
        raise PrefixMismatch(f"call {key}: the source's step {step.get('step')} had {len(branches)} branches")
    branch = branches[index - 1]
    return branch if isinstance(branch, Mapping) else {"output": branch}


def _usage(data: Any) -> Usage:
    return Usage.from_json(data) if isinstance(data, Mapping) else Usage()


def _spent_below(step: Mapping[str, Any]) -> Usage:
    """What a step paid through its branches or its sub-run's steps."""
    total = Usage()
    for branch in step.get("branches") or []:
        if isinstance(branch, Mapping):
            total = total + _usage(branch.get("usage"))
    for sub in step.get("sub_trace") or []:
        total = total + _usage(sub.get("usage"))
    return total


def _left_for_the_judge(place: _Place) -> Usage:
    """A step's usage its face did not pay: all of it past its branches and sub-run, unless a
    produce call of its own paid it."""
    if isinstance(place.state.face, Produce) and not place.state.fans_out:
        return Usage()
    total, below = _usage(place.step.get("usage")), _spent_below(place.step)
    return Usage(
        max(0, total.input_tokens - below.input_tokens),
        max(0, total.output_tokens - below.output_tokens),
        max(0.0, total.cost_usd - below.cost_usd),
    )


def _text(output: Any) -> str:
    """The answer that parses to the recorded output (a `parse list|json` state's value as JSON)."""
    return output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)


class TraceAnswers:
    """Answers the calls of a fork's prefix from the source's root trace (thread-safe: it only reads)."""

    def __init__(self, trace: Sequence[Mapping[str, Any]], machine: Machine, load: Load):
        self.trace, self.machine, self.load = trace, machine, load

    def _place(self, key: str) -> _Place:
        return _located(self.trace, self.machine, self.load, key)

    def produce(self, key: str) -> Produced:
        place = self._place(key)
        if place.part in ("g", "h") or place.number != 1 or not isinstance(place.state.face, Produce):
            raise PrefixMismatch(f"call {key}: the source made no such model call")
        record = place.branch if place.branch is not None else place.step
        reasoning = record.get("reasoning")
        return Produced(
            _text(record.get("output")), reasoning if isinstance(reasoning, str) else None, _usage(record.get("usage"))
        )

    def tool(self, key: str) -> str:
        place = self._place(key)
        record = place.branch if place.branch is not None else place.step
        output = record.get("output")
        if place.part in ("g", "h") or place.number != 1 or not isinstance(output, str):
            raise PrefixMismatch(f"call {key}: the source made no such tool call")
        return output

    def judge(self, key: str, conditions: Sequence[str]) -> Verdict:
        place = self._place(key)
        step = place.step
        if place.part != "g":
            raise PrefixMismatch(f"call {key}: the source made no such judge call")
        usage = _left_for_the_judge(place) if place.number == 1 else Usage()
        if place.number <= int(step.get("judge_none") or 0):
            return Verdict(NONE, usage)
        if step.get("judge_fallback"):
            return Verdict(UNPARSEABLE, usage)
        gate = step.get("gate")
        if not isinstance(gate, str) or gate not in conditions:
            raise PrefixMismatch(
                f"call {key}: the judge of step {step.get('step')} ({step.get('state')}) was asked "
                f"{list(conditions)}, which do not hold the gate the source took ({gate!r})"
            )
        return Verdict(list(conditions).index(gate), usage)


def _key() -> str:
    """The engine's key of the call in flight (what the host sees is `<run id>/<key>`)."""
    from mklang.providers.base import call_key

    seen = call_key()
    if seen is None:
        raise PrefixMismatch("a call of the prefix was made outside the engine")
    return seen.split("/", 1)[1]


class PrefixProvider:
    """A provider answering the prefix's model calls from the source's trace."""

    def __init__(self, answers: TraceAnswers):
        self.answers = answers

    def produce(self, system: str, user: str, tier: str, reason: bool) -> Produced:
        return self.answers.produce(_key())

    def judge(
        self, conditions: list[str], output: Any, reasoning: str | None, context: dict[str, Any], tier: str
    ) -> Verdict:
        return self.answers.judge(_key(), conditions)


def prefix_tools(answers: TraceAnswers, names: Sequence[str]) -> dict[str, Callable[[dict[str, Any]], str]]:
    """The tools `names` answering from the source's trace."""
    return {name: lambda _input: answers.tool(_key()) for name in names}


def step_path(text: str) -> tuple[int, ...]:
    """`--at 7` or `--at 4.2` (step 2 of the run that step 4 of the root calls) as step numbers."""
    parts = text.split(".")
    if not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise UsageError(f"--at expects a step number or a dotted path of them (7, 4.2), got {text!r}")
    return tuple(int(part) for part in parts)


class StopAt:
    """An observer that asks for an interrupt at the loop-top of the step at `path` (root first):
    the run suspends there, before that step runs, with nothing of it in flight."""

    def __init__(self, control: Control, path: tuple[int, ...]):
        self.control, self.path = control, path

    def emit(self, event: Event) -> None:
        at = isinstance(event, StateEntered) and not event.in_branch
        if at and tuple(segment.step for segment in event.path) == self.path:
            self.control.interrupted.set()


# --- the fork --------------------------------------------------------------------------------


@dataclass
class Source:
    """A run to fork, read as `mklang show` reads it: its envelope, root trace and root machine."""

    location: Location
    envelope: Envelope
    trace: list[dict[str, Any]]
    machine: Machine


def read_source(target: str | Path | Location) -> Source:
    """The run at `target`, refused unless it is this user's own (signed with their key) and records
    the context it started with."""
    from mklang.checkpoint.envelope import load
    from mklang.checkpoint.signing import SEAL_TEXT
    from mklang.runs.inspection import machine_of, run_document

    location = locate(target, create=False)
    run_name(location.run)
    envelope = load(location)
    if envelope.seal != "signed":
        raise CheckpointError(f"{location}: {SEAL_TEXT[envelope.seal]}: a fork replays only runs signed with your key")
    if envelope.input is None or envelope.edits is None:
        kept = "start context" if envelope.input is None else "resume edits"
        raise CheckpointError(
            f"{location}: the run records no {kept} (it began before forks replayed them): fork a newer run"
        )
    trace = json.loads(json.dumps(run_document(location)["trace"]))
    return Source(location, envelope, trace, machine_of(location))


def _at(source: Source, at: tuple[int, ...]) -> Mapping[str, Any]:
    """The step the fork starts at, which the source must have taken (at each level of the path)."""
    records: Sequence[Mapping[str, Any]] = source.trace
    step: Mapping[str, Any] = {}
    for depth, number in enumerate(at):
        if not 1 <= number <= len(records):
            where = "the source's trace" if depth == 0 else f"the run step {'.'.join(map(str, at[:depth]))} calls"
            raise UsageError(f"--at {'.'.join(map(str, at))}: {where} has {len(records)} steps")
        step = records[number - 1]
        records = step.get("sub_trace") or []
    return step


def inherited(source: Source, at: tuple[int, ...]) -> Usage:
    """What the steps before `at` spent: the fork's prefix, answered from the source and not paid again."""
    total, records = Usage(), source.trace
    for number in at:
        for step in records[: number - 1]:
            total = total + _usage(step.get("usage"))
        records = records[number - 1].get("sub_trace") or []
    return total


@dataclass
class Preview:
    """What a fork would do before anything is paid: where it starts and the effectful tool states
    it may run again (the source ran them from there on)."""

    step: str
    state: str
    effects: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "state": self.state, "effects": self.effects}

    def text(self) -> str:
        head = f"the fork starts at step {self.step} ({self.state}), its steps before answered from the source"
        if not self.effects:
            return head + "; it runs no effectful tool the source ran from there"
        return head + "; it may run again: " + ", ".join(self.effects)


def preview(source: Source, at: tuple[int, ...], machine: Machine | None = None) -> Preview:
    """The effectful tool states the source ran at or after `at` (at every level), which the fork may
    run again: a tool's effect is not undone by forking."""
    from mklang.effects import declared_read_only

    machine = machine or source.machine
    loader = MachineLoader()
    loader.add(machine)
    effects: list[str] = []

    def walk(records: Sequence[Mapping[str, Any]], level: Machine, start: int) -> None:
        for step in records[start:]:
            state = level.state(str(step.get("state")))
            if state is None:
                continue
            if isinstance(state.face, ToolUse) and not declared_read_only(level, state.face.tool):
                effects.append(f"{level.name}:{state.name} ({state.face.tool})")
            if isinstance(state.face, Call):
                child = loader(state.face.machine, level.path)
                for below in [step, *(step.get("branches") or [])]:
                    if isinstance(below, Mapping):
                        walk(below.get("sub_trace") or [], child, 0)

    walk(source.trace, machine, at[0] - 1)
    step = _at(source, at)
    return Preview(".".join(map(str, at)), str(step.get("state")), list(dict.fromkeys(effects)))


def fork(
    source: Source,
    at: tuple[int, ...],
    request: RunRequest,
    *,
    machine: Machine | None = None,
    control: Control | None = None,
    observer: Any = None,
    tell: Tell = on_stderr,
) -> RunResult:
    """Start a new run at `request.checkpoint` from the source's inputs, answer its steps before `at`
    from the source's trace (nothing paid), re-apply the source's resume edits at the loop-tops it
    was given them (`_stops`), stop at the loop-top of `at`, then continue it as `mklang resume`
    would with `request` (its `reply` the edits, applied there and tainted), `observer` and `tell`
    seeing that live part only. A prefix that does not replay the source's is refused and its
    checkpoint removed."""
    from mklang.runs import build_host, remove_run, resume, start

    if request.checkpoint is None:
        raise UsageError("a fork needs a checkpoint of its own (--checkpoint FILE or --store URI#NAME)")
    _at(source, at)
    machine = machine or source.machine
    loader = MachineLoader()
    loader.add(machine)
    answers = TraceAnswers(source.trace, machine, loader)
    tools = [s.face.tool for m in called_machines(machine, loader) for s in m.states if isinstance(s.face, ToolUse)]
    with build_host(request) as live:  # the host of the live part: its hooks answer the prefix too
        prefix = Host(
            PrefixProvider(answers), prefix_tools(answers, tools), live.hooks, read_only_tools=live.read_only_tools
        )
        envelope = source.envelope
        ancestor = Ancestor(
            run_id=envelope.run_id,
            checkpoint=str(source.location),
            step=".".join(map(str, at)),
            machines={"": envelope.machine.sha256 or "", **envelope.machines},
            inherited=_record(inherited(source, at)),
        )
        edits = _stops(envelope.edits or [], at)
        places = [step_path(edit.at) for edit in edits] + [at]
        halt = Control()
        budget = int(envelope.frames[0]["budget"]) if envelope.frames else machine.budget
        stopped = start(
            machine.replace(budget=budget),
            dict(envelope.input or {}),
            prefix,
            checkpoint=request.checkpoint,
            replace=request.replace,
            control=halt,
            observer=StopAt(halt, places[0]),
            lineage=[*envelope.lineage, ancestor],
            max_tokens=envelope.budgets.max_tokens,
            max_cost=envelope.budgets.max_cost,
            hitl=envelope.hitl,
            untrusted_flow=envelope.untrusted_flow,
            concurrency=envelope.concurrency,
        )
        problem = None
        for edit, place, following in zip(edits, places, places[1:], strict=False):
            problem = _stopped_at(stopped, place)
            if problem is not None:
                break
            halt = Control()
            edited = RunRequest(source=request.checkpoint, reply=edit.set, budget=edit.budget)
            stopped = resume(edited, prefix, control=halt, observer=StopAt(halt, following), tell=_quiet)
        problem = problem or _stopped_at(stopped, at) or _differs(stopped, source, at)
        if problem is not None:
            remove_run(locate(request.checkpoint), unfinished=True)
            raise CheckpointError(f"{source.location}: the fork's prefix is not the source's: {problem}")
        return resume(_continued(request), live, control=control, observer=observer, tell=tell)


def _stops(edits: Sequence[Edit], at: tuple[int, ...]) -> list[Edit]:
    """The source's resume edits the fork's prefix re-applies, in the order they were made: those
    made before the loop-top of `at` or at it (the fork's own `--set` goes on top of them)."""
    return [edit for edit in edits if step_path(edit.at) <= at]


def _quiet(line: str) -> None:
    """What a resume of the prefix would tell: nothing the user asked for (the live part tells its own)."""


def _record(usage: Usage) -> UsageRecord:
    return UsageRecord(input_tokens=usage.input_tokens, output_tokens=usage.output_tokens, cost_usd=usage.cost_usd)


def _continued(request: RunRequest) -> RunRequest:
    """The request that continues the fork from its checkpoint (replacing nothing there)."""
    from dataclasses import replace

    return replace(request, source=request.checkpoint, replace=False)


def _stopped_at(stopped: RunResult, place: tuple[int, ...]) -> str | None:
    """Why the prefix did not stop at the loop-top `place`, or None: parked there on its own (a
    question the source was answered at, a budget it was given more of) or stopped by `StopAt`."""
    from mklang.runs.opening import loop_top

    dotted = ".".join(map(str, place))
    if stopped.status == "suspended" and loop_top(stopped.frames) == dotted:
        return None
    said = stopped.error if stopped.status != "suspended" else stopped.reason
    return f"it ended {stopped.status} ({said}) before step {dotted}"


def _differs(stopped: RunResult, source: Source, at: tuple[int, ...]) -> str | None:
    """Which root step of the prefix is not the source's, or None."""
    replayed = json.loads(json.dumps(stopped.trace))
    expected = source.trace[: at[0] - 1]
    if replayed != expected:
        first = next(i for i, (a, b) in enumerate(zip([*replayed, None], [*expected, None], strict=False)) if a != b)
        return f"step {first + 1} differs (a hook answered otherwise, or the machine changed)"
    return None
