"""The scripted provider, tools and hooks of SPEC section 5."""

from __future__ import annotations

import time

import pytest

from mklang.errors import ProviderError
from mklang.providers.base import NONE, UNPARSEABLE
from mklang.providers.scripted import ScriptedCallables, ScriptedProvider, ScriptState


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
