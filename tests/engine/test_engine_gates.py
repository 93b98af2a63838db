"""Gate selection seen from the provider and the hooks (SPEC section 4, "Gate selection")."""

from __future__ import annotations

import pytest
from conformance.harness import Recorder, mk, run_mk, steps
from support.fakeserver import FakeServer, answer

from mklang.engine.frame import Frame
from mklang.providers.base import Usage, Verdict
from mklang.providers.factory import make_provider

MIXED_GATES = """
    machine mixed
    entry a
    budget 5
    hook h1 "x"
    hook h2 "y"
    state a {
      structure "s"
      prompt "p"
      output o
      when "p1" -> END
      when "p2" -> END
      when "k1" hook h1 -> END
      when "p3" -> END
      when "k2" hook h2 -> END
      when "p4" -> END
      when "p5" -> END
      otherwise -> END
    }
"""


def test_each_run_of_prose_gates_is_one_batch_in_document_order():
    provider = Recorder({"produce": ["out"], "judge": ["none"]})
    asked = []
    hooks = {name: (lambda n: lambda context, output: asked.append(n) or False)(name) for name in ("h1", "h2")}
    result = run_mk(MIXED_GATES, provider=provider, hooks=hooks)
    assert [j.conditions for j in provider.judged] == [["p1", "p2"], ["p3"], ["p4", "p5"]]
    assert asked == ["h1", "h2"]
    assert result.trace[0]["gate"] == "otherwise" and result.trace[0]["judge_none"] == 3


def test_scanning_stops_at_the_first_true_gate():
    provider = Recorder({"judge": ["none"]})
    asked = []
    hooks = {"h1": lambda c, o: asked.append("h1") or True, "h2": lambda c, o: asked.append("h2") or True}
    result = run_mk(MIXED_GATES, provider=provider, hooks=hooks)
    assert result.trace[0]["gate"] == "k1" and result.trace[0]["gate_via"] == "hook"
    assert asked == ["h1"] and len(provider.judged) == 1


def test_a_hook_gets_the_context_with_the_output_and_the_output():
    seen = []
    source = """
        machine hooked
        entry a
        budget 5
        hook check "x"
        state a {
          structure "s"
          prompt "p"
          output answer
          when "checked" hook check -> END
        }
    """
    result = run_mk(
        source,
        {"topic": "t"},
        llm={"produce": ["42"]},
        hooks={"check": lambda context, output: seen.append((dict(context), output)) or 1},
    )
    assert result.status == "done"
    assert seen == [({"topic": "t", "answer": "42"}, "42")]


def test_a_hook_that_raises_halts_with_a_state_error():
    source = """
        machine broken_hook
        entry a
        budget 5
        hook check "x"
        state a {
          structure "s"
          prompt "p"
          output o
          when "checked" hook check -> END
          otherwise -> END
        }
    """

    def check(context, output):
        raise RuntimeError("database down")

    result = run_mk(source, hooks={"check": check})
    assert (result.status, result.at) == ("halted", "a")
    assert result.error.startswith("state-error: hook: ") and "database down" in result.error


class FixedJudge(Recorder):
    """Answers every judge call with one raw verdict, bypassing the scripted checks."""

    def __init__(self, choice):
        super().__init__()
        self.choice = choice

    def judge(self, conditions, output, reasoning, context, tier):
        super().judge(conditions, output, reasoning, context, tier)
        return Verdict(self.choice, Usage(1, 1))


JUDGED = """
    machine judged
    entry a
    budget 5
    state a {
      structure "s"
      prompt "p"
      output o
      when "first" -> a
      when "second" -> a
      otherwise -> b
    }
    state b {
      structure "s"
      prompt "p"
      output o
      otherwise -> END
    }
"""


@pytest.mark.parametrize("choice", [2, 3, -1, 99])
def test_the_engine_never_clamps_an_out_of_range_choice(choice):
    result = run_mk(JUDGED, provider=FixedJudge(choice))
    assert steps(result) == [("a", "ok", "b"), ("b", "ok", "END")]
    assert result.trace[0]["judge_fallback"] is True


def test_a_valid_choice_is_a_zero_based_index_into_the_batch():
    result = run_mk(JUDGED, provider=FixedJudge(1))
    assert result.trace[0]["gate"] == "second"
    assert "judge_fallback" not in result.trace[0]


def test_judge_tokens_are_charged_to_the_step():
    provider = Recorder({"tokens": [10, 2], "judge": ["none"]}, judge_usage=Usage(3, 1))
    result = run_mk(JUDGED, provider=provider)
    assert result.trace[0]["usage"]["input_tokens"] == 13
    assert result.usage.tokens == 12 + 4 + 12


def test_judge_tokens_count_against_the_host_budget():
    source = """
        machine judge_spend
        entry a
        budget 50
        state a {
          structure "s"
          prompt "p"
          output o
          when "again" -> a
        }
    """
    provider = Recorder({"judge": [0]}, judge_usage=Usage(4, 1))
    result = run_mk(source, provider=provider, max_tokens=10)
    assert (result.status, result.error) == ("halted", "cost-exhausted")
    assert len(result.trace) == 2


