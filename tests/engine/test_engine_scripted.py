"""The scripted provider, tools and hooks of SPEC section 5."""

from __future__ import annotations

import json
import time
from datetime import date
from typing import Any

import pytest
from support.providers import provider_error

from mklang.errors import ProviderError, UsageError
from mklang.providers import scripted
from mklang.providers.base import NONE, UNPARSEABLE, Produced, Usage, Verdict, calling
from mklang.providers.scripted import Answers, ScriptedCallables, ScriptedProvider, ScriptState


def produce(provider: ScriptedProvider, user: str = "prompt") -> str:
    return provider.produce("system", user, "balanced", False).text


def test_a_produce_list_answers_in_order_and_its_last_entry_repeats():
    provider = ScriptedProvider({"produce": ["one", "two"]})
    assert [produce(provider) for _ in range(4)] == ["one", "two", "two", "two"]


def test_a_produce_map_answers_with_the_first_key_found_in_the_user_prompt():
    provider = ScriptedProvider({"produce": {"apple": "A", "apple pie": "P", "pie": "C"}})
    assert produce(provider, "an apple pie") == "A"
    assert produce(provider, "a cherry pie") == "C"


def test_a_produce_map_without_a_match_is_a_provider_error():
    provider = ScriptedProvider({"produce": {"apple": "A"}})
    with pytest.raises(ProviderError):
        produce(provider, "banana")


def test_structured_answers_are_sent_as_json_text():
    provider = ScriptedProvider({"produce": [["a", 1]]})
    assert produce(provider) == '["a", 1]'


def test_tokens_are_charged_per_produce_and_judges_are_free():
    provider = ScriptedProvider({"tokens": [7, 3]})
    usage = provider.produce("s", "u", "fast", False).usage
    assert (usage.input_tokens, usage.output_tokens) == (7, 3)
    assert provider.judge(["c"], "o", None, {}, "fast").usage.tokens == 0


def test_judge_answers_are_indices_none_or_unparseable_and_the_last_repeats():
    provider = ScriptedProvider({"judge": [1, "none", 0]})
    choices = [provider.judge(["a", "b"], "o", None, {}, "fast").choice for _ in range(4)]
    assert choices == [1, NONE, 0, 0]


def test_judge_unparseable_answers_every_call():
    provider = ScriptedProvider({"judge": "unparseable"})
    assert {provider.judge(["a"], "o", None, {}, "fast").choice for _ in range(3)} == {UNPARSEABLE}


def test_reasoning_is_returned_only_when_asked_for():
    provider = ScriptedProvider({"produce": [{"text": "t", "reasoning": "r"}]})
    assert provider.produce("s", "u", "fast", True).reasoning == "r"
    assert provider.produce("s", "u", "fast", False).reasoning is None


def test_an_answer_naming_no_reasoning_reasons_like_the_1x_scripted_model():
    provider = ScriptedProvider({"produce": ["plain", {"text": "mapped"}, {"text": "none", "reasoning": None}]})
    assert [provider.produce("s", "u", "fast", True).reasoning for _ in range(3)] == ["thought", "thought", None]
    assert provider.produce("s", "u", "fast", False).reasoning is None


def test_delay_ms_delays_every_produce_and_judge():
    provider = ScriptedProvider({"delay_ms": 30})
    started = time.perf_counter()
    produce(provider)
    provider.judge(["c"], "o", None, {}, "fast")
    assert time.perf_counter() - started >= 0.06


def test_scripted_hooks_answer_in_order_and_repeat():
    hooks = ScriptedCallables("hook", {"ok": [True, False]}).functions()
    assert [hooks["ok"]({}, "out") for _ in range(3)] == [True, False, False]


def test_scripted_tools_answer_by_a_substring_of_their_input():
    tools = ScriptedCallables("tool", {"kb": {"refund": "R", "login": "L"}}).functions()
    assert tools["kb"]({"query": "login loop"}) == "L"
    with pytest.raises(ProviderError):
        tools["kb"]({"query": "weather"})


def test_the_sources_of_one_scripted_host_share_one_state_and_each_keeps_its_place():
    state = ScriptState()
    provider = ScriptedProvider({"produce": ["a", "b", "c"], "judge": [0, 1]}, state)
    hooks = ScriptedCallables("hook", {"ok": [True, False]}, state).functions()
    assert provider.produce("s", "u", "fast", False).text == "a"
    assert hooks["ok"]({}, "out") is True
    assert provider.judge(["x", "y"], "o", None, {}, "fast").choice == 0
    assert state.save() == {"llm": {"produce": 1, "judge": 1}, "tools": {}, "hooks": {"ok": 1}}


