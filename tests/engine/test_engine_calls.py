"""Call states: sub-runs, their traces, depth and spend (SPEC sections 4 "Call", 5 and 6)."""

from __future__ import annotations

import pytest
from conformance.harness import Recorder, run_mk, write_machines

from mklang.engine import run
from mklang.engine.runtime import NullJournal

PARENT = """
    machine parent
    entry warm
    budget 5
    state warm {
      structure "s"
      prompt "warm up"
      output w
      otherwise -> go
    }
    state go {
      call child { topic: "{{w}}" }
      output r
      otherwise -> END
    }
"""

CHILD = """
    machine child
    entry a
    budget 5
    state a {
      structure "s"
      prompt "a"
      output o
      otherwise -> b
    }
    state b {
      structure "s"
      prompt "b"
      output o
      otherwise -> END
    }
"""

FAILING_CHILD = """
    machine child
    entry a
    budget 5
    state a {
      structure "s"
      prompt "a"
      output o
      otherwise fail
    }
"""


def test_the_child_trace_is_embedded_as_sub_trace(tmp_path):
    machine = write_machines(tmp_path, PARENT, CHILD)
    result = run_mk(machine, llm={"produce": ["w", "x", "y"]})
    assert result.status == "done"
    call_step = result.trace[1]
    assert [(s["step"], s["state"], s["to"], s["output"]) for s in call_step["sub_trace"]] == [
        (1, "a", "b", "x"),
        (2, "b", "END", "y"),
    ]
    assert call_step["output"] == "y"


def test_a_failed_call_is_a_halting_step_with_the_child_trace(tmp_path):
    machine = write_machines(tmp_path, PARENT, FAILING_CHILD)
    result = run_mk(machine, llm={"produce": ["w", "x"], "tokens": [2, 1]})
    assert (result.status, result.error, result.at) == ("halted", "call-failed: gate-fail", "go")
    step = result.trace[-1]
    assert (step["step"], step["policy"], step["to"]) == (2, "call-failed", None)
    assert [(s["state"], s["policy"], s["to"]) for s in step["sub_trace"]] == [("a", "fail", None)]
    assert step["usage"]["input_tokens"] == 2  # what the child spent before it halted
    assert result.usage.tokens == 6


def test_the_parent_total_grows_by_the_child_spend_only_when_it_completes(tmp_path):
    machine = write_machines(tmp_path, PARENT, CHILD)
    seen = []

    class Tops(NullJournal):
        def loop_top(self, chain):
            seen.append((len(chain), chain[0].usage.tokens, chain[-1].usage.tokens))

    result = run(machine, provider=Recorder({"tokens": [3, 2]}), journal=Tops())
    assert result.status == "done"
    # (levels, root total, innermost total) at each loop-top
    assert seen == [(1, 0, 0), (1, 5, 5), (2, 5, 0), (2, 5, 5)]
    assert result.usage.tokens == 15 and result.trace[1]["usage"]["input_tokens"] == 6


def test_call_inputs_overlay_the_child_context_defaults(tmp_path):
    child = """
        machine child
        entry a
        budget 5
        context { topic: "default", keep: "kept" }
        state a {
          structure "s"
          prompt "{{topic}}/{{keep}}"
          output o
          otherwise -> END
        }
    """
    provider = Recorder({"produce": ["from parent"]})
    machine = write_machines(tmp_path, PARENT, child)
    run_mk(machine, provider=provider)
    user = provider.produced[1].user
    assert "from parent" in user and user.endswith("/kept") and "default" not in user


DEEP = """
    machine deep
    entry decide
    budget 5
    hook deeper "x"
    state decide {
      tool calc { expression: "1" }
      output d
      when "go deeper" hook deeper -> dive
      otherwise -> END
    }
    state dive {
      call deep
      output r
      otherwise -> END
    }
"""


@pytest.mark.parametrize("calls, status", [(8, "done"), (9, "halted")])
def test_call_depth_is_capped_at_8(tmp_path, calls, status):
    answers = iter([True] * calls + [False])
    machine = write_machines(tmp_path, DEEP)
    result = run_mk(machine, hooks={"deeper": lambda context, output: next(answers)})
    assert result.status == status
    if status == "halted":
        assert result.error == "call-failed: " * 8 + "call-depth-exceeded"
        assert result.at == "dive"


def test_a_failed_call_in_a_fan_out_branch_keeps_the_child_trace(tmp_path):
    fan = """
        machine parent
        entry each
        budget 5
        context { xs: ["a"] }
        state each {
          over xs
          call child { topic: "{{item}}" }
          output r
          otherwise -> END
        }
    """
    machine = write_machines(tmp_path, fan, FAILING_CHILD)
    result = run_mk(machine, llm={"produce": ["x"], "tokens": [2, 1]})
    assert result.status == "done", result.error
    (branch,) = result.trace[0]["branches"]
    assert branch["output"] == "[branch-error: call-failed: gate-fail]"
    assert [(s["state"], s["policy"], s["to"]) for s in branch["sub_trace"]] == [("a", "fail", None)]
    assert branch["usage"]["input_tokens"] == 2
