"""The OpenAI-compatible and Anthropic clients against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from email.utils import formatdate
from pathlib import Path
from typing import Any

import pytest
from support.fakeserver import FakeServer, answer, error, raw, refusal

from mklang.errors import ProviderError, UsageError
from mklang.host.config import ProviderConfig, load_config
from mklang.providers import http
from mklang.providers.base import NONE, UNPARSEABLE, Usage
from mklang.providers.factory import make_provider
from mklang.providers.http import HttpTransport, retry_after

KEY = "sk-test-SECRET-0123456789"


def write_config(tmp_path, server, kind="openai", *, prices=True, tiers=None, **options) -> str:
    """A config with one provider `p` of `kind` pointing at the fake server, fast retries."""
    base_url = server.openai_url if kind == "openai" else server.anthropic_url
    settings = {"backoff": 0.001, "max_backoff": 0.01, "retries": 2, "timeout": 2, **options}
    lines = ["[tiers]"]
    for tier, route in (tiers or {"default": "p:m1"}).items():
        lines.append(f'{tier} = "{route}"')
    lines += ["[providers.p]", f'kind = "{kind}"', f'base_url = "{base_url}"', 'api_key_env = "FAKE_KEY"']
    for key, value in settings.items():
        lines.append(f"{key} = {value!r}" if not isinstance(value, str) else f'{key} = "{value}"')
    if prices:
        lines += ['[prices."p:m1"]', "input = 2.5", "output = 10.0"]
    path = tmp_path / "mklang.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(params=["openai", "anthropic"])
def kind(request):
    return request.param


@pytest.fixture
def provider(tmp_path, server, kind, monkeypatch):
    monkeypatch.setenv("FAKE_KEY", KEY)
    return make_provider(config_path=write_config(tmp_path, server, kind))


def test_produce_sends_system_and_user_and_returns_exact_usage_and_cost(provider, server, kind):
    server.add(answer("the answer", input_tokens=1234, output_tokens=56))
    produced = provider.produce("be brief", "what is it?", "balanced", False)
    assert produced.text == "the answer"
    assert produced.reasoning is None
    assert produced.usage == Usage(1234, 56, (1234 * 2.5 + 56 * 10.0) / 1_000_000)
    request = server.requests[0]
    assert request.wire == kind
    assert (request.system, request.user) == ("be brief", "what is it?")
    assert request.body["model"] == "m1"
    if kind == "openai":
        assert request.headers["authorization"] == f"Bearer {KEY}"
    else:
        assert request.headers["x-api-key"] == KEY
        assert request.headers["anthropic-version"]
        assert request.body["max_tokens"] == 4096


def test_no_key_sends_no_auth_header(tmp_path, server, kind, monkeypatch):
    monkeypatch.delenv("FAKE_KEY", raising=False)
    provider = make_provider(config_path=write_config(tmp_path, server, kind))
    server.add(answer("ok"))
    assert provider.produce("", "hi", "fast", False).text == "ok"
    headers = server.requests[0].headers
    assert "authorization" not in headers and "x-api-key" not in headers


def test_extra_params_are_sent_but_never_override_the_request(tmp_path, server, kind, monkeypatch):
    config = write_config(tmp_path, server, kind)
    with open(config, "a") as handle:
        handle.write('[providers.p.params]\ntemperature = 0\nmodel = "ignored"\n')
    provider = make_provider(config_path=config)
    server.add(answer("ok"))
    provider.produce("", "hi", "fast", False)
    assert server.requests[0].body["temperature"] == 0
    assert server.requests[0].body["model"] == "m1"


def test_429_with_retry_after_then_success(provider, server):
    server.add(error(429, "slow down", retry_after="0"), answer("done", input_tokens=3, output_tokens=4))
    produced = provider.produce("", "hi", "balanced", False)
    assert produced.text == "done"
    assert (produced.usage.input_tokens, produced.usage.output_tokens) == (3, 4)
    assert server.count == 2


def test_500s_until_retries_run_out(provider, server, kind):
    server.fallback = error(500, "upstream exploded")
    with pytest.raises(ProviderError) as caught:
        provider.produce("", "hi", "balanced", False)
    assert str(caught.value) == "p 500: upstream exploded (after 3 attempts)"
    assert server.count == 3


def test_client_errors_are_not_retried(provider, server):
    server.add(error(400, "bad model name"))
    with pytest.raises(ProviderError, match=r"^p 400: bad model name$"):
        provider.produce("", "hi", "balanced", False)
    assert server.count == 1


def test_401_without_key_names_the_variable(tmp_path, server, kind, monkeypatch):
    monkeypatch.delenv("FAKE_KEY", raising=False)
    provider = make_provider(config_path=write_config(tmp_path, server, kind))
    server.add(error(401, "missing credentials"))
    with pytest.raises(ProviderError, match=r"^p 401: missing credentials \(FAKE_KEY is not set\)$"):
        provider.produce("", "hi", "balanced", False)


def test_timeout_is_retried_then_reported(tmp_path, server, kind):
    provider = make_provider(config_path=write_config(tmp_path, server, kind, timeout=0.2, retries=1))
    server.add(answer("late", delay=1.0), answer("late", delay=1.0))
    started = time.monotonic()
    with pytest.raises(ProviderError, match=r"^p timeout: no answer within 0.2s \(after 2 attempts\)$"):
        provider.produce("", "hi", "balanced", False)
    assert time.monotonic() - started < 1.5
    assert server.count == 2


def test_timeout_then_success(tmp_path, server, kind):
    provider = make_provider(config_path=write_config(tmp_path, server, kind, timeout=0.2))
    server.add(answer("late", delay=1.0), answer("on time"))
    assert provider.produce("", "hi", "balanced", False).text == "on time"


def test_connection_refused_is_a_provider_error(tmp_path, server, kind):
    config = write_config(tmp_path, server, kind, retries=1)
    server.stop()
    provider = make_provider(config_path=config)
    with pytest.raises(ProviderError, match=r"^p connection-error: .* \(after 2 attempts\)$"):
        provider.produce("", "hi", "balanced", False)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("{not json", "p 200: response is not JSON: {not json"),
        ("[1, 2]", "p 200: response is not a JSON object"),
        ('{"unexpected": true}', None),
    ],
)
def test_malformed_bodies(provider, server, body, message):
    server.add(raw(body))
    with pytest.raises(ProviderError) as caught:
        provider.produce("", "hi", "balanced", False)
    if message:
        assert str(caught.value) == message
    else:
        assert str(caught.value).startswith("p m1: unexpected response shape: no ")
    assert server.count == 1


def test_refusal_is_an_error_not_an_answer(provider, server, kind):
    server.add(refusal("I won't do that."))
    with pytest.raises(ProviderError, match=r"^p m1: the model refused"):
        provider.produce("", "hi", "balanced", False)


def test_openai_content_filter_is_a_refusal(tmp_path, server):
    provider = make_provider(config_path=write_config(tmp_path, server, "openai"))
    server.add(answer("", finish_reason="content_filter"))
    with pytest.raises(ProviderError, match="content filter"):
        provider.produce("", "hi", "balanced", False)


@pytest.mark.parametrize("text", ["", "   \n"])
def test_empty_answer_is_an_error(provider, server, text):
    server.add(answer(text))
    with pytest.raises(ProviderError, match=r"^p m1: the model returned an empty answer$"):
        provider.produce("", "hi", "balanced", False)


def test_native_reasoning_is_split_from_the_answer(provider, server, kind):
    server.add(answer("42", reasoning="six times seven", input_tokens=5, output_tokens=9))
    produced = provider.produce("sys", "compute", "reasoning", True)
    assert (produced.text, produced.reasoning) == ("42", "six times seven")
    body = server.requests[0].body
    if kind == "anthropic":
        assert body["thinking"] == {"type": "enabled", "budget_tokens": 2048}
        assert body["max_tokens"] == 4096 + 2048
        assert body["system"] == "sys"
    else:
        assert "<reasoning>" in server.requests[0].system


def test_reasoning_is_dropped_when_not_asked_for(provider, server):
    server.add(answer("42", reasoning="six times seven"))
    assert provider.produce("", "compute", "fast", False).reasoning is None
    assert "thinking" not in server.requests[0].body


def test_scratchpad_reasoning_is_split_from_the_answer(tmp_path, server, kind):
    provider = make_provider(config_path=write_config(tmp_path, server, kind, reasoning="scratchpad"))
    server.add(answer("<reasoning>\nsix times seven\n</reasoning>\n42"))
    produced = provider.produce("sys", "compute", "reasoning", True)
    assert (produced.text, produced.reasoning) == ("42", "six times seven")
    request = server.requests[0]
    assert request.system.startswith("sys\n\n") and "</reasoning>" in request.system
    assert "thinking" not in request.body


def test_scratchpad_with_nothing_after_the_reasoning_is_empty(tmp_path, server):
    provider = make_provider(config_path=write_config(tmp_path, server, "openai"))
    server.add(answer("<reasoning>I thought a lot</reasoning>"))
    with pytest.raises(ProviderError, match="empty answer"):
        provider.produce("", "compute", "reasoning", True)


@pytest.mark.parametrize(
    ("reply", "choice", "parsed_by"),
    [
        ('{"choice": 2}', 1, "strict"),
        (" 1 ", 0, "bare"),
        ("Condition 1 fails; the answer is 3", NONE, "last"),
        ('```json\n{"choice": 1}\n```', 0, "last"),
        ("7", UNPARSEABLE, "bare"),
        ("I cannot decide.", UNPARSEABLE, None),
    ],
)
def test_judge_reply_in_each_parse_path(provider, server, reply, choice, parsed_by):
    server.add(answer(reply, input_tokens=11, output_tokens=2))
    verdict = provider.judge(["is short", "is polite"], "hello", None, {"k": 1}, "fast")
    assert (verdict.choice, verdict.parsed_by) == (choice, parsed_by)
    assert verdict.usage.tokens == 13
    request = server.requests[0]
    assert "1. is short\n2. is polite\n3. none of the above" in request.user
    assert "never instructions" in request.system


def test_judge_refusal_and_empty_answer_are_errors(provider, server):
    server.add(refusal(), answer(""))
    for _ in range(2):
        with pytest.raises(ProviderError):
            provider.judge(["x"], "out", None, {}, "fast")


def test_tiers_route_to_their_own_provider_and_model(tmp_path, server, monkeypatch):
    config = tmp_path / "c.toml"
    config.write_text(
        f"""
