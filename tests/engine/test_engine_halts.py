"""How runs halt: the error, the `at` state, the recorded step (SPEC sections 4 "Halts" and 6)."""

from __future__ import annotations

import pytest
from conformance.harness import Recorder, mk, run_mk

from mklang.engine.frame import Frame
from mklang.errors import ProviderError

TWO_STATES = """
    machine two
    entry a
    budget 5
    state a {{
      structure "s"
      prompt "p"
      output first
      otherwise -> b
    }}
    state b {{
      structure "s"
      prompt "q"
      output second
      {gates}
    }}
"""


@pytest.mark.parametrize(
    "gates, judge, error, policy",
    [
        ("otherwise fail", [0], "gate-fail", "fail"),
        ('when "good" -> END', ["none"], "no-gate-matched", "no-gate-matched"),
        ('when "good" -> END', ["unparseable"], "judge-unparseable", "judge-unparseable"),
    ],
)
def test_a_halting_gate_step_is_recorded_with_to_null(gates, judge, error, policy):
    result = run_mk(TWO_STATES.format(gates=gates), llm={"produce": ["one", "two"], "judge": judge, "tokens": [1, 1]})
    assert (result.status, result.error, result.at, result.result) == ("halted", error, "b", None)
    last = result.trace[-1]
    assert (last["step"], last["state"], last["policy"], last["to"], last["output"]) == (2, "b", policy, None, "two")
    assert last["usage"]["input_tokens"] == 1
    # The halting state's output is deposited; the context is returned.
    assert result.context == {"first": "one", "second": "two"}


class Failing(Recorder):
    """Raises a ProviderError on the produce of state `b`, or on every judge call."""

    def __init__(self, kind: str, llm=None):
        super().__init__(llm)
        self.kind = kind

    def produce(self, system, user, tier, reason):
        if self.kind == "produce" and user == "q":
            raise ProviderError("HTTP 500 from the model server")
        return super().produce(system, user, tier, reason)

    def judge(self, conditions, output, reasoning, context, tier):
        if self.kind == "judge":
            raise ProviderError("HTTP 500 from the model server")
        return super().judge(conditions, output, reasoning, context, tier)


@pytest.mark.parametrize("kind", ["produce", "judge"])
def test_a_provider_failure_halts_provider_error_at_the_state(kind):
    result = run_mk(TWO_STATES.format(gates='when "good" -> END'), provider=Failing(kind))
    assert result.status == "halted"
    assert result.error == "provider-error: HTTP 500 from the model server"
    assert result.at == "b"
    assert [s["state"] for s in result.trace] == ["a"]


def test_a_provider_failure_still_counts_what_the_state_paid_before_it():
    result = run_mk(TWO_STATES.format(gates='when "good" -> END'), provider=Failing("judge", {"tokens": [3, 2]}))
    assert (result.status, result.at) == ("halted", "b")
    assert result.usage.tokens == 10  # both produce calls were paid for, b's before its judge failed


def test_a_tool_exception_halts_with_a_state_error():
    source = """
        machine tool_boom
        entry t
        budget 5
        state t {
          tool risky { q: "x" }
          output obs
          otherwise -> END
        }
    """

    def risky(args):
        raise ValueError("index out of date")

    result = run_mk(source, tools={"risky": risky})
    assert (result.status, result.at) == ("halted", "t")
    assert result.error.startswith("state-error: tool") and "index out of date" in result.error


def test_a_halt_keeps_the_usage_spent_so_far():
    result = run_mk(TWO_STATES.format(gates="otherwise fail"), llm={"tokens": [4, 1]})
    assert result.usage.input_tokens == 8 and result.usage.output_tokens == 2


def test_loop_ceiling_does_not_run_the_state():
    provider = Recorder()
    source = """
        machine ceiling
        entry a
        budget 10
        state a {
          structure "s"
          prompt "p"
          output o
          max_visits 2
          otherwise -> a
        }
    """
    result = run_mk(source, provider=provider)
    assert (result.error, result.at) == ("loop-ceiling", "a")
    assert len(provider.produced) == 2 and len(result.trace) == 2


def test_an_exhausted_token_budget_halts_before_the_first_call():
    provider = Recorder()
    result = run_mk(TWO_STATES.format(gates="otherwise -> END"), provider=provider, max_tokens=0)
    assert (result.status, result.error, result.at) == ("halted", "cost-exhausted", "a")
    assert provider.produced == [] and result.trace == []


def test_a_spent_token_budget_suspends_when_suspendable():
    result = run_mk(
        TWO_STATES.format(gates="otherwise -> END"), llm={"tokens": [5, 5]}, max_tokens=10, suspendable=True
    )
    assert (result.status, result.error, result.at) == ("suspended", "cost-exhausted", "b")


@pytest.mark.parametrize(
    "second, extra, error",
    [
        ("parse list\n      otherwise -> END", {}, "state-error: parse-list"),
        ('when "x" -> END\n      when "y" hook missing -> END', {"judge": ["none"]}, "state-error: hook: unknown hook"),
    ],
)
def test_a_state_error_still_counts_what_the_state_paid_for(second, extra, error):
    source = TWO_STATES.replace("{gates}", "").replace('prompt "q"', 'prompt "q"\n      ' + second)
    result = run_mk(
        source.replace("{{", "{").replace("}}", "}"), llm={"produce": ["one", "not json"], "tokens": [3, 2], **extra}
    )
    assert result.status == "halted" and result.error.startswith(error)
    assert len(result.trace) == 1  # a state-error records no step...
    assert result.usage.tokens == 10  # ...but both produce calls were paid for


@pytest.mark.parametrize(("answer", "kind"), [('{"a": 1}', "dict"), ('"text"', "str"), ("3", "int")])
def test_a_parse_list_answer_that_is_json_but_no_array_names_what_it_got(answer, kind):
    source = TWO_STATES.format(gates="otherwise -> END").replace('prompt "q"', 'prompt "q"\n      parse list')
    result = run_mk(source, llm={"produce": ["one", answer]})
    assert (result.status, result.at) == ("halted", "b")
    assert result.error == f"state-error: parse-list: expected a JSON array, got {kind}"


def test_the_engine_stop_signal_reads_as_its_reason():
    from mklang.engine.signals import Stop

    frame = Frame.start(mk("machine m\nentry a\nbudget 1\nstate a {\n  tool t\n  output o\n  otherwise -> END\n}\n"))
    assert [
        str(signal)
        for signal in (
            Stop("halted", "gate-fail", "a"),
            Stop("suspended", "escalated", "a", [frame]),
            Stop("stopped", "cost-exhausted", "a"),
            Stop("interrupted", "interrupted", "a"),
        )
    ] == ["gate-fail", "escalated", "cost-exhausted", "interrupted"]
