"""Call states: sub-runs, their traces, depth and spend (SPEC sections 4 "Call", 5 and 6)."""

from __future__ import annotations

from typing import Any

import pytest
from conformance.harness import Recorder, run_mk, write_machines
from support.journals import KeepsNothing
from support.runs import CHILD

from mklang.engine import run
from mklang.engine.frame import Frame
from mklang.providers.base import Produced, Usage

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
    machine = write_machines(tmp_path, PARENT, CHILD.format(budget=5))
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


# A caller whose one state calls `child`.
CALLER = """
    machine parent
    entry go
    budget 5
    state go {
      call child
      output r
      otherwise -> END
    }
"""


def refuse(context, output):
    """A hook that fails."""
    raise ValueError("no")


HOOK = 'hook ok "True when fine."'
HOOKED = 'structure "s"\n prompt "a"\n output o\n when "fine" hook ok -> END\n otherwise -> END'

# What a called machine declares, its one state, the hooks the host has, and how the state errs.
ERRING_CHILDREN = {
    "unknown hook": (HOOK, HOOKED, {}, "state-error: hook: unknown hook 'ok'"),
    "hook raises": (HOOK, HOOKED, {"ok": refuse}, "state-error: hook: ok: no"),
    "unknown tool": (
        'tool t "Look it up."',
        "tool t\n output o\n otherwise -> END",
        {},
        "state-error: tool: unknown tool 't'",
    ),
    "over a text": (
        "",
        'over items\n structure "s"\n prompt "{{item}}"\n output o\n otherwise -> END',
        {},
        "state-error: over: 'items' is",
    ),
    "missing machine": ("", "call nowhere\n output o\n otherwise -> END", {}, "state-error: call: "),
}


@pytest.mark.parametrize("declared, body, hooks, error", ERRING_CHILDREN.values(), ids=list(ERRING_CHILDREN))
def test_a_state_error_in_a_called_machine_fails_the_call_of_its_caller(tmp_path, declared, body, hooks, error):
    child = f'machine child\nentry a\nbudget 3\ncontext {{ items: "text" }}\n{declared}\nstate a {{\n {body}\n}}\n'
    result = run_mk(write_machines(tmp_path, CALLER, child), llm={"produce": ["x"], "judge": [0]}, hooks=hooks)
    assert (result.status, result.at) == ("halted", "go")
    assert result.error.startswith(f"call-failed: {error}"), result.error
    assert result.trace[-1]["policy"] == "call-failed"


def test_the_parent_total_grows_by_the_child_spend_only_when_it_completes(tmp_path):
    machine = write_machines(tmp_path, PARENT, CHILD.format(budget=5))
    seen = []

    class Tops(KeepsNothing):
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


# --- tool and call states at their edges -------------------------------------------

TOOL_MACHINE = """
    machine m
    entry a
    budget 5
    tool lookup "finds"
    state a {
      tool lookup { q: "x" }
      output found
      otherwise -> END
    }
"""


def test_a_tool_gets_its_arguments_and_an_idempotency_key_and_a_map_it_returns_is_json_text():
    seen = []

    def lookup(arguments: dict[str, Any], idempotency_key: str) -> Any:
        seen.append((arguments, idempotency_key))
        return {"hits": [1, 2]}

    journal = KeyJournal()
    result = run_mk(TOOL_MACHINE, tools={"lookup": lookup}, journal=journal)
    assert result.status == "done", result.error
    [(arguments, key)] = seen
    assert arguments == {"q": "x"}
    run_id, _, call = key.partition("/")
    assert (bool(run_id), call) == (True, "r:1.0.1")
    assert journal.keys == [("tool", "r:1.0.1")]
    assert result.context["found"] == '{"hits": [1, 2]}'


def test_an_answer_nested_too_deep_for_its_parse_halts_the_state():
    result = run_mk(
        """
        machine m
        entry a
        budget 5
        state a {
          structure "s"
          prompt "p"
          parse json
          output o
          otherwise -> END
        }
        """,
        llm={"produce": ["[" * 200 + "]" * 200]},
    )
    assert result.status == "halted"
    assert result.error.startswith("state-error: parse-json: the answer is nested more than")


CALLING = """
    machine parent
    entry go
    budget 5
    context { xs: ["a"] }
    state go {
      call child
      output r
      otherwise -> each
    }
    state each {
      over xs
      call child
      output rs
      otherwise -> END
    }
"""


def test_a_called_machine_is_journaled_one_level_down_except_inside_a_branch(tmp_path):
    class EnterJournal(KeepsNothing):
        def __init__(self) -> None:
            self.entered: list[tuple[int, str]] = []

        def enter(self, depth: int, frame: Frame) -> None:
            self.entered.append((depth, frame.machine.name))

    journal = EnterJournal()
    result = run_mk(write_machines(tmp_path, CALLING, CHILD.format(budget=5)), journal=journal)
    assert result.status == "done", result.error
    assert journal.entered == [(1, "child")]  # the call in the fan-out branch is not


def test_a_called_machine_that_runs_out_of_steps_suspends_a_suspendable_run(tmp_path):
    machine = write_machines(tmp_path, CALLING, CHILD.format(budget=1))
    result = run_mk(machine, suspendable=True)
    assert (result.status, result.reason, result.at) == ("suspended", "budget-exhausted", "b")
    assert [frame.machine.name for frame in result.frames] == ["parent", "child"]


