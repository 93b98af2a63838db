"""Every crash point of every golden scenario, in process: the run resumes to the same run.

A run is crashed at each point it reaches (mklang.faults: every journal
line, every envelope and journal-generation write before and after its
rename, before every model and tool call and after it returns), at every
nesting level, and resumed as `mklang resume cp.json` would; a second
crash is injected into that resume, which is resumed again. The final
trace, usage, context and result must equal the uninterrupted run's, and
the calls paid across all processes must equal the uninterrupted run's plus
only those that had returned but were not yet journaled when a crash hit.
HITL scenarios are continued with the human's reply: no tool of the
uninterrupted run's later phases may run before the reply is given.

`Crash` is a BaseException raised from the crash point: like SIGKILL,
nothing in the engine catches it, and once it has fired every later point
(in any thread) raises too, so nothing is written after it. The real
SIGKILL of real subprocesses is tests/crash/test_crash.py.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import threading
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import pydantic
import pytest
from support.examples import scripted_machines

import mklang.checkpoint.envelope as envelope_module
import mklang.checkpoint.journal as journal_module
import mklang.syntax
from mklang import faults
from mklang.checkpoint import continue_checkpoint, open_checkpoint, start
from mklang.checkpoint.envelope import load
from mklang.providers.base import Usage
from mklang.scenarios import Scenario, ScriptedHost, load_script
from mklang.syntax import load_file
from mklang.vocabulary import lookup

PER_POINT = 6  # occurrences of one point crashed at per scenario (all with MKLANG_CRASH_FULL=1)
# The human's reply that continues a scenario which suspends on an ask.
REPLIES = {"ask-then-publish": {"approval.answer": "yes"}}


class Crash(BaseException):
    """Not an Exception: nothing in the engine may catch it, as nothing catches SIGKILL."""


def crash() -> None:
    raise Crash


CRASHED = object()


class Host:
    """A scenario's scripted host whose model and tool calls are counted as they return.

    `replied`: whether the human's reply is part of the run this process
    continues; a tool the uninterrupted run only calls after the reply must
    not run in a process without it.
    """

    def __init__(self, scenario: Scenario, paid: Counter, replied: bool, gated: set[str]):
        self.scripted = ScriptedHost(scenario)
        self.paid, self.replied, self.gated = paid, replied, gated
        provider = self.scripted.provider
        self.provider = self
        self.produce = self._counted("produce", provider.produce)
        self.judge = self._counted("judge", provider.judge)
        self.tools = {name: self._counted(name, tool) for name, tool in self.scripted.tools.functions().items()}

    def _counted(self, kind: str, call):
        def counted(*args: Any, **kwargs: Any) -> Any:
            assert self.replied or kind not in self.gated, f"{kind} ran before the human replied"
            answer = call(*args, **kwargs)
            self.paid[kind] += 1
            return answer

        return counted

    def options(self) -> dict[str, Any]:
        return dict(
            provider=self.provider,
            tools=self.tools,
            hooks=self.scripted.hooks.functions(),
            scripted=self.scripted,
        )


def _settings(scenario: Scenario) -> dict[str, Any]:
    run = scenario.run
    return dict(
        max_tokens=run.get("max_tokens"),
        max_cost=run.get("max_cost"),
        concurrency=run.get("concurrency", 1),
        hitl=bool(run.get("hitl", False)),
    )


class Finished:
    """The outcome a finished checkpoint holds, shaped like a RunResult."""

    def __init__(self, envelope):
        root = envelope.frames[0]
        self.status, self.error, self.at, self.ask = envelope.status, envelope.error, envelope.at, envelope.ask
        self.result, self.context, self.trace = envelope.result, root["context"], root["trace"]
        self.usage = Usage.from_json(envelope.usage)


def _outcome(result) -> dict[str, Any]:
    return json.loads(
        json.dumps(
            {
                "status": result.status,
                "error": result.error,
                "at": result.at,
                "ask": result.ask,
                "result": result.result,
                "context": result.context,
                "trace": result.trace,
                "usage": result.usage.to_json(),
            }
        )
    )


class Points:
    """Counts the crash points a run reaches, and how many answers were lost in flight."""

    def __init__(self):
        self.seen: Counter = Counter()

    def __call__(self, point: str) -> None:
        self.seen[point] += 1

    @property
    def lost(self) -> int:
        """Calls that returned but whose answer never reached the journal."""
        return self.seen["call.returned"] - self.seen["journal.call"]


class Attempt:
    """One scenario driven through its phases: start, then the human's reply if it has one."""

    def __init__(self, machine, scenario: Scenario, folder: Path, gated: set[str] = frozenset()):
        self.machine, self.scenario, self.gated = machine, scenario, gated
        folder.mkdir()
        self.checkpoint = folder / "cp.json"
        self.paid: Counter = Counter()
        self.lost = 0  # answers paid for but lost to a crash before they were journaled

    def phase(self, number: int):
        """Run phase `number` as the uninterrupted run does."""
        if number == 0:
            host = Host(self.scenario, self.paid, False, self.gated)
            return start(
                self.machine,
                dict(self.scenario.input),
                checkpoint=self.checkpoint,
                **host.options(),
                **_settings(self.scenario),
            )
        host = Host(self.scenario, self.paid, True, self.gated)
        return continue_checkpoint(
            open_checkpoint(self.checkpoint), set_values=REPLIES[self.scenario.name], **host.options()
        )

    def recover(self):
        """`mklang resume cp.json` with no options, after a crash; or, when the crash came
        before the first snapshot, the run started again (no call had started)."""
        if not self.checkpoint.exists():
            assert not self.paid
            return self.phase(0)
        envelope = load(self.checkpoint)
        if envelope.status in ("done", "halted"):  # the crash came after the run's end was durable
            return Finished(envelope)
        resumable = open_checkpoint(self.checkpoint)
        replied = any(
            lookup(frame.context, key) == value
            for frame in resumable.chain
            for key, value in REPLIES.get(self.scenario.name, {}).items()
        )
        host = Host(self.scenario, self.paid, replied, self.gated)
        return continue_checkpoint(resumable, **host.options())

    def crashing(self, run, point: str, count: int):
        """Run `run` with a crash armed at the count-th `point`: its result, or CRASHED."""
        points = Points()
        trap = faults.Trap(point, count, crash)

        def hook(name: str) -> None:
            points(name)
            trap.reach(name)

        faults.watch(hook)
        try:
            return run()
        except Crash:
            # SIGKILL stops every thread: let the run's other threads reach their next point,
            # where the armed trap stops them too, before anything is disarmed.
            for thread in threading.enumerate():
                if thread.name == "mklang-branch":
                    thread.join()
            self.lost += points.lost
            return CRASHED
        finally:
            faults.disarm()


