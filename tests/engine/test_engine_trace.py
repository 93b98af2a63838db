"""The trace of SPEC section 6: which keys each kind of step carries."""

from __future__ import annotations

from conformance.harness import run_mk, write_machines

ALWAYS = {"step", "state", "policy", "to", "gate", "gate_via", "usage"}
# `judge_parse` (how a real judge answer was read, ADR 0006) is the one addition to SPEC section 6.
ALLOWED = ALWAYS | {"output", "branches", "reasoning", "sub_trace", "judge_fallback", "judge_none", "judge_parse"}
ALLOWED |= {"decision_tainted", "untrusted_control_flow"}
USAGE = {"input_tokens", "output_tokens", "cost_usd"}

MACHINE = """
    machine traced
    entry think
    budget 10
    hook fine "x"
    context { xs: ["a", "b"] }
    state think {
      reason
      structure "s"
      prompt "think"
      output thought
      when "needs tools" -> look
      otherwise fail
    }
    state look {
      tool lookup { q: "{{thought}}" }
      output obs
      when "looked" hook fine -> each
    }
    state each {
      over xs
      structure "s"
      prompt "{{item}}"
      output parts
      otherwise -> sub
    }
    state sub {
      call traced_child
      output r
      when "never" -> END
      otherwise escalate -> END ask "Done?"
    }
"""

CHILD = """
    machine traced_child
    entry c
    budget 5
    state c {
      structure "s"
      prompt "child"
      output o
      otherwise -> END
    }
"""


def traced(tmp_path):
    machine = write_machines(tmp_path, MACHINE, CHILD)
    llm = {
        "produce": {"think": {"text": "T", "reasoning": "R"}, "a": "A", "b": "B", "child": "C"},
        "judge": [0, "none"],
        "tokens": [2, 1],
    }
    result = run_mk(machine, llm=llm, tools={"lookup": lambda args: "O"}, hooks={"fine": lambda c, o: True})
    assert result.status == "done", result.error
    return result


def test_every_step_has_the_section_6_keys_and_no_others(tmp_path):
    result = traced(tmp_path)
    for step in result.trace + result.trace[3]["sub_trace"]:
        assert ALWAYS <= set(step) <= ALLOWED, step
        assert set(step["usage"]) == USAGE


def test_steps_are_numbered_from_1_and_name_their_route(tmp_path):
    result = traced(tmp_path)
    assert [(s["step"], s["state"], s["policy"], s["to"], s["gate"], s["gate_via"]) for s in result.trace] == [
        (1, "think", "ok", "look", "needs tools", "llm"),
        (2, "look", "ok", "each", "looked", "hook"),
        (3, "each", "ok", "sub", "otherwise", "otherwise"),
        (4, "sub", "escalate", "END", "otherwise", "otherwise"),
    ]


def test_each_face_records_its_output_its_way(tmp_path):
    think, look, each, sub = traced(tmp_path).trace
    assert (think["output"], think["reasoning"]) == ("T", "R")
    assert look["output"] == "O" and "reasoning" not in look
    assert "output" not in each and [b["output"] for b in each["branches"]] == ["A", "B"]
    assert sub["output"] == "C" and [s["output"] for s in sub["sub_trace"]] == ["C"]
    assert sub["judge_none"] == 1 and "judge_none" not in think


def test_the_run_usage_is_the_sum_of_its_steps(tmp_path):
    result = traced(tmp_path)
    assert result.usage.input_tokens == sum(s["usage"]["input_tokens"] for s in result.trace) == 8
    assert result.trace[1]["usage"] == {"input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0}


def test_reasoning_never_reaches_the_context(tmp_path):
    context = traced(tmp_path).context
    assert context["thought"] == "T"
    assert "R" not in repr(context)
