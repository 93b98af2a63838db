"""What a run is assembled from (the runtime: its defaults, what it is given, the tools, hooks and
machines it finds), what a run reports, and the runtime's budgets, clock and crash points."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from conformance.harness import Recorder, run_mk
from support.journals import KeepsNothing
from support.runs import TWO_STATES, LoopTops, project

from mklang import faults
from mklang.engine import make_runtime, run
from mklang.engine.runtime import COST_SLACK, Caps, Control
from mklang.providers.base import Usage, seconds_left
from mklang.syntax.machines import MachineLoader

# --- what a run is assembled from, and what it reports -------------------------------


def test_a_runtime_defaults_to_eight_calls_in_flight_no_hitl_and_a_run_id_of_its_own():
    runtime = make_runtime(Recorder())
    assert (runtime.concurrency, runtime.hitl, runtime.observer, runtime.control.deadline) == (8, False, None, None)
    assert runtime.journal is None and isinstance(runtime.load_machine, MachineLoader)
    assert len(runtime.run_id) == 32 and int(runtime.run_id, 16) >= 0
    assert make_runtime(Recorder()).run_id != runtime.run_id
    assert runtime.tools.get("calc") is not None and runtime.hooks.get("calc") is None


def test_a_runtime_takes_what_it_is_given_and_at_least_one_call_in_flight():
    control, loader, journal = Control(), MachineLoader(), KeepsNothing()

    observer = LoopTops(print)

    before = time.monotonic()
    runtime = make_runtime(
        Recorder(),
        journal=journal,
        loader=loader,
        run_id="run-7",
        concurrency=3,
        hitl=True,
        control=control,
        observer=observer,
        max_time=60,
        hooks={"h": print},
    )
    assert (runtime.concurrency, runtime.hitl, runtime.run_id) == (3, True, "run-7")
    assert (runtime.journal, runtime.load_machine, runtime.control, runtime.observer) == (
        journal,
        loader,
        control,
        observer,
    )
    assert before + 60 <= control.deadline <= time.monotonic() + 60
    assert runtime.hooks.get("h") is print
    assert make_runtime(Recorder(), concurrency=0).concurrency == 1


def test_tools_and_hooks_registered_as_entry_points_are_found_by_their_documented_groups(monkeypatch):
    import importlib.metadata

    class Point:
        def __init__(self, name: str, value: Any):
            self.name, self.value = name, value

        def load(self) -> Any:
            return self.value

    points = {
        "mklang.tools": [Point("shout", lambda arguments: str(arguments["text"]).upper())],
        "mklang.hooks": [Point("short", lambda context, output: len(output) < 10)],
    }
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: points.get(group, []))
    result = run_mk(
        """
        machine m
        entry a
        budget 3
        tool shout "Upper-cases its text."
        hook short "True when the output is short."
        state a {
          tool shout { text: "hi" }
          output loud
          when "it is short" hook short -> END
          otherwise fail
        }
        """
    )
    assert (result.status, result.error, result.result) == ("done", None, "HI")


def test_a_run_loads_the_machines_it_calls_through_the_loader_it_is_given(tmp_path):
    machine = project(tmp_path, root_budget=5)
    loader = MachineLoader()
    result = run(machine, provider=Recorder({"produce": ["one", "two", "three"]}), loader=loader)
    assert (result.status, result.result) == ("done", "three")
    assert sorted(Path(path).name for path in loader.hashes) == ["root.mk", "sub.mk"]


def test_a_run_result_reports_as_json_what_its_status_calls_for():
    done = run_mk(TWO_STATES, llm={"produce": ["one", "two"], "tokens": [2, 1]})
    assert done.to_json() == {
        "status": "done",
        "error": None,
        "at": None,
        "result": "two",
        "context": {"x": "one", "y": "two"},
        "trace": done.trace,
        "usage": {"input_tokens": 4, "output_tokens": 2, "cost_usd": 0.0},
        "calls": {"produce": 2},
    }
    assert done.reason is None
    asked = run_mk(
        TWO_STATES.replace("otherwise -> b", 'otherwise escalate -> b ask "Go on?" reply_to go'),
        suspendable=True,
        hitl=True,
    )
    data = asked.to_json()
    assert (data["status"], data["error"], data["reason"], asked.reason) == (
        "suspended",
        None,
        "escalated",
        "escalated",
    )
    assert (data["at"], data["ask"], data["reply_to"], data["frames"]) == (
        "b",
        "Go on?",
        "go",
        [{"machine": "m", "state": "b"}],
    )
    assert "detail" not in data and data["result"] is None
    halted = run_mk(TWO_STATES.replace("otherwise -> END", "otherwise fail"), llm={"tokens": [1, 1]})
    data = halted.to_json()
    assert (data["status"], data["error"], data["at"], halted.reason) == ("halted", halted.error, "b", None)
    assert halted.error and "reason" not in data and "frames" not in data
    assert data["usage"] == {"input_tokens": 2, "output_tokens": 2, "cost_usd": 0.0}


def test_a_run_suspended_inside_a_called_machine_reports_the_innermost_state_and_every_level(tmp_path):
    machine = project(tmp_path, root_budget=2, sub_budget=1)
    result = run(machine, provider=Recorder({"tokens": [1, 2]}), suspendable=True)
    data = result.to_json()
    assert (data["status"], data["reason"], data["at"]) == ("suspended", "budget-exhausted", "s2")
    assert data["frames"] == [{"machine": "root", "state": "b"}, {"machine": "sub", "state": "s2"}]
    assert [frame.machine.name for frame in result.frames] == ["root", "sub"]
    assert data["usage"] == {"input_tokens": 2, "output_tokens": 4, "cost_usd": 0.0}  # both levels' calls
    assert data["calls"] == {"produce": 2}
    assert (data["context"], [step["state"] for step in data["trace"]]) == ({"topic": "tides", "x": ""}, ["a"])


def test_an_interrupted_run_that_cannot_suspend_reports_the_context_and_trace_it_reached():
    control = Control()

    def interrupt_at_b(event: Any) -> None:
        if event.state == "b":
            control.interrupted.set()

    result = run_mk(TWO_STATES, llm={"produce": ["one"]}, control=control, observer=LoopTops(interrupt_at_b))
    assert (result.status, result.error, result.at) == ("halted", "interrupted", "b")
    assert (result.context, [step["state"] for step in result.trace]) == ({"x": "one"}, ["a"])


# --- the runtime: budgets, the clock and crash points -----------------------------------


def test_a_token_or_dollar_cap_is_reached_with_a_nano_dollar_of_slack():
    assert Caps().reached(Usage(10**9, 10**9, 10**9)) is False
    assert Caps(tokens=10).reached(Usage(5, 5)) is True
    assert Caps(tokens=10).reached(Usage(5, 4)) is False
    assert Caps(cost=0.10).reached(Usage(cost_usd=sum([0.01] * 10))) is True  # 0.0999...: within the slack
    assert Caps(cost=0.10).reached(Usage(cost_usd=0.10 - COST_SLACK)) is True  # the slack's own edge counts
    assert Caps(cost=0.10).reached(Usage(cost_usd=0.0999)) is False
    assert Caps(tokens=10, cost=0.10).reached(Usage(1, 1, 0.5)) is True
    assert Caps(tokens=10, cost=0.10).reached(Usage(10, 0, 0.0)) is True


def test_a_deadline_is_past_from_its_very_instant(monkeypatch):
    monkeypatch.setattr(time, "monotonic", lambda: 100.0)
    assert Control(deadline=100.0).past_deadline() is True
    assert Control(deadline=100.5).past_deadline() is False
    assert Control().past_deadline() is False
    control = Control()
    assert (control.deadline, control.ceiling, control.interrupted.is_set()) == (None, None, False)


def test_every_model_and_tool_call_reaches_its_crash_points_before_and_after():
    reached: list[str] = []
    faults.watch(reached.append)
    try:
        result = run_mk(
            TWO_STATES.replace(
                'structure "s"\n      prompt "p"\n      output y', 'tool calc { expression: "1+1" }\n      output y'
            )
        )
    finally:
        faults.disarm()
    assert result.status == "done", result.error
    assert reached == ["call.before", "call.returned", "call.before", "call.returned"]


def test_a_call_is_made_under_the_runs_deadline():
    class Timed(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.left: list[float | None] = []

        def produce(self, system, user, tier, reason):
            self.left.append(seconds_left())
            return super().produce(system, user, tier, reason)

    timed = Timed()
    assert run_mk(TWO_STATES, provider=timed, max_time=60).status == "done"
    assert all(left is not None and 0 < left <= 60 for left in timed.left) and len(timed.left) == 2
    untimed = Timed()
    run_mk(TWO_STATES, provider=untimed)
    assert untimed.left == [None, None]
