"""Runs crashed in process at the points of mklang.faults, and their resumes (one `Attempt` each)."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from mklang import faults
from mklang.checkpoint.envelope import load
from mklang.checkpoint.segments import recorded_trace
from mklang.engine.runtime import BRANCH_THREADS
from mklang.providers.base import Usage
from mklang.runs import open_run, proceed, start
from mklang.scenarios import Scenario, ScriptedHost, load_script
from mklang.session import Host
from mklang.stores import locate
from mklang.syntax import load_file
from mklang.vocabulary import lookup
from support import ROOT
from support.runs import LoopTops

PER_POINT = 6  # occurrences of one point crashed at per scenario (all with MKLANG_CRASH_FULL=1)
# The human's reply that continues a scenario which suspends on an ask.
REPLIES = {"ask-then-publish": {"approval.answer": "yes"}}


class Crash(BaseException):
    """Not an Exception: nothing in the engine may catch it, as nothing catches SIGKILL."""


def crash() -> None:
    raise Crash


CRASHED = object()


class CountedHost:
    """A scenario's scripted host whose model and tool calls are counted as they return.

    `replied`: whether the human's reply is part of the run this process
    continues; a tool the uninterrupted run only calls after the reply must
    not run in a process without it.
    """

    def __init__(self, scenario: Scenario, paid: Counter, replied: bool, gated: set[str]):
        self.scripted, self.scenario = ScriptedHost(scenario), scenario
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

    def host(self) -> Host:
        return Host(
            self.provider,
            self.tools,
            self.scripted.hooks.functions(),
            state=self.scripted.state,
            scenario=self.scenario,
        )


def settings(scenario: Scenario) -> dict[str, Any]:
    run = scenario.run
    return dict(
        max_tokens=run.get("max_tokens"),
        max_cost=run.get("max_cost"),
        concurrency=run.get("concurrency", 1),
        hitl=bool(run.get("hitl", False)),
    )


def finished_outcome(checkpoint: Path) -> dict[str, Any] | None:
    """The outcome a checkpoint file holds once its run is done or halted (JSON as written), else None."""
    envelope = json.loads(checkpoint.read_text())
    if envelope["status"] not in ("done", "halted"):
        return None
    root = envelope["frames"][0]
    trace = recorded_trace(locate(checkpoint), root, trusted=True)
    return {
        "status": envelope["status"],
        "error": envelope["error"],
        "at": envelope["at"],
        "result": envelope["result"],
        "context": root["context"],
        "trace": list(trace),
        "usage": envelope["usage"],
    }


class Finished:
    """The outcome a finished checkpoint holds, shaped like a RunResult."""

    def __init__(self, envelope, checkpoint: Path):
        root = dict(envelope.frames[0])
        self.status, self.error, self.at, self.ask = envelope.status, envelope.error, envelope.at, envelope.ask
        self.result, self.context = envelope.result, root["context"]
        self.trace = list(recorded_trace(locate(checkpoint), root, trusted=True))
        self.usage = Usage.from_json(envelope.usage)


def outcome(result) -> dict[str, Any]:
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
    """Counts the crash points a run reaches, in order, and how many answers were lost in flight."""

    def __init__(self):
        self.seen: Counter = Counter()
        self.order: list[str] = []

    def __call__(self, point: str) -> None:
        self.seen[point] += 1
        self.order.append(point)

    def left_after(self, point: str, count: int) -> int:
        """How many points the run reached after the count-th `point`."""
        at = [i for i, name in enumerate(self.order) if name == point][count - 1]
        return len(self.order) - at - 1

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
            host = CountedHost(self.scenario, self.paid, False, self.gated)
            return start(
                self.machine,
                dict(self.scenario.input),
                host.host(),
                checkpoint=self.checkpoint,
                **settings(self.scenario),
            )
        host = CountedHost(self.scenario, self.paid, True, self.gated)
        return proceed(open_run(self.checkpoint), host.host(), reply=REPLIES[self.scenario.name])

    def recover(self):
        """`mklang resume cp.json` with no options, after a crash; or, when the crash came
        before the first snapshot, the run started again (no call had started)."""
        if not self.checkpoint.exists():
            assert not self.paid
            return self.phase(0)
        envelope = load(self.checkpoint)
        if envelope.status in ("done", "halted"):  # the crash came after the run's end was durable
            return Finished(envelope, self.checkpoint)
        resumable = open_run(self.checkpoint)
        replied = any(
            lookup(frame.context, key) == value
            for frame in resumable.chain
            for key, value in REPLIES.get(self.scenario.name, {}).items()
        )
        host = CountedHost(self.scenario, self.paid, replied, self.gated)
        return proceed(resumable, host.host())

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
            BRANCH_THREADS.wait_quiet()
            self.lost += points.lost
            return CRASHED
        finally:
            faults.disarm()


def counts(total: int) -> list[int]:
    """Which occurrences of a point to crash at: all of them, or (unless MKLANG_CRASH_FULL=1)
    at most PER_POINT spread evenly from the first to the last, so the suite stays fast."""
    if total <= PER_POINT or os.environ.get("MKLANG_CRASH_FULL") == "1":
        return list(range(1, total + 1))
    return sorted({1 + round(i * (total - 1) / (PER_POINT - 1)) for i in range(PER_POINT)})


def dead_run(folder: Path, example: str, main: str, crash_at: int) -> Path:
    """A copy of an example whose checkpointed run died at its `crash_at`-th loop-top."""
    shutil.copytree(ROOT / "examples" / example, folder / example)
    machine = load_file(folder / example / main)
    scenario = load_script(folder / example / "scenarios.yaml")[0]
    tops = iter(range(crash_at - 1))

    def die_at_loop_top(event: Any) -> None:
        if next(tops, None) is None:
            raise Crash

    path = folder / "cp.json"
    try:
        start(machine, None, Host.for_scenario(scenario), checkpoint=path, observer=LoopTops(die_at_loop_top))
    except Crash:
        return path
    raise AssertionError(f"the run of {example} ended before loop-top {crash_at}")
