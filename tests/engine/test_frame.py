"""Frames as checkpoints record them: a fresh level, every field recorded in order, and a record
read back, with or without its optional keys."""

from __future__ import annotations

import json

from conformance.harness import mk

from mklang.engine.frame import Frame
from mklang.providers.base import Usage

REPAIRING = """
    machine repairing
    entry a
    budget 7
    context { topic: "tides", n: 0 }
    state a {
      structure "s"
      prompt "p"
      output x
      when "it is wrong" repair 2 -> a
      otherwise -> b
    }
    state b {
      structure "s"
      prompt "p"
      output y
      when "it is odd" repair 1 -> b
      when "it is wrong" repair 0 -> b
      otherwise -> END
    }
"""


def test_a_fresh_frame_has_a_repair_counter_per_repair_gate_and_taints_the_inputs_given():
    machine = mk(REPAIRING)
    frame = Frame.start(machine, {"topic": "moons", "more.deep": 1})
    assert (frame.state, frame.budget, frame.steps) == ("a", 7, 0)
    assert frame.context == {"topic": "moons", "n": 0, "more": {"deep": 1}}
    assert frame.repair_left == {("a", 0): 2, ("b", 0): 1, ("b", 1): 0}
    assert frame.tainted == {"topic", "more"}
    assert Frame.start(machine, {"topic": "moons"}, tainted=set()).tainted == set()
    assert Frame.start(machine).tainted == set()
    assert machine.context == {"topic": "tides", "n": 0}  # the defaults are copied, not written into


def _full_frame() -> Frame:
    frame = Frame.start(mk(REPAIRING), {"topic": "moons"})
    frame.state = "b"
    frame.tainted = {"x", "topic", "a"}
    frame.steps = 3
    frame.usage = Usage(5, 7, 0.25)
    frame.feedback = "fix it"
    frame.repair_left = {("b", 1): 0, ("a", 0): 1, ("b", 0): 1}
    frame.visits = {"b": 1, "a": 2}
    frame.trace = [{"state": "a", "step": 1}]
    frame.last_output = {"v": [1]}
    frame.branches = {2: {"output": "two", "usage": Usage(1, 1, 0.0).to_json()}, 0: {"output": "zero", "usage": {}}}
    frame.halted = "gate-fail"
    frame.ask = {"ask": "Go on?", "reply_to": "go"}
    frame.external = {"x", "topic"}
    frame.decision_tainted = True
    return frame


def test_a_frame_is_recorded_with_every_field_its_collections_in_order():
    recorded = _full_frame().to_json()
    assert json.dumps(recorded) == json.dumps(
        {
            "machine": "repairing",
            "path": None,
            "state": "b",
            "context": {"topic": "moons", "n": 0},
            "tainted": ["a", "topic", "x"],
            "steps": 3,
            "budget": 7,
            "usage": {"input_tokens": 5, "output_tokens": 7, "cost_usd": 0.25},
            "feedback": "fix it",
            "repair_left": [("a", 0, 1), ("b", 0, 1), ("b", 1, 0)],
            "visits": {"a": 2, "b": 1},
            "trace": [{"state": "a", "step": 1}],
            "last_output": {"v": [1]},
            "halted": "gate-fail",
            "ask": {"ask": "Go on?", "reply_to": "go"},
            "external": ["topic", "x"],
            "decision_tainted": True,
            "branches": [(0, {"output": "zero", "usage": {}}), (2, {"output": "two", "usage": Usage(1, 1).to_json()})],
        }
    )
    plain = Frame.start(mk(REPAIRING)).to_json()
    assert "branches" not in plain and plain["halted"] is None and plain["ask"] is None
    assert (plain["external"], plain["decision_tainted"]) == ([], False)


def test_a_recorded_frame_reads_back_as_it_was():
    frame = _full_frame()
    again = Frame.from_json(json.loads(json.dumps(frame.to_json())), frame.machine)
    assert again == frame


def test_a_frame_record_without_its_optional_keys_reads_as_a_fresh_level():
    """...but for control-flow taint, which it cannot vouch for: every key external, the decision tainted."""
    machine = mk(REPAIRING)
    frame = Frame.from_json({"state": "b", "context": {"n": 1}, "budget": "4", "steps": "2"}, machine)
    fresh = Frame(machine=machine, state="b", context={"n": 1}, tainted=set(), budget=4, steps=2)
    fresh.external, fresh.decision_tainted = {"n"}, True
    assert frame == fresh
    assert (frame.usage, frame.trace, frame.branches, frame.last_output) == (Usage(), [], {}, None)
    numbers = Frame.from_json(
        {
            "state": "b",
            "context": {},
            "budget": 1,
            "steps": 0,
            "repair_left": [["a", "0", "2"]],
            "visits": {"a": "3"},
            "branches": [["1", {"output": 1, "usage": {}}]],
        },
        machine,
    )
    assert (numbers.repair_left, numbers.visits, numbers.branches) == (
        {("a", 0): 2},
        {"a": 3},
        {1: {"output": 1, "usage": {}}},
    )
