"""`mklang verify-resume`: resume parity as a check an author runs on their own machine.

A scenario is run uninterrupted (its `resumes:` phases included) with a checkpoint, counting every
model and tool call its host answers. Then, for every loop-top the run passes, it is run again,
suspended there (`reason: interrupted`) and resumed as `mklang resume cp.json` would; and for every
crash point it reaches (mklang.faults) it is run again and stopped there as SIGKILL would stop it
(`Crashed`, a BaseException nothing in the engine catches), then recovered, with a second crash
injected into that recovery at a point that moves with each attempt, and recovered again.

Each attempt must end with the uninterrupted run's status, result, context, trace and usage, and
pay no call twice: the calls answered across its processes are the uninterrupted run's plus only
those a crash cut off after they returned and before the journal held them. A tool that the
uninterrupted run calls only after a human's reply (a later phase) must not run in a process that
has not been given that reply: a crash never skips a human decision.

A divergence names what was done to the run and the first step where it parted from the
uninterrupted one (`mklang.comparison`). The uninterrupted run is run twice first: host tools and
hooks (`--plugin`) must answer the same input the same way in every run, as a test double of the
real tool does, and one that answers otherwise when called again (a tool that is not idempotent)
is reported at the step where the two runs part, since no resume could match it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mklang import faults
from mklang.comparison import compare, one_line
from mklang.engine import Control, RunResult
from mklang.engine.decisions import steady
from mklang.engine.events import Event, StateEntered
from mklang.engine.runtime import BRANCH_THREADS
from mklang.model import Machine
from mklang.runs import Resumable, resume, start
from mklang.scenarios import Scenario
from mklang.session import Host
from mklang.vocabulary import lookup

PER_POINT = 6  # occurrences of one crash point tried per phase, spread from the first to the last (--every: all)
OUTCOME = ("status", "error", "reason", "at", "result", "context", "trace", "usage")
MODEL_CALLS = frozenset({"produce", "judge"})
Plugins = tuple[dict[str, Callable[..., Any]], dict[str, Callable[..., Any]]]  # host tools and hooks


class Crashed(BaseException):
    """Raised at a crash point: like SIGKILL, nothing in the engine catches it."""


class _Ungated(BaseException):
    """A tool ran before the human reply that the uninterrupted run waits for ahead of it."""


@dataclass
class Divergence:
    """What was done to the run, and how it then differed from the uninterrupted one."""

    how: str
    what: str

    def to_json(self) -> dict[str, str]:
        return {"how": self.how, "what": self.what}


@dataclass
class Verified:
    """One scenario: how many suspensions and crashes were tried, and the first divergence."""

    scenario: str
    suspensions: int = 0
    crashes: int = 0
    divergence: Divergence | None = None

    def text(self) -> str:
        tried = f"{self.suspensions} suspensions and {self.crashes} crashes"
        if self.divergence is None:
            return f"{self.scenario}: resumed like the uninterrupted run after {tried}"
        return f"{self.scenario}: {self.divergence.how}: {self.divergence.what} ({tried} tried)"

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "suspensions": self.suspensions,
            "crashes": self.crashes,
            "divergence": None if self.divergence is None else self.divergence.to_json(),
        }


class _Points:
    """The crash points a run reaches, in order, and how many answers returned but were never journaled."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()
        self.order: list[str] = []

    def __call__(self, point: str) -> None:
        self.seen[point] += 1
        self.order.append(point)

    def left_after(self, point: str, count: int) -> int:
        """How many points the run reached after the count-th `point`."""
        at = [index for index, name in enumerate(self.order) if name == point][count - 1]
        return len(self.order) - at - 1

    @property
    def lost(self) -> int:
        return self.seen["call.returned"] - self.seen["journal.call"]


