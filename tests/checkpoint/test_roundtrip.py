"""Round-trip identity (SPEC section 7): a budget that trips at any loop-top, a resume, the same run.

Suspending every golden scenario at each loop-top it passes (root and nested levels alike) and
resuming it is `mklang verify-resume`'s check, run in tests/crash/test_crash_points.py. A run
suspended by a budget and resumed with the budgets it suspended at (`mklang resume cp.json`) takes no
step and leaves its frames as they were (idempotent, seed ADR 0007).
Every snapshot seals its trace into a segment, so the traces compared are
read back from the store.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from support.commands import cli
from support.examples import EXAMPLES, HITL, scripted_machines
from support.runs import InterruptAt, LoopTops, compared
from support.runs import machines_parsed_once as machines_parsed_once  # a fixture

from mklang.checkpoint import segments
from mklang.checkpoint.envelope import load
from mklang.engine import Control, events
from mklang.runs import resume, start
from mklang.scenarios import load_script
from mklang.session import Host
from mklang.syntax import load_file

pytestmark = pytest.mark.usefixtures("machines_parsed_once")  # hundreds of resumes reload the same files


@pytest.fixture(autouse=True)
def sealed(monkeypatch):
    """Every snapshot seals its trace into a segment (ADR 0040): resumes read traces back from the store."""
    monkeypatch.setattr(segments, "SEGMENT_BYTES", 1)


def _start(machine, scenario, checkpoint, **options):
    return start(machine, None, Host.for_scenario(scenario), checkpoint=checkpoint, **options)


def _resume(scenario, checkpoint, **options):
    return resume(checkpoint, Host.for_scenario(scenario), **options)


def _cases():
    for machine, script in scripted_machines():
        for scenario in load_script(script):
            if scenario.run.get("budget") is None:
                yield pytest.param(machine, scenario, id=f"{machine.parent.name}/{machine.stem}:{scenario.name}")


class Spend(LoopTops):
    """An event sink that records, at each loop-top, the root's steps and the run's tokens."""

    def __init__(self):
        super().__init__(self.record)
        self.root_steps: list[int] = []
        self.tokens: list[int] = []

    def record(self, event):
        if len(event.path) == 1:
            self.root_steps.append(event.steps)
        self.tokens.append(event.spent.tokens)


@pytest.mark.parametrize(("machine_path", "scenario"), list(_cases()))
def test_step_and_token_budgets_that_trip_at_each_loop_top_resume_identically(machine_path, scenario, tmp_path):
    machine = load_file(machine_path)
    spend = Spend()
    reference = compared(_start(machine, scenario, tmp_path / "ref.json", observer=spend))
    trips = [("budget-exhausted", steps) for steps in sorted(set(spend.root_steps)) if steps < machine.budget]
    if scenario.run.get("max_tokens") is None:
        trips += [("cost-exhausted", tokens) for tokens in sorted(set(spend.tokens)) if tokens > 0]
    resumed_count = 0
    for reason, limit in trips:
        checkpoint = tmp_path / f"{reason}-{limit}.json"
        if reason == "budget-exhausted":
            first = _start(machine.replace(budget=limit), scenario, checkpoint)
            raise_budget = {"budget": machine.budget}
        else:
            first = _start(machine, scenario, checkpoint, max_tokens=limit)
            raise_budget = {"max_tokens": 10**9}
        if first.status != "suspended" or first.error != reason:
            continue  # the run ended (or parked for a human) before the budget tripped
        _assert_resuming_unchanged_re_suspends_as_it_was(checkpoint, reason)
        resumed = _resume(scenario, checkpoint, **raise_budget)
        assert compared(resumed) == reference, f"resumed after {reason} at {limit}"
        resumed_count += 1
    if reference["status"] == "done" and len(set(spend.root_steps)) > 1:
        assert resumed_count > 0, "a finished multi-step run must trip some budget"


def _assert_resuming_unchanged_re_suspends_as_it_was(checkpoint, reason):
    """`mklang resume cp.json` with the budgets it suspended at takes no step and changes no frame."""
    before = load(checkpoint).frames
    done = cli("resume", str(checkpoint), "--format", "json")
    assert (done.returncode, json.loads(done.stdout)["reason"]) == (3, reason), done.stderr
    assert load(checkpoint).frames == before, f"resuming at the {reason} of {[f['state'] for f in before]}"


def test_resuming_a_pending_question_without_its_reply_re_suspends_as_it_was(tmp_path):
    asked = 0
    for machine_path, script in scripted_machines():
        for scenario in load_script(script):
            checkpoint = tmp_path / f"{machine_path.stem}-{scenario.name}.json"
            first = _start(load_file(machine_path), scenario, checkpoint)
            if (first.status, first.error) == ("suspended", "escalated"):
                _assert_resuming_unchanged_re_suspends_as_it_was(checkpoint, "escalated")
                asked += 1
    assert asked >= 2  # the approval and triage examples park on a human


def test_resuming_with_unchanged_budget_re_suspends_with_identical_frames(tmp_path):
    root = EXAMPLES
    machine = load_file(root / "nested" / "brief.mk")
    scenario = load_script(root / "nested" / "scenarios.yaml")[0]
    checkpoint = tmp_path / "cp.json"
    control = Control()
    first = _start(machine, scenario, checkpoint, observer=InterruptAt(control, 3), control=control)
    assert first.status == "suspended"
    assert len(first.frames) >= 2  # suspended inside a nested call
    before = load(checkpoint)
    # Lower the innermost step budget to what it has spent: resuming re-suspends at once.
    spent = before.frames[-1]["steps"]
    again = _resume(scenario, checkpoint, budget=spent)
    assert (again.status, again.error, again.at) == ("suspended", "budget-exhausted", first.at)
    frames_after = load(checkpoint).frames
    again2 = _resume(scenario, checkpoint)
    assert (again2.status, again2.error) == ("suspended", "budget-exhausted")
    assert load(checkpoint).frames == frames_after  # idempotent: the same frames every time
    assert [f["state"] for f in frames_after] == [f["state"] for f in before.frames]


def test_a_run_resumes_from_a_path_or_an_envelope(tmp_path):
    root = HITL
    machine = load_file(root / "approval" / "approval.mk")
    scenario = next(s for s in load_script(root / "approval" / "scenarios.yaml") if s.name == "ask-then-publish")
    checkpoint = tmp_path / "cp.json"
    first = _start(machine, scenario, checkpoint)
    assert (first.status, first.error, first.reply_to) == ("suspended", "escalated", "approval.answer")
    envelope = load(checkpoint)
    # The second resume continues the same suspended generation again: a rollback, allowed here.
    for target, allow_rollback in ((checkpoint, False), (envelope, True)):
        done = resume(
            target,
            Host.for_scenario(scenario),
            reply={"approval.answer": "yes"},
            checkpoint=tmp_path / "again.json",
            allow_rollback=allow_rollback,
        )
        assert done.status == "done" and done.context["approval"]["answer"] == "yes"
        assert done.trace[0] == first.trace[0]


class Calls:
    """An event sink counting the model and tool calls a run made."""

    def __init__(self, then: Any = None):
        self.made, self.then = 0, then

    def emit(self, event: events.Event) -> None:
        self.made += isinstance(event, (events.ModelFinished, events.ToolFinished))
        if self.then is not None:
            self.then.emit(event)


def test_a_run_suspended_three_levels_deep_resumes_each_level_where_it_was_asking_nothing_again(tmp_path):
    machine = load_file(EXAMPLES / "nested" / "brief.mk")
    scenario = load_script(EXAMPLES / "nested" / "scenarios.yaml")[0]
    control = Control()
    before = Calls(InterruptAt(control, 5))
    parked = _start(machine, scenario, tmp_path / "cp.json", control=control, observer=before)
    assert [frame.machine.name for frame in parked.frames] == ["brief", "section", "fact_check"]
    after, whole = Calls(), Calls()
    done = _resume(scenario, tmp_path / "cp.json", observer=after)
    assert compared(done) == compared(_start(machine, scenario, tmp_path / "ref.json", observer=whole))
    assert before.made + after.made == whole.made  # each level went on from its step: no call was made again