[tiers]
fast = "oa:small"
reasoning = "an:big"
[providers.oa]
kind = "openai"
base_url = "{server.openai_url}"
[providers.an]
kind = "anthropic"
base_url = "{server.anthropic_url}"
[providers.an.prices]
big = {{ input = 3.0, output = 15.0 }}
"""
    )
    provider = make_provider(config_path=config)
    server.add(answer("a", input_tokens=100, output_tokens=10), answer("b", input_tokens=1000, output_tokens=100))
    assert provider.produce("", "one", "fast", False).usage == Usage(100, 10, 0.0)
    assert provider.produce("", "two", "reasoning", False).usage == Usage(1000, 100, (3000 + 1500) / 1e6)
    assert [(r.wire, r.body["model"]) for r in server.requests] == [("openai", "small"), ("anthropic", "big")]
    with pytest.raises(ProviderError, match=r"no model for tier 'balanced': add it to \[tiers\] in .*c.toml"):
        provider.produce("", "three", "balanced", False)


def test_max_cost_without_a_price_fails_before_any_call(tmp_path, server):
    config = write_config(tmp_path, server, prices=False)
    with pytest.raises(UsageError, match=r'--max-cost needs a price for p:m1 .*\[prices."p:m1"\]'):
        make_provider(config_path=config, max_cost=1.0)
    assert server.count == 0
    make_provider(config_path=config)  # without a dollar budget no price is needed


def test_max_in_flight_bounds_concurrent_requests(tmp_path, server):
    provider = make_provider(config_path=write_config(tmp_path, server, max_in_flight=2))
    active = peak = 0
    lock = threading.Lock()

    def slow(request):
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.05)
        with lock:
            active -= 1
        return answer("ok")

    server.handler = slow
    threads = [threading.Thread(target=provider.produce, args=("", f"q{i}", "fast", False)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert server.count == 6
    assert peak == 2


def test_retry_after_is_honoured_in_seconds_and_as_a_date(server):
    slept: list[float] = []
    config = ProviderConfig(name="p", kind="openai", base_url=server.openai_url, retries=2, max_backoff=30)
    transport = HttpTransport(config, {}, sleep=slept.append)
    later = formatdate(time.time() + 20, usegmt=True)
    server.add(error(429, retry_after="7"), error(503, retry_after=later), answer("ok"))
    transport.post("/chat/completions", {"model": "m"})
    assert slept[0] == 7.0
    assert 15 < slept[1] <= 20


def test_backoff_is_exponential_with_jitter_and_capped(server):
    slept: list[float] = []
    config = ProviderConfig(name="p", kind="openai", base_url=server.openai_url, retries=4, backoff=1, max_backoff=3)
    transport = HttpTransport(config, {}, sleep=slept.append)
    server.fallback = error(502)
    with pytest.raises(ProviderError):
        transport.post("/chat/completions", {})
    assert len(slept) == 4
    for delay, ceiling in zip(slept, [1, 2, 3, 3], strict=False):
        assert ceiling / 2 <= delay <= ceiling


@pytest.mark.parametrize(("value", "seconds"), [("3", 3.0), ("0.5", 0.5), ("-4", 0.0), ("soon", None), (None, None)])
def test_retry_after_values(value, seconds):
    assert retry_after(value) == seconds


def test_builtin_providers_honour_the_environment(server, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("OPENAI_BASE_URL", server.openai_url)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.anthropic_url)
    monkeypatch.delenv("MKLANG_CONFIG", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    server.add(answer("from openai"), answer("from anthropic"))
    for name in ("openai", "anthropic"):
        config = load_config(provider=name, model="local-model")
        assert config.provider(name).api_key() == KEY
        make_provider(provider=name, model="local-model", config_path=None).produce("", "hi", "fast", False)
    assert [r.wire for r in server.requests] == ["openai", "anthropic"]
    assert all(r.body["model"] == "local-model" for r in server.requests)


@pytest.mark.parametrize(("status", "key", "hint"), [(403, None, True), (401, KEY, False), (400, None, False)])
def test_only_a_refused_key_that_is_not_set_is_named(tmp_path, server, kind, monkeypatch, status, key, hint):
    if key is None:
        monkeypatch.delenv("FAKE_KEY", raising=False)
    else:
        monkeypatch.setenv("FAKE_KEY", key)
    provider = make_provider(config_path=write_config(tmp_path, server, kind))
    server.add(error(status, "no"))
    with pytest.raises(ProviderError) as caught:
        provider.produce("", "hi", "balanced", False)
    assert str(caught.value) == f"p {status}: no" + (" (FAKE_KEY is not set)" if hint else "")


def test_a_refusal_that_quotes_the_key_is_reported_without_it(tmp_path, server, monkeypatch):
    monkeypatch.setenv("FAKE_KEY", KEY)
    provider = make_provider(config_path=write_config(tmp_path, server, "openai"))
    server.add(refusal(f"I won't use {KEY}."))
    with pytest.raises(ProviderError) as caught:
        provider.produce("", "hi", "balanced", False)
    assert str(caught.value) == "p m1: the model refused: I won't use ***."


def test_providers_name_their_routes_and_close_each_client_once(tmp_path, server, monkeypatch):
    monkeypatch.setenv("FAKE_KEY", KEY)
    provider = make_provider(
        config_path=write_config(tmp_path, server, "openai", tiers={"fast": "p:m1", "reasoning": "p:m2"})
    )
    assert repr(provider) == "RoutedProvider(fast=p:m1, reasoning=p:m2)"
    closed = []
    for target in provider._targets.values():
        assert repr(target.client) == "OpenAIClient('p')"
        monkeypatch.setattr(target.client, "close", lambda client=target.client: closed.append(client))
    provider.close()
    assert len(closed) == 1  # both tiers share one client


def test_the_http_client_loads_without_httpxs_command_line_client():
    """httpx's own command line (click, rich, pygments) costs start-up time and is never used."""
    probe = (
        "import sys, mklang.providers.http as http, httpx; "
        "print(sorted(m for m in sys.modules if m == 'httpx._main' or m.split('.')[0] in ('rich', 'pygments'))); "
        "print(callable(httpx.main), http.httpx is httpx, 'httpx._main' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == ["[]", "True True False"]


# --- retries: the Retry-After cap and the backoff jitter ---------------------


def _transport(server: FakeServer, slept: list[float], **options: Any) -> HttpTransport:
    config = ProviderConfig(name="p", kind="openai", base_url=server.openai_url, **options)
    return HttpTransport(config, {}, sleep=slept.append)


def test_retry_after_is_capped_at_max_backoff_and_never_jittered(monkeypatch):
    monkeypatch.setattr(http.random, "uniform", lambda low, high: low)
    slept: list[float] = []
    with FakeServer() as server:
        server.add(error(429, retry_after="100"), error(503, retry_after="2"), answer("ok"))
        _transport(server, slept, retries=2, backoff=1, max_backoff=3).post("/chat/completions", {})
    assert slept == [3.0, 2.0]


@pytest.mark.parametrize(("draw", "expected"), [(0.5, [0.5, 1.0, 1.5, 1.5]), (1.0, [1.0, 2.0, 3.0, 3.0])])
def test_backoff_doubles_to_its_cap_and_is_scaled_by_a_jitter_between_half_and_whole(monkeypatch, draw, expected):
    bounds: list[tuple[float, float]] = []

    def uniform(low: float, high: float) -> float:
        bounds.append((low, high))
        return draw

    monkeypatch.setattr(http.random, "uniform", uniform)
    slept: list[float] = []
    with FakeServer() as server:
        server.fallback = error(502)
        with pytest.raises(Exception, match="after 5 attempts"):
            _transport(server, slept, retries=4, backoff=1, max_backoff=3).post("/chat/completions", {})
    assert slept == expected
    assert bounds == [(0.5, 1.0)] * 4


# --- Anthropic prompt caching: cache tokens are input tokens ----------------


def _anthropic_config(tmp_path: Path, server: FakeServer) -> str:
    path = tmp_path / "mklang.toml"
    path.write_text(
        textwrap.dedent(f"""
            [tiers]
            default = "p:m1"
            [providers.p]
            kind = "anthropic"
            base_url = "{server.anthropic_url}"
            retries = 0
            [prices."p:m1"]
            input = 2.5
            output = 10.0
        """)
    )
    return str(path)


def _anthropic_body(text: str, usage: dict[str, int]) -> str:
    return json.dumps(
        {
            "id": "msg",
            "type": "message",
            "role": "assistant",
            "model": "m1",
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn",
            "usage": usage,
        }
    )


def test_anthropic_cache_creation_and_cache_read_tokens_count_and_cost_as_input(tmp_path):
    usage = {
        "input_tokens": 11,
        "cache_creation_input_tokens": 200,
        "cache_read_input_tokens": 3000,
        "output_tokens": 7,
    }
    with FakeServer() as server:
        server.add(raw(_anthropic_body("hello", usage)), raw(_anthropic_body('{"choice": 1}', usage)))
        provider = make_provider(config_path=_anthropic_config(tmp_path, server))
        produced = provider.produce("", "hi", "fast", False)
        verdict = provider.judge(["holds"], "hello", None, {}, "fast")
    expected = Usage(3211, 7, (3211 * 2.5 + 7 * 10.0) / 1_000_000)
    assert produced.usage == expected
    assert verdict.usage == expected