class _LoopTops:
    """An observer that records the state of each loop-top outside fan-out branches and asks for
    an interrupt at the `stop_at`-th (0: never)."""

    def __init__(self, control: Control, stop_at: int = 0):
        self.control, self.stop_at = control, stop_at
        self.states: list[str] = []

    def emit(self, event: Event) -> None:
        if isinstance(event, StateEntered) and not event.in_branch:
            self.states.append(event.state)
            if len(self.states) == self.stop_at:
                self.control.interrupted.set()


@dataclass
class _Reference:
    """The uninterrupted run: each phase's outcome, loop-tops (by state) and crash points, its calls,
    and the tools it calls only after a human's reply."""

    outcomes: list[dict[str, Any]] = field(default_factory=list)
    loop_tops: list[list[str]] = field(default_factory=list)
    points: list[_Points] = field(default_factory=list)
    paid: Counter[str] = field(default_factory=Counter)
    gated: frozenset[str] = frozenset()


class _Attempt:
    """One scenario driven through its phases at its own checkpoint, counting what its hosts answer."""

    def __init__(self, machine: Machine, scenario: Scenario, plugins: Plugins, folder: Path, gated: frozenset[str]):
        self.machine, self.scenario, self.plugins, self.gated = machine, scenario, plugins, gated
        folder.mkdir()
        self.checkpoint = folder / "cp.json"
        self.paid: Counter[str] = Counter()
        self.lost = 0

    def host(self, replied: bool) -> Host:
        """The scenario's scripted host plus the plugins, each call counted as it returns; without
        the human's reply, a gated tool may not run."""
        scripted = Host.for_scenario(self.scenario)
        tools, hooks = self.plugins

        def counted(kind: str, call: Callable[..., Any]) -> Callable[..., Any]:
            def answer(*args: Any, **kwargs: Any) -> Any:
                if not replied and kind in self.gated:
                    raise _Ungated(kind)
                value = call(*args, **kwargs)
                self.paid[kind] += 1
                return value

            return answer

        provider = _Provider(counted("produce", scripted.provider.produce), counted("judge", scripted.provider.judge))
        return Host(
            provider,
            {name: counted(name, tool) for name, tool in {**scripted.tools, **tools}.items()},
            {**scripted.hooks, **hooks},
            state=scripted.state,
            scenario=self.scenario,
            settings=scripted.settings,
        )

    def phase(self, number: int, observer: Any = None, control: Control | None = None) -> dict[str, Any]:
        """Phase 0 starts the run; phase n continues it with the scenario's n-th `resumes:` entry."""
        host = self.host(replied=number > 0)
        if number == 0:
            return _outcome(
                start(self.machine, {}, host, checkpoint=self.checkpoint, observer=observer, control=control)
            )
        step = self.scenario.resumes[number - 1]
        return _outcome(resume(self.checkpoint, host, observer=observer, control=control, **step.continuing()))

    def recover(self, number: int) -> dict[str, Any] | None:
        """`mklang resume cp.json` in phase `number` after a stop; the run's own outcome when its end
        was durable already; None when nothing was (the phase is run again)."""
        from mklang.checkpoint.envelope import load
        from mklang.runs.inspection import run_document

        if not self.checkpoint.exists():
            return None
        if load(self.checkpoint).status in ("done", "halted"):
            document = run_document(self.checkpoint)
            return {key: steady(document[key]) if key == "trace" else document.get(key) for key in OUTCOME}
        step = self.scenario.resumes[number - 1] if number > 0 else None

        def host(resumable: Resumable) -> Host:
            """Replied once this phase's values are set and, for an answer, its decision made."""
            if step is None:
                return self.host(False)
            chain = resumable.chain
            replied = all(
                any(lookup(frame.context, path) == value for frame in chain) for path, value in step.set.items()
            )
            if step.answer is not None:
                answers = sum(1 for earlier in self.scenario.resumes[:number] if earlier.answer is not None)
                replied = replied and _decisions(resumable.chain) >= answers
            return self.host(replied)

        return _outcome(resume(self.checkpoint, host, tell=_unsaid))

    def crashing(self, run: Callable[[], dict[str, Any] | None], point: str, count: int) -> dict[str, Any] | None:
        """`run` with a crash armed at the count-th `point`: its outcome, or None when it crashed."""
        points = _Points()
        trap = faults.Trap(point, count, _crash)

        def hook(name: str) -> None:
            points(name)
            trap.reach(name)

        faults.watch(hook)
        try:
            return run()
        except Crashed:
            BRANCH_THREADS.wait_quiet()  # the run's other threads stop at their next point, as under SIGKILL
            self.lost += points.lost
            return None
        finally:
            faults.disarm()


