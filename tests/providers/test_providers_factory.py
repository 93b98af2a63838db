"""From options and a config file to a provider: each tier routed to its provider and price,
recording and replaying, and what is refused before any call."""

from __future__ import annotations

from typing import Any

import pytest
from support.fakeserver import FakeServer, answer
from support.providers import provider_config, provider_error

from mklang.errors import UsageError
from mklang.host.config import HostConfig, Price, ProviderConfig, Route
from mklang.providers import judge
from mklang.providers.base import Produced, Usage, Verdict
from mklang.providers.cassette import RecordingProvider, ReplayProvider
from mklang.providers.factory import build_routed, make_client, make_provider

# --- routed: tiers, prices, the judge over HTTP -------------------------------------


def _routed(server: FakeServer, kind: str = "openai", *, price: Price | None = None, **options: Any) -> Any:
    config = HostConfig(
        None,
        {"p": provider_config(server, kind, **options)},
        {"fast": Route("p", "m1"), "reasoning": Route("p", "m2")},
        {"p:m1": price} if price else {},
    )
    return build_routed(config)


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_routed_judge_sends_the_judge_prompt_without_reasoning_and_prices_the_call(server, kind, monkeypatch):
    monkeypatch.setattr(judge.secrets, "token_hex", lambda size: "f1x")
    provider = _routed(
        server, kind, price=Price(2.0, 10.0), reasoning="native" if kind == "anthropic" else "scratchpad"
    )
    server.add(answer('{"choice": 2}', input_tokens=1000, output_tokens=100))
    verdict = provider.judge(["is short", "is long"], "the output", "why", {"k": 1}, "fast")
    assert verdict == Verdict(1, Usage(1000, 100, (2000 + 1000) / 1e6), "strict")
    request = server.requests[0]
    assert request.body["model"] == "m1"
    assert "thinking" not in request.body
    assert (request.system, request.user) == judge.build_prompt(["is short", "is long"], "the output", "why", {"k": 1})


def test_a_routed_call_without_a_price_costs_nothing_and_keeps_its_tokens(server):
    provider = _routed(server)
    server.add(answer("<reasoning>r</reasoning>text", input_tokens=9, output_tokens=4))
    assert provider.produce("", "q", "reasoning", True) == Produced("text", "r", Usage(9, 4, 0.0))
    assert server.requests[0].body["model"] == "m2"


def test_closing_a_routed_provider_closes_the_client_of_every_provider(server):
    config = HostConfig(
        None,
        {"p": provider_config(server), "q": provider_config(server, "anthropic")},
        {"fast": Route("p", "m1"), "balanced": Route("p", "m1"), "reasoning": Route("q", "m2")},
        {},
    )
    provider = build_routed(config)
    provider.close()
    for tier in ("fast", "reasoning"):
        with pytest.raises(RuntimeError, match="closed"):
            provider.produce("", "q", tier, False)
    assert server.count == 0


def test_a_tier_with_no_route_names_what_to_do(server):
    provider = _routed(server)
    message = provider_error(provider.produce, "", "q", "balanced", False)
    assert message == "no model for tier 'balanced': pass --model"
    assert server.count == 0


def test_a_blank_judge_answer_is_an_empty_answer_error(server):
    server.add(answer(" \n"))
    message = provider_error(_routed(server).judge, ["c"], "o", None, {}, "fast")
    assert message == "p m1: the model returned an empty answer"


# --- from options and a config file to a provider ------------------------------------


def _config_file(tmp_path: Any, server: FakeServer, body: str = "") -> str:
    path = tmp_path / "mklang.toml"
    path.write_text(
        '[tiers]\nfast = "p:m1"\nreasoning = "q:m2"\n'
        f'[providers.p]\nkind = "openai"\nbase_url = "{server.openai_url}"\nretries = 0\n'
        f'[providers.q]\nkind = "anthropic"\nbase_url = "{server.anthropic_url}"\nretries = 0\n' + body
    )
    return str(path)