def test_one_scripted_provider_running_two_fan_outs_of_the_same_step_answers_each_run_afresh():
    """The key a host sees names the run: the second run's branches are not the first run's."""
    from mklang.engine import run
    from mklang.syntax import parse

    machine = parse(
        'machine m\nentry a\nbudget 5\n\nstate a {\n  sample 2\n  structure "s"\n  prompt "p"\n'
        "  output xs\n  otherwise -> END\n}\n",
        "m.mk",
    )
    provider = ScriptedProvider({"produce": ["a0", "a1", "a2", "a3"]})
    assert [run(machine, {}, provider=provider).context["xs"] for _ in range(2)] == [["a0", "a1"], ["a2", "a3"]]


# --- one source of answers: lists, maps and fan-out branches ---------------------


def _answers(spec: Any, what: str = "produce") -> tuple[Answers, ScriptState]:
    state = ScriptState()
    return Answers(what, spec, state, ("llm", "produce")), state


def _ask(answers: Answers, key: str | None) -> Any:
    """An answer to the call whose idempotency key is `key` (None: a call outside any run)."""
    if key is None:
        return answers.next("")
    with calling(key):
        return answers.next("")


def test_a_scripted_list_answers_in_order_and_its_last_answer_repeats():
    answers, state = _answers(["a", "b"])
    assert [answers.next("") for _ in range(4)] == ["a", "b", "b", "b"]
    assert state.save() == {"llm": {"produce": 4}, "tools": {}, "hooks": {}}


@pytest.mark.parametrize("single", ["a", 3, True, False, None])
def test_a_single_scripted_answer_is_a_list_of_one(single):
    answers, _ = _answers(single)
    assert [answers.next(""), answers.next("")] == [single, single]


@pytest.mark.parametrize("spec", [1.5, ("a",), {"a"}])
def test_a_script_that_is_neither_a_list_nor_a_map_is_refused(spec):
    with pytest.raises(UsageError) as caught:
        _answers(spec, "tool t")
    assert str(caught.value) == "scripted tool t: expected a list or a map"


def test_an_empty_scripted_list_fails_the_call():
    message = provider_error(_answers([], "judge")[0].next, "")
    assert message == "scripted judge: the script lists no answers"


def test_a_scripted_map_answers_with_the_first_key_found_in_the_request():
    answers, state = _answers({"apple": "fruit", "pie": "dish", 7: "seven"})
    assert answers.next("apple pie") == "fruit"
    assert answers.next("a pie") == "dish"
    assert answers.next("room 17") == "seven"
    assert state.save()["llm"] == {"produce": 0}


def test_a_request_no_scripted_key_matches_is_quoted_with_its_nonces_hidden_and_cut_to_80():
    answers, _ = _answers({"zzz": "never"})
    request = "<data-0a1b>x</data-0a1b> <data-cafe> " + "w" * 100
    shown = ("<data-NONCE>x</data-NONCE> <data-NONCE> " + "w" * 100)[:80]
    assert (
        provider_error(answers.next, request) == f"scripted produce: no scripted answer matches the request {shown!r}"
    )


def test_fan_out_branches_take_the_answers_at_their_index_whatever_order_they_call_in():
    answers, state = _answers(["x", "b0", "b1", "b2", "b0 again", "b1 again", "b2 again", "after"])
    assert _ask(answers, "r:1.0.1") == "x"
    taken = {}
    for index, step in ((2, 1), (0, 1), (1, 1), (0, 2), (2, 2)):  # each branch runs a sub-machine
        taken.setdefault(index, []).append(_ask(answers, f"r:2.{index + 1}of3/:{step}.0.1"))
    assert taken == {0: ["b0", "b0 again"], 1: ["b1"], 2: ["b2", "b2 again"]}
    assert state.save()["llm"] == {"produce": 7}  # past the furthest answer taken
    assert _ask(answers, "r:3.0.1") == "after"


def test_a_fan_out_nested_in_a_branch_answers_by_its_own_branches():
    answers, _ = _answers([f"a{i}" for i in range(6)])
    assert _ask(answers, "r:1.1of2/:1.2of2.1") == "a1"
    assert _ask(answers, "r:1.1of2/:1.1of2.1") == "a0"


def test_a_second_fan_out_starts_where_the_first_left_off():
    answers, state = _answers([f"a{i}" for i in range(6)])
    for key in ("r:1.1of2.1", "r:1.2of2.1", "r:2.2of2.1", "r:2.1of2.1"):
        _ask(answers, key)
    assert state.save()["llm"] == {"produce": 4}
    assert _ask(answers, "r:3.2of2.1") == "a5"