def _phases(scenario: Scenario) -> int:
    return 2 if scenario.name in REPLIES else 1


def _counts(total: int) -> list[int]:
    """Which occurrences of a point to crash at: all of them, or (unless MKLANG_CRASH_FULL=1)
    at most PER_POINT spread evenly from the first to the last, so the suite stays fast."""
    if total <= PER_POINT or os.environ.get("MKLANG_CRASH_FULL") == "1":
        return list(range(1, total + 1))
    return sorted({1 + round(i * (total - 1) / (PER_POINT - 1)) for i in range(PER_POINT)})


def _cases():
    for machine, script in scripted_machines():
        for scenario in load_script(script):
            if scenario.run.get("budget") is None:
                yield pytest.param(machine, scenario, id=f"{machine.parent.name}/{machine.stem}:{scenario.name}")


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    """fsync only matters for power cuts, not for a crash inside the process; each
    machine file is parsed once (thousands of resumes reload the same files); the
    thousands of envelopes of the same shapes are not each held to the schema
    (conftest), which every other checkpoint test does."""
    monkeypatch.setattr(os, "fsync", lambda descriptor: None)
    monkeypatch.setattr(envelope_module.Envelope, "model_dump", pydantic.BaseModel.model_dump)
    monkeypatch.setattr(mklang.syntax, "load_file", functools.cache(mklang.syntax.load_file))
    monkeypatch.setattr(journal_module, "MIN_COMPACT_BYTES", 2048)  # compactions happen too