def test_prose_gates_around_a_spent_repair_gate_form_one_batch():
    source = """
        machine spent_middle
        entry a
        budget 5
        state a {
          structure "s"
          prompt "p"
          output o
          when "p1" -> END
          when "fixable" repair 1 -> a
          when "p2" -> END
          otherwise fail
        }
    """
    provider = Recorder({"judge": [1, 1]})
    result = run_mk(source, provider=provider)
    assert [j.conditions for j in provider.judged] == [["p1", "fixable", "p2"], ["p1", "p2"]]
    assert [s["gate"] for s in result.trace] == ["fixable", "p2"]


# --- spend before a hook fails ------------------------------------------------


@pytest.mark.parametrize("hooks", [{"boom": lambda context, output: 1 / 0}, {}], ids=["raises", "unknown"])
def test_judge_tokens_spent_before_a_failing_hook_are_charged_to_the_halted_run(hooks):
    machine = """
        machine m
        entry a
        budget 3
        hook boom "x"
        state a {
          structure "s"
          prompt "p"
          output o
          when "judged first" -> END
          when "then the hook" hook boom -> END
          otherwise -> END
        }
    """
    provider = Recorder({"produce": ["out"], "judge": ["none"], "tokens": [10, 2]}, judge_usage=Usage(7, 1, 0.5))
    result = run_mk(machine, provider=provider, hooks=hooks)
    assert (result.status, result.at) == ("halted", "a")
    assert result.error.startswith("state-error: hook:")
    assert result.usage == Usage(17, 3, 0.5)


def test_a_reply_to_the_asked_path_or_a_map_above_it_answers_the_question():
    machine = mk("machine m\nentry a\nbudget 1\nstate a {\n  tool t\n  output o\n  otherwise -> END\n}\n")
    for reply, answered in [
        ("approval.answer", True),
        ("approval", True),
        ("approv", False),
        ("approval.answer.x", False),
    ]:
        frame = Frame.start(machine)
        frame.ask = {"ask": "Publish?", "reply_to": "approval.answer"}
        frame.decision_tainted = True
        frame.inject(reply, "yes")
        assert (frame.ask is None) is answered, reply
        assert frame.decision_tainted is not answered, reply  # only the reply to the question confirms
        assert {reply.split(".")[0]} <= frame.external & frame.tainted  # every injected value is outside data


# --- an unreadable judge answer: fallback or halt, with the batches before it --


@pytest.mark.parametrize(
    ("catch_all", "second", "status", "fallback"),
    [
        ("otherwise -> END", '{"choice": 9}', "done", True),
        ("", '{"choice": 9}', "judge-unparseable", None),
        ("", '{"choice": 2}', "no-gate-matched", None),
    ],
)
def test_an_unusable_second_batch_after_a_none_batch_keeps_what_the_batches_cost_and_said(
    tmp_path, catch_all, second, status, fallback
):
    machine = f"""
        machine m
        entry a
        budget 3
        hook never "False."
        state a {{
          structure "s"
          prompt "p"
          output o
          when "first" -> END
          when "second" hook never -> END
          when "third" -> END
          {catch_all}
        }}
    """
    path = tmp_path / "mklang.toml"
    with FakeServer() as server:
        server.add(
            answer("out", input_tokens=10, output_tokens=5),
            answer("2", input_tokens=100, output_tokens=1),
            answer(second, input_tokens=1000, output_tokens=1),
        )
        path.write_text(
            f'[tiers]\ndefault = "p:m"\n[providers.p]\nkind = "openai"\nbase_url = "{server.openai_url}"\nretries = 0\n'
        )
        result = run_mk(machine, provider=make_provider(config_path=str(path)), hooks={"never": lambda c, o: False})
    assert status in (result.status, result.error)
    [step] = result.trace
    none_batches = 1 + (second == '{"choice": 2}')
    assert (step.get("judge_none"), step.get("judge_fallback"), step.get("judge_parse")) == (
        none_batches,
        fallback,
        "strict",
    )
    assert step["usage"] == Usage(1110, 7).to_json()
    assert result.usage == Usage(1110, 7)


def test_a_hook_gate_that_repairs_spends_its_own_repair_budget():
    machine = """
        machine m
        entry a
        budget 9
        hook bad "True when the draft is bad."
        state a {
          structure "s"
          prompt "p"
          output o
          when "the draft is bad" hook bad repair 2 -> a
          otherwise -> END
        }
    """
    result = run_mk(machine, llm={"produce": ["x"]}, hooks={"bad": lambda context, output: True})
    assert result.status == "done", result.error
    assert [(step["policy"], step["gate_via"]) for step in result.trace] == [
        ("repair", "hook"),
        ("repair", "hook"),
        ("ok", "otherwise"),
    ]