def test_a_branch_call_made_again_gets_the_answer_it_had_until_a_call_outside_every_fan_out():
    """After a crash a call whose answer was never journaled is made again under the same key."""
    answers, _ = _answers(["b0", "b1", "b0 again", "next", "last"])
    assert [_ask(answers, "r:1.1of2/:1.0.1"), _ask(answers, "r:1.1of2/:1.0.1")] == ["b0", "b0"]
    assert _ask(answers, "r:1.1of2/:2.0.1") == "b0 again"
    assert _ask(answers, "r:2.0.1") == "next"
    assert _ask(answers, "r:1.1of2/:1.0.1") == "last"  # the fan-out is over: a new call


def test_a_saved_state_continues_the_fan_out_in_flight_in_another_host():
    """A fan-out cut by a budget resumes in a new process with the answers that follow."""
    spec = [f"a{i}" for i in range(9)]
    answers, state = _answers(spec)
    _ask(answers, "r:1.0.1")
    _ask(answers, "r:2.1of3/:1.0.1")
    _ask(answers, "r:2.2of3/:1.0.1")
    saved = json.loads(json.dumps(state.save()))
    assert saved["fan_outs"] == {
        "llm": {"produce": {"starts": {"r:2": 1}, "taken": {"r:2.1of3/:1.0.1": 1, "r:2.2of3/:1.0.1": 2}}}
    }
    again, resumed = _answers(spec)
    resumed.restore(saved)
    assert [_ask(again, "r:2.3of3/:1.0.1"), _ask(again, "r:2.1of3/:2.0.1")] == ["a3", "a4"]
    assert _ask(again, "r:3.0.1") == "a5"
    assert "fan_outs" not in resumed.save()


# --- the provider --------------------------------------------------------


def test_a_scripted_provider_without_a_script_answers_empty_text_and_the_first_condition():
    provider = ScriptedProvider()
    assert provider.produce("s", "u", "fast", True) == Produced("", "thought", Usage())
    assert provider.judge(["a", "b"], "o", None, {}, "fast") == Verdict(0, Usage())
    assert provider.calls == {"produce": 1, "judge": 1}


def test_scripted_tokens_are_charged_to_every_produce_but_not_to_a_judge():
    provider = ScriptedProvider({"produce": ["a"], "tokens": [3, 4]})
    assert provider.produce("", "", "fast", False).usage == Usage(3, 4)
    assert provider.produce("", "", "fast", False).usage == Usage(3, 4)
    assert provider.judge(["c"], "o", None, {}, "fast").usage == Usage()


@pytest.mark.parametrize("tokens", [[1], [1, 2, 3], [1, "2"], ["1", 2], (1, 2), 5, [1.0, 2]])
def test_scripted_tokens_must_be_two_integers(tokens):
    with pytest.raises(UsageError) as caught:
        ScriptedProvider({"tokens": tokens})
    assert str(caught.value) == "scripted llm.tokens: expected [input, output] integers"


def test_unknown_scripted_llm_keys_are_named_sorted():
    with pytest.raises(UsageError) as caught:
        ScriptedProvider({"produce": ["a"], "zeta": 1, "alpha": 2})
    assert str(caught.value) == "scripted llm: unknown keys ['alpha', 'zeta']"


def test_the_scripted_llm_section_given_is_left_as_it_was():
    llm = {"produce": ["a"], "judge": [1], "tokens": [1, 1], "delay_ms": 0}
    ScriptedProvider(llm)
    assert llm == {"produce": ["a"], "judge": [1], "tokens": [1, 1], "delay_ms": 0}