@pytest.fixture
def memory_folder(tmp_path):
    """Thousands of small checkpoint files: in memory when the system offers a tmpfs."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix="mklang-crash-", dir=shm))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _without_delays(scenario: Scenario) -> Scenario:
    llm = {key: value for key, value in scenario.llm.items() if key != "delay_ms"}
    return Scenario(**{**scenario.__dict__, "llm": llm})


@pytest.mark.parametrize(("machine_path", "scenario"), list(_cases()))
def test_a_crash_at_any_point_then_another_during_the_resume_gives_the_uninterrupted_run(
    machine_path, scenario, memory_folder
):
    tmp_path = memory_folder
    machine = load_file(machine_path)
    scenario = _without_delays(scenario)
    phases = 2 if scenario.name in REPLIES else 1
    reference = Attempt(machine, scenario, tmp_path / "reference")
    outcomes, reached = [], []
    for number in range(phases):
        points = Points()
        faults.watch(points)
        try:
            outcomes.append(_outcome(reference.phase(number)))
        finally:
            faults.disarm()
        reached.append(points.seen)
        if number == 0:
            before_reply = set(reference.paid)
    gated = set(reference.paid) - before_reply - {"produce", "judge"}

    attempts = 0
    for number in range(phases):
        for point, total in sorted(reached[number].items()):
            for count in _counts(total):
                attempts += 1
                label = f"phase {number}, crash at {point}:{count}"
                attempt = Attempt(machine, scenario, tmp_path / f"{number}-{point}-{count}", gated)
                for earlier in range(number):
                    attempt.phase(earlier)
                assert attempt.crashing(partial(attempt.phase, number), point, count) is CRASHED, label
                # A second crash during the resume, at a point that moves with each attempt.
                second = 1 + attempts % 11
                resumed = attempt.crashing(attempt.recover, "*", second)
                while resumed is CRASHED:
                    second += 7
                    resumed = attempt.crashing(attempt.recover, "*", second)
                result = _outcome(resumed)
                if number > 0 and result == outcomes[number - 1]:
                    # Crashed before the reply was durable: the run waits for it still; give it again.
                    result = _outcome(attempt.phase(number))
                assert result == outcomes[number], label
                for later in range(number + 1, phases):
                    result = _outcome(attempt.phase(later))
                assert result == outcomes[-1], label
                assert sum(attempt.paid.values()) == sum(reference.paid.values()) + attempt.lost, (
                    label,
                    attempt.paid,
                    reference.paid,
                )
    assert attempts == sum(len(_counts(total)) for seen in reached for total in seen.values())


def test_the_golden_scenarios_reach_every_documented_crash_point(memory_folder):
    """A point that is renamed or no longer reached would silently drop out of the sweep."""
    reached: Counter = Counter()
    for machine_path, scenario in [case.values for case in _cases()]:
        if machine_path.stem in ("brief", "plan_execute"):  # nesting; a halt before any step
            faults.watch(lambda point: reached.update([point]))
            try:
                Attempt(load_file(machine_path), scenario, memory_folder / scenario.name).phase(0)
            finally:
                faults.disarm()
    documented = {"journal.gen", "journal.enter", "journal.step", "journal.halt", "journal.call", "envelope.temp"}
    documented |= {"envelope", "journal.gen.temp", "call.before", "call.returned"}
    assert documented <= set(reached), documented - set(reached)
    assert os.environ.get(faults.ENV) is None
