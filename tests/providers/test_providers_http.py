"""The HTTP transport and the OpenAI-compatible and Anthropic clients against a real HTTP server on 127.0.0.1:
what is retried and how long it waits, the deadline, the errors reported with the key scrubbed,
the requests each wire format sends and how it reads the answer."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import threading
import time
from email.utils import formatdate
from pathlib import Path
from typing import Any

import pytest
from support.fakeserver import FakeServer, InFlight, answer, error, raw, refusal
from support.providers import http_transport, provider_config, provider_error

from mklang.errors import ProviderError, UsageError
from mklang.host.config import ProviderConfig, load_config
from mklang.providers import http, scratchpad
from mklang.providers.anthropic import AnthropicClient
from mklang.providers.base import NONE, UNPARSEABLE, Usage, deadline
from mklang.providers.factory import make_provider
from mklang.providers.http import HttpTransport, redact, retry_after, token_counts
from mklang.providers.openai import OpenAIClient

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
    server.handler = held = InFlight(lambda request: answer("ok"))
    threads = [threading.Thread(target=provider.produce, args=("", f"q{i}", "fast", False)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert server.count == 6
    assert held.peak == 2


def test_retry_after_is_honoured_in_seconds_and_as_a_date(server):
    slept: list[float] = []
    transport = http_transport(server, slept, retries=2, max_backoff=30)
    later = formatdate(time.time() + 20, usegmt=True)
    server.add(error(429, retry_after="7"), error(503, retry_after=later), answer("ok"))
    transport.post("/chat/completions", {"model": "m"})
    assert slept[0] == 7.0
    assert 15 < slept[1] <= 20


def test_backoff_is_exponential_with_jitter_and_capped(server):
    slept: list[float] = []
    transport = http_transport(server, slept, retries=4, backoff=1, max_backoff=3)
    server.fallback = error(502)
    with pytest.raises(ProviderError):
        transport.post("/chat/completions", {})
    assert len(slept) == 4
    for delay, ceiling in zip(slept, [1, 2, 3, 3], strict=False):
        assert ceiling / 2 <= delay <= ceiling


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


def test_the_http_client_is_urllib3_and_imports_no_other_http_library():
    """httpx and httpcore (and httpx's command line: click, rich, pygments) cost start-up time and CPU a call
    with many calls in flight (ADR 0053); the transport is urllib3."""
    probe = (
        "import sys, mklang.providers.http; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'httpx', 'httpcore', 'urllib3', 'requests'}))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == ["['urllib3']"]


# --- retries: the Retry-After cap and the backoff jitter ---------------------


def test_retry_after_is_capped_at_max_backoff_and_never_jittered(monkeypatch):
    monkeypatch.setattr(http.random, "uniform", lambda low, high: low)
    slept: list[float] = []
    with FakeServer() as server:
        server.add(error(429, retry_after="100"), error(503, retry_after="2"), answer("ok"))
        http_transport(server, slept, retries=2, backoff=1, max_backoff=3).post("/chat/completions", {})
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
            http_transport(server, slept, retries=4, backoff=1, max_backoff=3).post("/chat/completions", {})
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


def test_anthropic_cache_creation_and_cache_read_tokens_count_and_cost_as_input(tmp_path):
    usage = {
        "input_tokens": 11,
        "cache_creation_input_tokens": 200,
        "cache_read_input_tokens": 3000,
        "output_tokens": 7,
    }
    with FakeServer() as server:
        server.add(
            raw(_anthropic_body([{"type": "text", "text": "hello"}], usage=usage)),
            raw(_anthropic_body([{"type": "text", "text": '{"choice": 1}'}], usage=usage)),
        )
        provider = make_provider(config_path=_anthropic_config(tmp_path, server))
        produced = provider.produce("", "hi", "fast", False)
        verdict = provider.judge(["holds"], "hello", None, {}, "fast")
    expected = Usage(3211, 7, (3211 * 2.5 + 7 * 10.0) / 1_000_000)
    assert produced.usage == expected
    assert verdict.usage == expected


# --- http: which statuses are retried, and the message after the last attempt ----


@pytest.mark.parametrize("status", [408, 429, 500, 599])
def test_timeouts_throttling_and_every_5xx_are_retried(server, status):
    server.add(error(status, "try later"), answer("ok"))
    data = http_transport(server, retries=1).post("/chat/completions", {})
    assert data["choices"][0]["message"]["content"] == "ok"
    assert server.count == 2


@pytest.mark.parametrize("status", [400, 404, 409, 422, 499])
def test_other_client_errors_fail_at_once(server, status):
    server.add(error(status, "no such thing"), answer("ok"))
    message = provider_error(http_transport(server, retries=3).post, "/chat/completions", {})
    assert message == f"p {status}: no such thing"
    assert server.count == 1


def test_a_single_attempt_is_reported_in_the_singular(server):
    server.fallback = error(503, "down")
    assert (
        provider_error(http_transport(server, retries=0).post, "/chat/completions", {})
        == "p 503: down (after 1 attempt)"
    )
    assert server.count == 1


def test_the_failure_of_the_last_attempt_is_the_one_reported(server):
    server.add(error(500, "first"), error(502, "second"))
    message = provider_error(http_transport(server, retries=1).post, "/chat/completions", {})
    assert message == "p 502: second (after 2 attempts)"


def test_a_refused_connection_names_the_error_and_the_attempts(server):
    config = provider_config(server, retries=1)
    server.stop()
    slept: list[float] = []
    transport = HttpTransport(config, {}, sleep=slept.append)
    message = provider_error(transport.post, "/chat/completions", {})
    assert re.fullmatch(r"p connection-error: \[Errno \d+\] Connection refused \(after 2 attempts\)", message), message
    assert len(slept) == 1


def test_a_success_after_a_retry_sleeps_once_between_the_attempts(server):
    slept: list[float] = []
    server.add(error(500), error(500), answer("ok"))
    http_transport(server, slept, retries=5, backoff=1, max_backoff=1).post("/chat/completions", {})
    assert len(slept) == 2 and all(0.5 <= delay <= 1.0 for delay in slept)


# --- http: the server's reason, shortened and scrubbed -----------------------


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"error": {"message": "quota exceeded", "type": "x"}}', "quota exceeded"),
        ('{"error": "plain text error"}', "plain text error"),
        ('{"error": {"message": ""}}', "Bad Request"),
        ('{"error": {"type": "no message"}}', "Bad Request"),
        ('{"error": 42}', "Bad Request"),
        ('{"detail": "elsewhere"}', "Bad Request"),
        ('["a", "list"]', "Bad Request"),
        ("<html>oops</html>", "Bad Request"),
    ],
)
def test_an_error_reason_is_the_servers_message_else_the_http_reason_phrase(server, body, reason):
    server.add(raw(body, status=400))
    assert provider_error(http_transport(server).post, "/chat/completions", {}) == f"p 400: {reason}"


def test_a_status_without_a_reason_phrase_anywhere_is_an_unknown_status(server):
    server.add(raw("<html>oops</html>", status=499))  # no phrase on its status line, none in HTTP's list
    assert provider_error(http_transport(server).post, "/chat/completions", {}) == "p 499: unknown status"


def test_malformed_token_counts_are_each_named_with_what_the_server_sent():
    counts, problem = token_counts(
        {"a": -1, "b": "12", "c": 3}, {"input": ("a", "c"), "output": ("b",), "cached": ("d",)}
    )
    assert counts == {"input": None, "output": None, "cached": 0}
    assert problem == 'the server\'s usage is malformed (a: -1, b: "12")'


def test_a_long_reason_is_cut_to_200_characters_and_its_whitespace_collapsed(server):
    exact = "x" * 200
    long = "y" * 201
    server.add(error(400, exact), error(400, long), error(400, "  many\n\tspaced   words \n"))
    transport = http_transport(server)
    assert provider_error(transport.post, "/chat/completions", {}) == f"p 400: {exact}"
    assert provider_error(transport.post, "/chat/completions", {}) == f"p 400: {'y' * 197}..."
    assert provider_error(transport.post, "/chat/completions", {}) == "p 400: many spaced words"


def test_a_body_that_is_not_json_is_quoted_shortened_and_scrubbed(server):
    server.add(raw(f"not json at all, {KEY} " + "z" * 300))
    transport = HttpTransport(provider_config(server), {}, secret=KEY)
    message = provider_error(transport.post, "/chat/completions", {})
    assert KEY not in message
    assert message == "p 200: response is not JSON: " + f"not json at all, *** {'z' * 300}"[:197] + "..."


def test_an_error_reason_quoting_the_key_is_scrubbed(server):
    server.add(error(400, f"bad key {KEY}!"))
    transport = HttpTransport(provider_config(server), {}, secret=KEY)
    assert provider_error(transport.post, "/chat/completions", {}) == "p 400: bad key ***!"


@pytest.mark.parametrize(("status", "hint"), [(401, True), (403, True), (400, False), (404, False), (500, False)])
def test_a_refusal_of_the_credentials_names_the_unset_key_variable(server, status, hint):
    server.add(error(status, "no"))
    transport = HttpTransport(provider_config(server, api_key_env="PIN_KEY"), {}, secret=None)
    expected = f"p {status}: no" + (" (PIN_KEY is not set)" if hint else " (after 1 attempt)" * (status == 500))
    assert provider_error(transport.post, "/chat/completions", {}) == expected


def test_no_key_variable_configured_means_no_hint(server):
    server.add(error(401, "no"))
    assert provider_error(http_transport(server).post, "/chat/completions", {}) == "p 401: no"


# --- http: the run's deadline -------------------------------------------------


def test_a_deadline_already_passed_sends_no_request(server):
    with deadline(time.monotonic() - 1):
        message = provider_error(http_transport(server).post, "/chat/completions", {})
    assert message == "p timeout: the --max-time deadline passed before the request"
    assert server.count == 0


def test_a_deadline_reached_exactly_sends_no_request(server, monkeypatch):
    monkeypatch.setattr(http, "seconds_left", lambda: 0.0)
    message = provider_error(http_transport(server).post, "/chat/completions", {})
    assert message == "p timeout: the --max-time deadline passed before the request"
    assert server.count == 0


def test_a_retry_that_would_outlast_the_deadline_is_not_waited_for(server):
    slept: list[float] = []
    server.add(error(503, "busy", retry_after="20"), answer("ok"))
    transport = http_transport(server, slept, retries=3, max_backoff=30)
    with deadline(time.monotonic() + 10):
        message = provider_error(transport.post, "/chat/completions", {})
    assert message == "p 503: busy (no time left for a retry before the --max-time deadline)"
    assert slept == [] and server.count == 1


def test_a_retry_within_the_deadline_is_waited_for(server):
    slept: list[float] = []
    server.add(error(503, "busy", retry_after="2"), answer("ok"))
    transport = http_transport(server, slept, retries=3, max_backoff=30)
    with deadline(time.monotonic() + 10):
        transport.post("/chat/completions", {})
    assert slept == [2.0] and server.count == 2


def test_a_retry_that_would_start_exactly_at_the_deadline_is_not_waited_for(server, monkeypatch):
    monkeypatch.setattr(http, "seconds_left", lambda: 2.0)
    slept: list[float] = []
    server.add(error(503, "busy", retry_after="2"), answer("ok"))
    message = provider_error(http_transport(server, slept, retries=1, max_backoff=30).post, "/chat/completions", {})
    assert message == "p 503: busy (no time left for a retry before the --max-time deadline)"
    assert slept == []


def test_the_read_timeout_is_shortened_to_the_time_left(server):
    server.add(answer("late", delay=2), answer("late", delay=2))
    transport = http_transport(server, timeout=30, retries=1)
    started = time.monotonic()
    with deadline(started + 0.3):
        message = provider_error(transport.post, "/chat/completions", {})
    found = re.fullmatch(
        r"p timeout: no answer within (0\.\d+)s \(no time left for a retry before the --max-time deadline\)", message
    )
    assert found, message
    assert 0 < float(found.group(1)) <= 0.3  # what was left of the 0.3 s when the request went out
    assert time.monotonic() - started < 1.5


# --- http: Retry-After ----------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("3", 3.0),
        ("0.5", 0.5),
        ("-4", 0.0),
        ("soon", None),
        (None, None),
        ("", None),
        ("  4  ", 4.0),
        ("0", 0.0),
        ("not a date", None),
        ("Mon, 99 Foo 2020 00:00:00 GMT", None),
    ],
)
def test_retry_after_reads_seconds_and_ignores_what_it_cannot_read(value, seconds):
    assert retry_after(value) == seconds


def test_a_retry_after_date_in_the_past_means_no_wait():
    assert retry_after(formatdate(time.time() - 3600, usegmt=True)) == 0.0


def test_a_retry_after_date_is_counted_from_now():
    assert 95 < retry_after(formatdate(time.time() + 100, usegmt=True)) <= 100


# --- http: the key scrubbed in every form a message may quote it ---------------


# Keys are printable ASCII without spaces or a leading quote (`ProviderConfig.api_key` refuses the rest).
@pytest.mark.parametrize(
    ("secret", "echoed"),
    [
        ("sk-a/b+c", "sk-a/b+c"),
        ("sk-a/b+c", "sk-a/b%2Bc"),  # URL-encoded in a path
        ("sk-a/b+c", "sk-a%2Fb%2Bc"),  # URL-encoded in a query
        ('sk-a"b', 'sk-a\\"b'),  # JSON
        ("sk-a\\b", "sk-a\\\\b"),  # JSON or repr
        ("sk-'a\"b", "sk-\\'a\"b"),  # repr
        ("sk-'a\"b", "sk-'a\\\"b"),  # JSON
    ],
)
def test_a_secret_is_scrubbed_in_each_encoding_an_error_may_echo(secret, echoed):
    assert redact(f"<{echoed}>", secret) == "<***>"


def test_a_key_echoed_with_its_backslashes_doubled_is_scrubbed_whole_not_from_the_inside():
    secret = "\\sk-abc"  # the key is also a substring of its repr, so the longer form must go first
    assert redact("key '\\\\sk-abc' refused", secret) == "key '***' refused"


def test_text_that_only_shares_part_of_the_key_is_left_whole(server):
    secret = "sk-abcdef"
    text = "null: sk-abcdeX, xk-abcdef, k-abcde, %6B"
    assert redact(text, secret) == text
    server.add(error(400, text))
    transport = HttpTransport(provider_config(server), {}, secret=secret)
    assert provider_error(transport.post, "/chat/completions", {}) == f"p 400: {text}"


def test_without_a_secret_nothing_is_scrubbed():
    assert redact("sk-visible", None) == "sk-visible"
    assert redact("sk-visible", "") == "sk-visible"


# --- http: the transport's own plumbing ----------------------------------------


def test_a_transport_names_its_provider_and_url(server):
    transport = http_transport(server)
    assert repr(transport) == f"HttpTransport('p', '{server.openai_url}')"


def test_a_base_url_with_a_trailing_slash_reaches_the_same_path(server):
    config = ProviderConfig(name="p", kind="openai", base_url=server.openai_url + "/", retries=0)
    server.add(answer("ok"))
    HttpTransport(config, {"X-Pin": "yes"}).post("/chat/completions", {"a": 1})
    request = server.requests[0]
    assert (request.path, request.body, request.headers["x-pin"]) == ("/v1/chat/completions", {"a": 1}, "yes")


def test_a_closed_transport_sends_nothing_more(server):
    transport = http_transport(server)
    transport.close()
    with pytest.raises(RuntimeError):
        transport.post("/chat/completions", {})
    assert server.count == 0


def test_jitter_keeps_a_delay_between_half_and_all_of_its_ceiling(server, monkeypatch):
    monkeypatch.setattr(http.random, "uniform", lambda low, high: (low, high)[1])
    slept: list[float] = []
    server.add(error(500), error(500), answer("ok"))
    http_transport(server, slept, retries=2, backoff=0.25, max_backoff=10).post("/chat/completions", {})
    assert slept == [0.25, 0.5]


# --- openai: the request it sends and how it reads the answer -------------------


@pytest.fixture
def keyed(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("PIN_KEY", KEY)
    return "PIN_KEY"


def _openai_body(message: Any, *, finish: str | None = "stop", usage: Any = None) -> str:
    body: dict[str, Any] = {"choices": [{"index": 0, "message": message, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return json.dumps(body)


def test_openai_sends_the_key_as_a_bearer_token_and_the_messages_in_order(server, keyed):
    client = OpenAIClient(provider_config(server, api_key_env=keyed, params={"temperature": 0.5, "model": "x"}))
    server.add(answer("hi", input_tokens=7, output_tokens=3))
    reply = client.chat("m1", "be brief", "hello?", reason=False)
    assert reply == http.Reply("hi", None, 7, 3)
    request = server.requests[0]
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert request.body == {
        "temperature": 0.5,
        "model": "m1",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello?"}],
    }
    assert repr(client) == "OpenAIClient('p')"


def test_a_client_waits_between_retries_with_the_sleep_it_is_given(server):
    slept: list[float] = []
    client = OpenAIClient(provider_config(server, retries=1, backoff=1, max_backoff=1), sleep=slept.append)
    server.add(error(503), answer("ok"))
    assert client.chat("m1", "", "q", reason=False).text == "ok"
    assert len(slept) == 1 and 0.5 <= slept[0] <= 1


def test_openai_sends_no_system_message_when_there_is_none(server):
    server.add(answer("hi"))
    OpenAIClient(provider_config(server)).chat("m1", "", "hello?", reason=False)
    assert server.requests[0].body["messages"] == [{"role": "user", "content": "hello?"}]
    assert "authorization" not in server.requests[0].headers


def test_openai_asks_for_a_scratchpad_only_when_reasoning_is_wanted(server):
    client = OpenAIClient(provider_config(server))
    server.add(answer("<reasoning>because</reasoning> yes"), answer("<reasoning>because</reasoning> yes"))
    assert client.chat("m1", "", "q", reason=True) == http.Reply("yes", "because", 10, 5)
    assert server.requests[0].body["messages"][0] == {"role": "system", "content": scratchpad.INSTRUCTION}
    assert client.chat("m1", "", "q", reason=False) == http.Reply("<reasoning>because</reasoning> yes", None, 10, 5)
    assert [m["role"] for m in server.requests[1].body["messages"]] == ["user"]


def test_openai_with_native_reasoning_asks_for_no_scratchpad_but_still_lifts_think_blocks(server):
    client = OpenAIClient(provider_config(server, reasoning="native"))
    server.add(answer("<think>hmm</think>42"))
    assert client.chat("m1", "sys", "q", reason=True) == http.Reply("42", "hmm", 10, 5)
    assert server.requests[0].body["messages"][0] == {"role": "system", "content": "sys"}


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_openai_reads_the_servers_own_reasoning_field_before_tagged_reasoning(server, field):
    message = {"role": "assistant", "content": "<think>tagged</think>42", field: "native"}
    server.add(raw(_openai_body(message)), raw(_openai_body(message)))
    client = OpenAIClient(provider_config(server))
    assert client.chat("m1", "", "q", reason=True) == http.Reply("42", "native", 0, 0)
    assert client.chat("m1", "", "q", reason=False) == http.Reply("<think>tagged</think>42", None, 0, 0)


def test_openai_an_empty_native_reasoning_falls_back_to_tagged_reasoning(server):
    message = {"content": "<think>tagged</think>42", "reasoning_content": "", "reasoning": 7}
    server.add(raw(_openai_body(message)))
    assert OpenAIClient(provider_config(server)).chat("m1", "", "q", reason=True).reasoning == "tagged"


@pytest.mark.parametrize(
    ("usage", "tokens"),
    [
        (None, (0, 0)),
        ({}, (0, 0)),
        ({"prompt_tokens": None, "completion_tokens": 4}, (0, 4)),
        ({"prompt_tokens": 9}, (9, 0)),
    ],
)
def test_openai_missing_usage_counts_as_no_tokens(server, usage, tokens):
    server.add(raw(_openai_body({"content": "ok"}, usage=usage)))
    reply = OpenAIClient(provider_config(server)).chat("m1", "", "q", reason=False)
    assert (reply.input_tokens, reply.output_tokens) == tokens


def test_openai_a_null_content_is_an_empty_answer(server):
    server.add(raw(_openai_body({"content": None})))
    assert OpenAIClient(provider_config(server)).chat("m1", "", "q", reason=False).text == ""


@pytest.mark.parametrize(
    ("body", "missing"),
    [
        ({"choices": []}, "choices"),
        ({"choices": {"0": {}}}, "choices"),
        ({"choices": ["text"]}, "choices"),
        ({}, "choices"),
        ({"choices": [{"message": "text"}]}, "message"),
        ({"choices": [{}]}, "message"),
        ({"choices": [{"message": {"content": ["a", "b"]}}]}, "text content"),
    ],
)
def test_openai_an_answer_of_another_shape_names_what_is_missing(server, body, missing):
    server.add(raw(json.dumps(body)))
    message = provider_error(OpenAIClient(provider_config(server)).chat, "m1", "", "q", reason=False)
    assert message == f"p m1: unexpected response shape: no {missing}"


def test_openai_a_refusal_quotes_the_model_without_the_key(server, keyed):
    server.add(raw(_openai_body({"content": None, "refusal": f"not with {KEY}"})))
    message = provider_error(OpenAIClient(provider_config(server, api_key_env=keyed)).chat, "m1", "", "q", reason=False)
    assert message == "p m1: the model refused: not with ***"


def test_openai_a_filtered_answer_is_an_error_even_with_text(server):
    server.add(raw(_openai_body({"content": "partial"}, finish="content_filter")))
    message = provider_error(OpenAIClient(provider_config(server)).chat, "m1", "", "q", reason=False)
    assert message == "p m1: the answer was withheld by the content filter"


def test_openai_an_empty_refusal_is_no_refusal(server):
    server.add(raw(_openai_body({"content": "fine", "refusal": ""}, finish=None)))
    assert OpenAIClient(provider_config(server)).chat("m1", "", "q", reason=False).text == "fine"


# --- anthropic: the request it sends and how it reads the answer ----------------


def _anthropic_body(content: Any, *, stop: str = "end_turn", usage: Any = None) -> str:
    body: dict[str, Any] = {"content": content, "stop_reason": stop}
    if usage is not None:
        body["usage"] = usage
    return json.dumps(body)


def test_anthropic_sends_its_version_and_key_headers_and_the_message(server, keyed):
    client = AnthropicClient(
        provider_config(server, "anthropic", api_key_env=keyed, max_tokens=100, params={"top_k": 3})
    )
    server.add(answer("hi", input_tokens=7, output_tokens=3))
    assert client.chat("m1", "be brief", "hello?", reason=False) == http.Reply("hi", None, 7, 3)
    request = server.requests[0]
    assert request.path == "/v1/messages"
    assert (request.headers["anthropic-version"], request.headers["x-api-key"]) == ("2023-06-01", KEY)
    assert "authorization" not in request.headers
    assert request.body == {
        "top_k": 3,
        "model": "m1",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "hello?"}],
        "system": "be brief",
    }
    assert repr(client) == "AnthropicClient('p')"


def test_anthropic_without_a_key_sends_only_the_version_header(server):
    server.add(answer("hi"))
    AnthropicClient(provider_config(server, "anthropic")).chat("m1", "", "hello?", reason=False)
    request = server.requests[0]
    assert request.headers["anthropic-version"] == "2023-06-01" and "x-api-key" not in request.headers
    assert "system" not in request.body


def test_anthropic_native_reasoning_asks_for_thinking_on_top_of_the_answer_budget(server):
    client = AnthropicClient(
        provider_config(server, "anthropic", reasoning="native", max_tokens=100, thinking_budget=30)
    )
    server.add(answer("42", reasoning="deep"), answer("42", reasoning="deep"))
    assert client.chat("m1", "", "q", reason=True) == http.Reply("42", "deep", 10, 5)
    body = server.requests[0].body
    assert (body["thinking"], body["max_tokens"]) == ({"type": "enabled", "budget_tokens": 30}, 130)
    assert "system" not in body
    assert client.chat("m1", "", "q", reason=False) == http.Reply("42", None, 10, 5)
    assert "thinking" not in server.requests[1].body and server.requests[1].body["max_tokens"] == 100


def test_anthropic_scratchpad_reasoning_is_asked_for_in_the_system_prompt(server):
    client = AnthropicClient(provider_config(server, "anthropic", reasoning="scratchpad"))
    server.add(answer("<reasoning>why</reasoning>42"))
    assert client.chat("m1", "", "q", reason=True) == http.Reply("42", "why", 10, 5)
    body = server.requests[0].body
    assert body["system"] == scratchpad.INSTRUCTION and "thinking" not in body


def test_anthropic_joins_text_blocks_and_thinking_blocks_and_skips_the_rest(server):
    blocks = [
        {"type": "thinking", "thinking": "one "},
        {"type": "text", "text": "A"},
        "stray",
        {"type": "tool_use", "text": "no", "thinking": "no"},
        {"type": "text"},
        {"type": "thinking"},
        {"type": "text", "text": "B"},
        {"type": "thinking", "thinking": "two"},
    ]
    server.add(raw(_anthropic_body(blocks)), raw(_anthropic_body(blocks)))
    client = AnthropicClient(provider_config(server, "anthropic"))
    assert client.chat("m1", "", "q", reason=True) == http.Reply("AB", "one two", 0, 0)
    assert client.chat("m1", "", "q", reason=False) == http.Reply("AB", None, 0, 0)


def test_anthropic_tagged_reasoning_is_used_when_there_is_no_thinking(server):
    server.add(
        raw(_anthropic_body([{"type": "text", "text": "<think>t</think>A"}, {"type": "thinking", "thinking": ""}]))
    )
    assert AnthropicClient(provider_config(server, "anthropic")).chat("m1", "", "q", reason=True) == http.Reply(
        "A", "t", 0, 0
    )


@pytest.mark.parametrize(
    ("usage", "tokens"),
    [
        (None, (0, 0)),
        ({"input_tokens": 5}, (5, 0)),
        ({"cache_creation_input_tokens": 2, "output_tokens": 4}, (2, 4)),
        ({"cache_read_input_tokens": 3, "input_tokens": None, "output_tokens": None}, (3, 0)),
    ],
)
def test_anthropic_input_tokens_add_the_cache_reads_and_writes(server, usage, tokens):
    server.add(raw(_anthropic_body([{"type": "text", "text": "ok"}], usage=usage)))
    reply = AnthropicClient(provider_config(server, "anthropic")).chat("m1", "", "q", reason=False)
    assert (reply.input_tokens, reply.output_tokens) == tokens


@pytest.mark.parametrize("content", [None, "text", {"type": "text", "text": "x"}])
def test_anthropic_content_that_is_not_a_list_is_an_unexpected_shape(server, content):
    server.add(raw(_anthropic_body(content)))
    message = provider_error(AnthropicClient(provider_config(server, "anthropic")).chat, "m1", "", "q", reason=False)
    assert message == "p m1: unexpected response shape: no content"


def test_anthropic_a_refusal_is_an_error(server):
    server.add(raw(_anthropic_body([{"type": "text", "text": "partial"}], stop="refusal")))
    message = provider_error(AnthropicClient(provider_config(server, "anthropic")).chat, "m1", "", "q", reason=False)
    assert message == "p m1: the model refused to answer (stop_reason: refusal)"