def test_scripted_answers_go_to_branches_by_index_whatever_order_they_ask_in(tmp_path):
    import time as clock

    def wait(arguments: dict[str, Any]) -> str:
        clock.sleep(float(arguments["s"]))
        return "waited"

    machine = write_machines(
        tmp_path,
        """
        machine parent
        entry each
        budget 9
        context { xs: ["0.3", "0"] }
        state each {
          over xs
          call child { d: "{{item}}" }
          output o
          otherwise -> END
        }
        """,
        """
        machine child
        entry t
        budget 5
        tool wait "sleeps"
        state t {
          tool wait { s: "{{d}}" }
          output w
          otherwise -> p
        }
        state p {
          structure "s"
          prompt "p"
          output o
          otherwise -> END
        }
        """,
    )
    result = run_mk(machine, tools={"wait": wait}, llm={"produce": ["first", "second"]})
    assert result.result == ["first", "second"]  # branch 0 asked last


class KeyJournal(KeepsNothing):
    """Keeps the idempotency key of every call a run makes."""

    def __init__(self) -> None:
        self.keys: list[tuple[str, str]] = []

    def record(self, key: str, kind: str, value: Any) -> None:
        self.keys.append((kind, key))


def test_every_call_of_a_run_has_its_own_stable_idempotency_key():
    machine = """
        machine m
        entry a
        budget 5
        hook never "False."
        state a {
          structure "s"
          prompt "p"
          output o
          when "first" -> END
          when "second" hook never -> END
          when "third" -> END
          otherwise -> b
        }
        state b {
          structure "s"
          prompt "p"
          output o
          when "done" -> END
          otherwise -> END
        }
    """
    journal = KeyJournal()
    run_mk(machine, llm={"judge": ["none"]}, hooks={"never": lambda c, o: False}, journal=journal)
    assert journal.keys == [
        ("produce", "r:1.0.1"),
        ("judge", "r:1.g.1"),
        ("judge", "r:1.g.2"),
        ("produce", "r:2.0.1"),
        ("judge", "r:2.g.1"),
    ]


def test_each_branch_of_a_fan_out_keys_its_calls_by_its_number():
    class FoldJournal(KeyJournal):
        def __init__(self) -> None:
            super().__init__()
            self.folded: list[str] = []

        def fold(self, prefix: str) -> None:
            self.folded.append(prefix)

    journal = FoldJournal()
    result = run_mk(
        """
        machine m
        entry each
        budget 5
        context { xs: ["a", "b", "c"] }
        state each {
          over xs
          structure "s"
          prompt "{{item}}"
          output o
          otherwise -> END
        }
        """,
        journal=journal,
    )
    assert result.status == "done", result.error
    assert sorted(journal.keys) == [("produce", "r:1.1of3.1"), ("produce", "r:1.2of3.1"), ("produce", "r:1.3of3.1")]
    assert sorted(journal.folded) == ["r:1.1of3", "r:1.2of3", "r:1.3of3"]  # each finished branch's answers fold into it


def test_an_interrupt_inside_a_called_machine_ends_the_whole_run_with_every_levels_spend(tmp_path):
    from mklang.engine.runtime import Control

    control = Control()

    class InterruptInTheChild(Recorder):
        def produce(self, system, user, tier, reason):
            if user == "a":  # the child's first state
                control.interrupted.set()
            return Produced("x", None, Usage(1, 1, 0.25))

    machine = write_machines(tmp_path, PARENT, CHILD.format(budget=5))
    result = run_mk(machine, provider=InterruptInTheChild(), control=control)
    assert (result.status, result.error, result.at) == ("halted", "interrupted", "b")
    assert result.usage == Usage(2, 2, 0.5)


def test_the_calls_of_a_called_machine_are_keyed_under_the_call(tmp_path):
    machine = write_machines(
        tmp_path,
        CALLER,
        """
        machine child
        entry a
        budget 5
        state a {
          structure "s"
          prompt "p"
          output o
          otherwise -> END
        }
        """,
    )
    journal = KeyJournal()
    assert run_mk(machine, journal=journal).status == "done"
    assert journal.keys == [("produce", "r:1.0/:1.0.1")]


def test_a_dotted_input_writes_inside_the_map_and_keeps_its_siblings():
    machine = """
        machine m
        entry a
        budget 3
        context { ticket: { body: "", id: "T-1" }, flat: 1 }
        state a {
          structure "s"
          prompt "{{ticket.body}} {{ticket.id}} {{new.deep.key}} {{flat}}"
          output o
          otherwise -> END
        }
    """
    provider = Recorder({"produce": ["x"]})
    result = run_mk(machine, {"ticket.body": "hello", "new.deep.key": 5, "flat": 2}, provider=provider)
    assert result.context["ticket"] == {"body": "hello", "id": "T-1"}
    assert result.context["new"] == {"deep": {"key": 5}}
    assert "ticket.body" not in result.context
    assert provider.produced[0].user.startswith("<data-")  # host inputs are tainted


# --- deposits: accumulate onto what is already there -------------------------


@pytest.mark.parametrize(
    ("initial", "expected"),
    [
        ('notes: "first"', ["first", "second"]),
        ("notes: 0", [0, "second"]),
        ("notes: null", ["second"]),
        ('notes: ["first"]', ["first", "second"]),
        ("other: 1", ["second"]),
    ],
)
def test_accumulate_turns_an_existing_scalar_into_the_head_of_a_list(initial, expected):
    machine = f"""
        machine m
        entry a
        budget 3
        context {{ {initial} }}
        state a {{
          structure "s"
          prompt "p"
          output notes
          accumulate
          when "judged" -> END
          otherwise -> END
        }}
    """
    provider = Recorder({"produce": ["second"], "judge": [0]})
    result = run_mk(machine, provider=provider)
    assert result.context["notes"] == expected
    assert provider.judged[0].context["notes"] == expected  # the judge sees the deposit once, as it will be