def test_recording_and_replaying_at_once_is_refused(tmp_path, server):
    with pytest.raises(UsageError) as caught:
        make_provider(config_path=_config_file(tmp_path, server), record=tmp_path / "a", replay=tmp_path / "b")
    assert str(caught.value) == "--record and --replay cannot be used together"


def test_a_recording_provider_writes_what_the_routed_provider_answers(tmp_path, server):
    cassette_path = tmp_path / "tape.yaml"
    provider = make_provider(config_path=_config_file(tmp_path, server), record=cassette_path)
    assert isinstance(provider, RecordingProvider)
    server.add(answer("from the server"))
    assert provider.produce("", "q", "fast", False).text == "from the server"
    provider.close()
    replayed = make_provider(replay=cassette_path, config_path=tmp_path / "no-such-config.toml")
    assert isinstance(replayed, ReplayProvider)
    assert replayed.produce("", "q", "fast", False).text == "from the server"
    assert server.count == 1


def test_no_tier_routed_names_the_ways_to_configure_one(tmp_path):
    with pytest.raises(UsageError) as caught:
        build_routed(HostConfig(None, {}, {}, {}))
    assert str(caught.value) == (
        "no model configured: pass --provider (openai, anthropic, ollama) and --model, "
        "or map tiers in a config file (see `mklang config`)"
    )


def test_a_dollar_budget_needs_a_price_for_every_routed_tier(tmp_path, server):
    config = _config_file(tmp_path, server, '[prices."p:m1"]\ninput = 1.0\noutput = 2.0\n')
    with pytest.raises(UsageError) as caught:
        make_provider(config_path=config, max_cost=1.0)
    assert str(caught.value) == (
        '--max-cost needs a price for q:m2 (tier reasoning): add [prices."q:m2"] input = ..., output = ... '
        "(USD per million tokens) to the config"
    )


def test_each_tier_goes_to_its_own_provider_with_its_own_price(tmp_path, server):
    prices = '[prices."p:m1"]\ninput = 1.0\noutput = 2.0\n[prices."q:m2"]\ninput = 3.0\noutput = 4.0\n'
    provider = make_provider(config_path=_config_file(tmp_path, server, prices), max_cost=1.0)
    server.add(answer("a", input_tokens=10, output_tokens=1), answer("b", input_tokens=10, output_tokens=1))
    assert provider.produce("", "q", "fast", False).usage == Usage(10, 1, 12 / 1e6)
    assert provider.produce("", "q", "reasoning", False).usage == Usage(10, 1, 34 / 1e6)
    assert [(r.wire, r.body["model"]) for r in server.requests] == [("openai", "m1"), ("anthropic", "m2")]
    path = tmp_path / "mklang.toml"
    assert provider_error(provider.produce, "", "q", "balanced", False) == (
        f"no model for tier 'balanced': add it to [tiers] in {path}"
    )


def test_a_missing_key_of_any_routed_provider_is_refused_before_any_call(tmp_path, server, monkeypatch):
    monkeypatch.delenv("PIN_ABSENT_KEY", raising=False)
    config = HostConfig(
        None,
        {
            "p": provider_config(server),
            "r": ProviderConfig(
                name="r", kind="openai", base_url="https://api.invalid/v1", api_key_env="PIN_ABSENT_KEY"
            ),
        },
        {"fast": Route("p", "m1"), "reasoning": Route("r", "m2")},
        {},
    )
    with pytest.raises(UsageError, match=r"^PIN_ABSENT_KEY is not set: the r provider"):
        build_routed(config)


def test_every_wire_format_has_its_client():
    assert make_client(ProviderConfig(name="a", kind="anthropic", base_url="http://127.0.0.1:1")).path == "/v1/messages"
    assert (
        make_client(ProviderConfig(name="o", kind="openai", base_url="http://127.0.0.1:1")).path == "/chat/completions"
    )