def test_a_scripted_delay_is_slept_before_each_answer(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(scripted.time, "sleep", slept.append)
    provider = ScriptedProvider({"delay_ms": 250})
    provider.produce("", "", "fast", False)
    provider.judge(["c"], "o", None, {}, "fast")
    assert slept == [0.25, 0.25]
    ScriptedProvider().produce("", "", "fast", False)
    assert slept == [0.25, 0.25]


def test_a_scripted_produce_keeps_its_reasoning_only_when_reasoning_is_asked_for():
    provider = ScriptedProvider({"produce": [{"text": "42", "reasoning": "because"}]})
    assert provider.produce("", "", "fast", True) == Produced("42", "because", Usage())
    assert provider.produce("", "", "fast", False) == Produced("42", None, Usage())


def test_a_scripted_structured_answer_is_sent_as_json_text():
    provider = ScriptedProvider({"produce": [{"a": [1, "é"]}, {"text": {"k": 1}}, 5]})
    assert provider.produce("", "", "fast", False) == Produced('{"a": [1, "\\u00e9"]}', None, Usage())
    assert provider.produce("", "", "fast", True).text == '{"k": 1}'
    assert provider.produce("", "", "fast", True).text == "5"


def test_a_scripted_produce_map_is_matched_against_the_user_message():
    provider = ScriptedProvider({"produce": {"topic": "on topic", "system": "wrong"}})
    assert provider.produce("system", "the topic", "fast", False).text == "on topic"


@pytest.mark.parametrize(
    ("answer", "choice"),
    [
        (0, 0),
        (2, 2),
        (3, UNPARSEABLE),
        (-1, UNPARSEABLE),
        (True, UNPARSEABLE),
        ("1", UNPARSEABLE),
        ("none", NONE),
        ("unparseable", UNPARSEABLE),
    ],
)
def test_a_scripted_judge_answer_outside_the_batch_is_unparseable_never_clamped(answer, choice):
    provider = ScriptedProvider({"judge": [answer]})
    assert provider.judge(["a", "b", "c"], "o", None, {}, "fast") == Verdict(choice, Usage())


def test_a_scripted_judge_map_is_matched_against_the_conditions():
    provider = ScriptedProvider({"judge": {"is long\nis short": 1, "is long": 0}})
    assert provider.judge(["is long", "is short"], "o", None, {}, "fast").choice == 1
    assert provider.judge(["is long"], "o", None, {}, "fast").choice == 0


def test_a_scripted_provider_names_the_source_a_call_found_no_answer_in():
    provider = ScriptedProvider({"produce": [], "judge": {"never": 0}})
    assert provider_error(provider.produce, "", "q", "fast", False) == "scripted produce: the script lists no answers"
    assert provider_error(provider.judge, ["c"], "o", None, {}, "fast") == (
        "scripted judge: no scripted answer matches the request 'c'"
    )


def test_a_scripted_provider_restores_and_reports_each_source_apart():
    state = ScriptState()
    provider = ScriptedProvider({"produce": ["a", "b", "c"], "judge": [0, 1, 0]}, state)
    state.restore({"llm": {"produce": 1, "judge": 2}})
    assert provider.produce("", "", "fast", False).text == "b"
    assert provider.calls == {"produce": 1, "judge": 0}
    state.restore({"llm": {"produce": "2"}})  # as a checkpoint's `position` may hold it
    assert state.save()["llm"] == {"produce": 2, "judge": 0}
    assert provider.produce("", "", "fast", False).text == "c"
    state.restore({"llm": {"judge": 1}})
    assert state.save()["llm"] == {"produce": 0, "judge": 1}
    assert provider.judge(["x", "y"], "o", None, {}, "fast").choice == 1


# --- hooks and tools ----------------------------------------------------


@pytest.mark.parametrize("kind", ["hook", "tool"])
def test_scripted_hooks_or_tools_must_be_a_map(kind):
    with pytest.raises(UsageError) as caught:
        ScriptedCallables(kind, ["a"])
    assert str(caught.value) == f"scripted {kind}s: expected a map of name to answers"


def test_no_scripted_callables_is_no_functions():
    assert ScriptedCallables("tool", None).functions() == {}


def test_a_scripted_tool_is_matched_against_its_input_as_json():
    state = ScriptState()
    tools = ScriptedCallables(
        "tool", {"lookup": {'"city": "Zürich"': "cold", "x": "other"}, "echo": ["e1", "e2"]}, state
    )
    functions = tools.functions()
    assert sorted(functions) == ["echo", "lookup"]
    assert functions["lookup"]({"city": "Zürich"}) == "cold"
    assert functions["echo"]({}) == "e1"
    assert state.save()["tools"] == {"lookup": 0, "echo": 1}
    message = provider_error(functions["lookup"], {"town": 1})
    assert message == "scripted tool lookup: no scripted answer matches the request '{\"town\": 1}'"


def test_a_scripted_tool_input_that_is_not_json_is_matched_as_text():
    tools = ScriptedCallables("tool", {"t": {"2026-01-02": "dated"}})
    assert tools.functions()["t"]({"when": date(2026, 1, 2)}) == "dated"


def test_a_scripted_hook_is_matched_against_the_output_not_the_context():
    hooks = ScriptedCallables("hook", {"ok": {"good": True, "ctx": False}})
    assert hooks.functions()["ok"]({"ctx": 1}, "good output") is True


def test_scripted_callables_restore_by_name():
    state = ScriptState()
    tools = ScriptedCallables("tool", {"a": ["a0", "a1", "a2"], "b": ["b0", "b1"]}, state)
    state.restore({"tools": {"a": 1, "b": "1", "gone": 5}, "hooks": {"a": 2}})
    assert state.save() == {"llm": {}, "tools": {"a": 1, "b": 1}, "hooks": {}}
    functions = tools.functions()
    assert (functions["a"]({}), functions["b"]({})) == ("a1", "b1")