def _unsaid(line: str) -> None:
    """What a recovery would tell the user (a torn journal): the verifier reports what it compares instead."""


@dataclass(frozen=True)
class _Provider:
    """The counted model calls of a scripted provider."""

    produce: Callable[..., Any]
    judge: Callable[..., Any]


def _crash() -> None:
    raise Crashed


def _outcome(result: RunResult) -> dict[str, Any]:
    """The JSON of what a resumed run must share with the uninterrupted one (a decision's question id
    and times are each run's own: `decisions.steady`)."""
    data = result.to_json()
    data["trace"] = steady(data["trace"])
    return dict(json.loads(json.dumps({key: data.get(key) for key in OUTCOME}, default=str)))


def _decisions(chain: list[Any]) -> int:
    """How many human decisions (and deadlines) the levels of a run have applied."""
    return sum(1 for frame in chain for step in frame.trace if "decision" in step)


def _spread(total: int, every: bool) -> list[int]:
    """Which occurrences of a point to try: all, or PER_POINT spread from the first to the last."""
    if every or total <= PER_POINT:
        return list(range(1, total + 1))
    return sorted({1 + round(i * (total - 1) / (PER_POINT - 1)) for i in range(PER_POINT)})


def _scratch() -> str | None:
    """Where the attempts' checkpoints go: a memory file system when there is one (their fsyncs cost
    nothing there, and only process crashes are simulated, never a power cut), else the default."""
    shared = Path("/dev/shm")
    return str(shared) if shared.is_dir() and os.access(shared, os.W_OK) else None


def verify(
    machine: Machine,
    scenario: Scenario,
    tools: dict[str, Callable[..., Any]] | None = None,
    hooks: dict[str, Callable[..., Any]] | None = None,
    every: bool = False,
) -> Verified:
    """Suspend and resume, and crash and recover, a scenario at each loop-top and crash point of
    each phase; the first attempt that ends otherwise than the uninterrupted run is the divergence."""
    plugins: Plugins = (dict(tools or {}), dict(hooks or {}))
    verified = Verified(scenario.name)
    with tempfile.TemporaryDirectory(prefix="mklang-verify-", dir=_scratch()) as folder:
        made = iter(range(1, 1 << 62))

        def attempt(gated: frozenset[str]) -> _Attempt:
            return _Attempt(machine, scenario, plugins, Path(folder) / f"attempt-{next(made)}", gated)

        phases = 1 + len(scenario.resumes)
        reference = _reference(attempt(frozenset()), phases)
        again = _reference(attempt(frozenset()), phases).outcomes[-1]
        if again != reference.outcomes[-1]:
            # No resume can match a run that does not repeat: a tool or hook answers otherwise when called again.
            verified.divergence = Divergence(
                "run twice, uninterrupted", _first_difference(reference.outcomes[-1], again)
            )
            return verified
        for number, states in enumerate(reference.loop_tops):
            for index, state in enumerate(states, 1):
                verified.suspensions += 1
                problem = _suspended(attempt(reference.gated), number, index, reference)
                if problem is not None:
                    verified.divergence = Divergence(
                        f"suspended at loop-top {index} ({state}) of phase {number}", problem
                    )
                    return verified
            for point, total in sorted(reference.points[number].seen.items()):
                for count in _spread(total, every):
                    verified.crashes += 1
                    second = 1 + verified.crashes * 7 % (reference.points[number].left_after(point, count) + 3)
                    problem = _crashed(attempt(reference.gated), number, point, count, second, reference)
                    if problem is not None:
                        how = f"killed at {point}:{count} of phase {number}, and at its {second}th point on resume"
                        verified.divergence = Divergence(how, problem)
                        return verified
    return verified


