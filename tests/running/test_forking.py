"""A fork's prefix answered from the source's trace (mklang.forking): the engine, run again with
those answers, reaches every loop-top of the source as the source did, and pays nothing."""

from __future__ import annotations

import json

import pytest
from support import ROOT
from support.examples import scripted_machines

from mklang.engine import Control
from mklang.forking import PrefixMismatch, PrefixProvider, StopAt, TraceAnswers, prefix_tools
from mklang.model import ToolUse, called_machines
from mklang.runs import start
from mklang.scenarios import load_script
from mklang.session import Host
from mklang.syntax import load_file
from mklang.syntax.machines import MachineLoader


def _cases():
    for machine, script in scripted_machines():
        for scenario in load_script(script):
            if not scenario.resumes and scenario.run.get("budget") is None:
                yield pytest.param(machine, scenario, id=f"{machine.parent.name}/{machine.stem}:{scenario.name}")


def _prefix_host(answers: TraceAnswers, machine, loader, scenario) -> Host:
    """The source's answers for the model and the tools; the scenario's own hooks (they are asked again)."""
    tools = [s.face.tool for m in called_machines(machine, loader) for s in m.states if isinstance(s.face, ToolUse)]
    scripted = Host.for_scenario(scenario)
    return Host(
        PrefixProvider(answers), prefix_tools(answers, tools), scripted.hooks, state=scripted.state, scenario=scenario
    )


@pytest.mark.parametrize(("machine_path", "scenario"), list(_cases()))
def test_a_prefix_answered_from_the_trace_reaches_each_loop_top_as_the_source_did(machine_path, scenario):
    machine = load_file(machine_path)
    loader = MachineLoader()
    loader.add(machine)
    source = json.loads(json.dumps(start(machine, {}, Host.for_scenario(scenario)).trace))
    for step in range(2, len(source) + 2):  # stop at the loop-top of `step`, or let the whole run replay
        answers = TraceAnswers(source, machine, loader)
        control = Control()
        stopped = start(
            machine,
            {},
            _prefix_host(answers, machine, loader, scenario),
            control=control,
            observer=StopAt(control, (step,)),
        )
        replayed = json.loads(json.dumps(stopped.trace))
        if step <= len(source):
            assert stopped.error == "interrupted", step  # in memory an interrupt halts the run there
        assert replayed == source[: step - 1], f"stopped before step {step}"


def test_a_judge_asked_what_the_source_was_not_asked_is_a_mismatch():
    machine = load_file(ROOT / "examples/triage/triage.mk")
    loader = MachineLoader()
    loader.add(machine)
    scenario = load_script(ROOT / "examples/triage/scenarios.yaml")[1]  # bug: judged, looked up, repaired
    source = json.loads(json.dumps(start(machine, {}, Host.for_scenario(scenario)).trace))
    answers = TraceAnswers(source, machine, loader)
    assert answers.judge("r:1.g.1", ["the category is bug"]).choice == 0
    with pytest.raises(PrefixMismatch, match="do not hold the gate the source took"):
        answers.judge("r:1.g.1", ["the category is billing"])
    with pytest.raises(PrefixMismatch, match="step 40 is not in the source's trace"):
        answers.produce("r:40.0.1")
    with pytest.raises(PrefixMismatch, match="the source made no such model call"):
        answers.produce("r:2.0.1")  # step 2 is the KB lookup, a tool
    assert answers.tool("r:2.0.1") == source[1]["output"]