def _reference(attempt: _Attempt, phases: int) -> _Reference:
    reference = _Reference(paid=attempt.paid)
    for number in range(phases):
        counter, points = _LoopTops(Control()), _Points()
        faults.watch(points)
        try:
            reference.outcomes.append(attempt.phase(number, observer=counter))
        finally:
            faults.disarm()
        reference.loop_tops.append(counter.states)
        reference.points.append(points)
        if number == 0:
            first = set(attempt.paid)
        if reference.outcomes[-1]["status"] != "suspended":
            break
    reference.gated = frozenset(set(attempt.paid) - first - MODEL_CALLS)
    return reference


def _suspended(attempt: _Attempt, number: int, index: int, reference: _Reference) -> str | None:
    for earlier in range(number):
        attempt.phase(earlier)
    control = Control()
    got = attempt.phase(number, observer=_LoopTops(control, index), control=control)
    if (got["status"], got["reason"]) == ("suspended", "interrupted"):
        got = attempt.recover(number) or got
    return _finish(attempt, got, number, reference)


def _crashed(attempt: _Attempt, number: int, point: str, count: int, second: int, reference: _Reference) -> str | None:
    try:
        for earlier in range(number):
            attempt.phase(earlier)
        got = attempt.crashing(lambda: attempt.phase(number), point, count)
        if got is None:
            got = attempt.crashing(lambda: attempt.recover(number), "*", second) or attempt.recover(number)
        if got is None or (number > 0 and got == reference.outcomes[number - 1]):
            got = attempt.phase(number)  # nothing was durable yet, or this phase's reply was lost with the crash
    except _Ungated as skipped:
        return f"the tool {skipped.args[0]} ran before the human's reply that the uninterrupted run waits for"
    return _finish(attempt, got, number, reference)


def _finish(attempt: _Attempt, got: dict[str, Any], number: int, reference: _Reference) -> str | None:
    """Run the phases left, then hold the outcome and the calls answered to the uninterrupted run's."""
    for later in range(number + 1, len(reference.outcomes)):
        if got["status"] != "suspended":
            break
        got = attempt.phase(later)
    expected = reference.outcomes[-1]
    if got != expected:
        return _first_difference(expected, got)
    answered, needed = sum(attempt.paid.values()), sum(reference.paid.values())
    if answered != needed + attempt.lost:
        more = {kind: attempt.paid[kind] - reference.paid[kind] for kind in sorted(attempt.paid)}
        again = ", ".join(f"{kind} {extra}" for kind, extra in more.items() if extra > 0)
        lost = f", {attempt.lost} of them cut off before the journal held them" if attempt.lost else ""
        return f"{answered} calls answered where the uninterrupted run needed {needed}{lost}: again: {again}"
    return None


def _first_difference(expected: dict[str, Any], got: dict[str, Any]) -> str:
    """The first place the resumed run differs: a step (with its first differing field), else the outcome."""
    difference = compare(expected, got)
    if difference["steps"]:
        step = difference["steps"][0]
        if "only_in" in step:
            run = "uninterrupted" if step["only_in"] == "first" else "resumed"
            return f"step {step['step']} ({step['state']}) is only in the {run} run"
        key, (one, other) = next(iter(step["fields"].items()))
        return f"step {step['step']} ({step['state']}) differs: {key}: {one_line(one)} | {one_line(other)}"
    key = next(key for key in OUTCOME if expected.get(key) != got.get(key))
    return f"the {key} differs: {one_line(expected.get(key))} | {one_line(got.get(key))}"
