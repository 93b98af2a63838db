"""Whole machine runs through the real HTTP providers, against the fake server on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conformance.harness import run_mk
from support.fakeserver import FakeServer, InFlight, answer, error, refusal
from support.models import PRICE_IN, PRICE_OUT, Model

import mklang
from mklang.model import Machine
from mklang.providers.base import Usage
from mklang.providers.factory import make_provider
from mklang.runs import start
from mklang.session import Host

KEY = "sk-live-TOPSECRET-abcdef123456"
MACHINE = {
    "name": "essay",
    "entry": "draft",
    "budget": 10,
    "result": "summary",
    "states": [
        {
            "name": "draft",
            "face": {
                "kind": "produce",
                "prompt": "Write about {{topic}}.",
                "structure": "One paragraph.",
                "reason": True,
            },
            "tier": "reasoning",
            "output": "draft",
            "gates": [
                {"when": "the draft is finished", "target": "summarize"},
                {"when": "the draft has gaps", "policy": "repair", "repair": 1, "target": "draft"},
                {"policy": "fail"},
            ],
        },
        {
            "name": "summarize",
            "face": {"kind": "produce", "prompt": "Summarize: {{draft}}", "structure": "One line."},
            "tier": "fast",
            "output": "summary",
            "gates": [{"target": "END"}],
        },
    ],
}


def machine(**changes) -> Machine:
    data = json.loads(json.dumps(MACHINE))
    for state in data["states"]:
        state["face"].update(changes.get(state["name"], {}))
    return Machine.from_data(data)


@pytest.fixture(params=["openai", "anthropic"])
def config(request, tmp_path, server, monkeypatch):
    monkeypatch.setenv("FAKE_KEY", KEY)
    kind = request.param
    base_url = server.openai_url if kind == "openai" else server.anthropic_url
    path = tmp_path / "mklang.toml"
    path.write_text(
        f"""
[tiers]
default = "p:m"
[providers.p]
kind = "{kind}"
base_url = "{base_url}"
api_key_env = "FAKE_KEY"
retries = 2
backoff = 0.001
max_backoff = 0.01
timeout = 2
[prices."p:m"]
input = {PRICE_IN}
output = {PRICE_OUT}
"""
    )
    return str(path)


def run(config, **options):
    provider = make_provider(config_path=config, max_cost=options.get("max_cost"))
    return mklang.run(machine(**options.pop("changes", {})), {"topic": "tides"}, provider=provider, **options)


def test_run_totals_match_the_servers_usage_exactly(config, server):
    model = Model()
    server.handler = model
    result = run(config)
    assert (result.status, result.error) == ("done", None)
    assert result.result == "A short summary."
    # draft, judge (repair), draft, judge (finished), summarize
    assert len(model.served) == 5
    assert result.usage.input_tokens == sum(i for i, _ in model.served)
    assert result.usage.output_tokens == sum(o for _, o in model.served)
    assert result.usage.cost_usd == pytest.approx(model.cost(), rel=1e-12)
    assert sum(step["usage"]["input_tokens"] for step in result.trace) == result.usage.input_tokens
    assert [step["gate"] for step in result.trace] == ["the draft has gaps", "the draft is finished", "otherwise"]
    assert result.trace[0]["reasoning"] == "I considered the topic."
    assert "reasoning" not in json.dumps(result.context)


def test_run_survives_a_429_with_retry_after(config, server):
    model = Model(verdicts=["1"])
    pending = [error(429, "rate limited", retry_after="0")]
    server.handler = lambda request: pending.pop(0) if pending else model(request)
    result = run(config)
    assert result.status == "done"
    assert server.count == len(model.served) + 1
    assert result.usage.input_tokens == sum(i for i, _ in model.served)


def test_500s_until_retries_run_out_halt_at_the_state(config, server):
    server.fallback = error(503, "overloaded")
    result = run(config)
    assert result.status == "halted"
    assert result.error == "provider-error: p 503: overloaded (after 3 attempts)"
    assert result.at == "draft"
    assert server.count == 3


def test_timeout_halts_with_a_provider_error(config, server, tmp_path):
    text = Path(config).read_text().replace("timeout = 2", "timeout = 0.2").replace("retries = 2", "retries = 0")
    (tmp_path / "slow.toml").write_text(text)
    server.fallback = answer("too late", delay=1.0)
    result = run(str(tmp_path / "slow.toml"))
    assert (result.status, result.at) == ("halted", "draft")
    assert result.error == "provider-error: p timeout: no answer within 0.2s (after 1 attempt)"


def test_a_refusal_is_never_deposited(config, server):
    server.add(refusal("No."))
    result = run(config)
    assert result.status == "halted"
    assert result.error.startswith("provider-error: p m: the model refused")
    assert "draft" not in result.context


def test_an_unparseable_verdict_is_not_clamped(config, server):
    model = Model(verdicts=["I am not sure."])
    server.handler = model
    result = run(config)
    # never clamped to a gate: the judge falls back to the draft state's `otherwise fail`
    assert (result.status, result.error, result.at) == ("halted", "gate-fail", "draft")
    assert result.trace[-1]["judge_fallback"] is True


def test_a_dollar_budget_halts_or_suspends_at_the_loop_top(config, server):
    model = Model()
    server.handler = model
    # the first step (draft + judge) costs more than this; the second loop-top stops the run
    first_step = ((107 + 207) * PRICE_IN + (13 + 23) * PRICE_OUT) / 1e6
    halted = run(config, max_cost=first_step / 2)
    assert (halted.status, halted.error, halted.at) == ("halted", "cost-exhausted", "draft")
    assert len(halted.trace) == 1
    assert halted.usage.cost_usd == pytest.approx(first_step, rel=1e-12)
    server.handler = Model()
    provider = make_provider(config_path=config, max_cost=first_step / 2)
    suspended = start(machine(), {"topic": "tides"}, Host(provider), max_cost=first_step / 2, suspendable=True)
    assert (suspended.status, suspended.reason) == ("suspended", "cost-exhausted")


def test_record_then_replay_offline_gives_the_identical_result(config, server, tmp_path):
    cassette = tmp_path / "run.yaml"
    server.handler = Model()
    recording = make_provider(config_path=config, record=cassette)
    recorded = mklang.run(machine(), {"topic": "tides"}, provider=recording)
    assert recorded.status == "done"
    calls = server.count
    server.stop()  # replay must not need the network

    replayed = mklang.run(machine(), {"topic": "tides"}, provider=make_provider(replay=cassette))
    assert replayed.to_json() == recorded.to_json()
    assert server.count == calls

    changed = machine(summarize={"prompt": "Summarise briefly: {{draft}}"})
    failed = mklang.run(changed, {"topic": "tides"}, provider=make_provider(replay=cassette))
    assert (failed.status, failed.at) == ("halted", "summarize")
    assert failed.error.startswith("provider-error: replay: cassette run.yaml holds no produce request like this one")
    assert "closest is exchange 5:" in failed.error
    diff = failed.error.splitlines()[1:]
    assert "-  Summarize: <data-NONCE>" in diff
    assert "+  Summarise briefly: <data-NONCE>" in diff


def test_no_api_key_in_cassette_trace_result_or_errors(config, server, tmp_path, caplog):
    cassette = tmp_path / "run.yaml"
    model = Model()
    server.handler = model
    provider = make_provider(config_path=config, record=cassette)
    done = mklang.run(machine(), {"topic": "tides"}, provider=provider)
    server.handler = lambda request: error(401, f"Incorrect API key provided: {KEY}.")
    failed = mklang.run(machine(), {"topic": "tides"}, provider=provider)
    assert failed.status == "halted" and "Incorrect API key provided: ***" in failed.error
    assert (
        server.requests[0].headers.get("authorization", server.requests[0].headers.get("x-api-key", "")).endswith(KEY)
    )
    outputs = [
        cassette.read_text(),
        json.dumps(done.to_json()),
        json.dumps(failed.to_json()),
        repr(provider),
        caplog.text,
    ]
    for text in outputs:
        assert KEY not in text


def test_fan_out_shares_the_providers_request_limit(tmp_path, server):
    path = tmp_path / "c.toml"
    path.write_text(
        f'[tiers]\ndefault = "p:m"\n[providers.p]\nkind = "openai"\nbase_url = "{server.openai_url}"\nmax_in_flight = 2\n'
    )
    data = {
        "name": "vote",
        "entry": "vote",
        "budget": 10,
        "states": [
            {
                "name": "vote",
                "sample": 5,
                "output": "votes",
                "gates": [{"target": "END"}],
                "face": {"kind": "produce", "prompt": "Vote number {{index}}.", "structure": "A word."},
            }
        ],
    }
    server.handler = held = InFlight(lambda request: answer(request.user.upper(), input_tokens=2, output_tokens=1))
    result = mklang.run(Machine.from_data(data), provider=make_provider(config_path=path), concurrency=5)
    assert result.status == "done"
    assert result.context["votes"] == [f"VOTE NUMBER {i}." for i in range(5)]
    assert (held.peak, server.count) == (2, 5)
    assert result.usage.tokens == 15


# --- the trace of real judge answers -----------------------------------------

JUDGED = """
    machine judged
    entry a
    budget 3
    hook never "False."
    state a {
      structure "s"
      prompt "p"
      output o
      when "first" -> END
      when "second" hook never -> END
      when "third" -> END
      otherwise fail
    }
"""


@pytest.mark.parametrize(
    ("replies", "hook", "parse", "status"),
    [
        (['{"choice": 1}'], False, "strict", "done"),
        (["1"], False, "bare", "done"),
        (["I would say 1"], False, "last", "done"),
        (["2", '{"choice": 1}'], False, "strict", "done"),  # the last batch's reading is the one kept
        (['{"choice": 2}', "1"], False, "bare", "done"),
        (["2", '{"choice": 2}'], False, "strict", "halted"),  # `otherwise fail` after two none batches
        (["2"], True, "bare", "done"),  # the hook gate fires after a none batch
    ],
)
def test_judge_parse_in_the_trace_says_how_the_last_judge_answer_was_read(tmp_path, replies, hook, parse, status):
    path = tmp_path / "mklang.toml"
    with FakeServer() as server:
        server.add(answer("the output"), *[answer(reply) for reply in replies])
        path.write_text(
            f'[tiers]\ndefault = "p:m"\n[providers.p]\nkind = "openai"\nbase_url = "{server.openai_url}"\nretries = 0\n'
        )
        provider = make_provider(config_path=str(path))
        result = run_mk(JUDGED, provider=provider, hooks={"never": lambda c, o: hook})
    assert result.status == status, result.error
    assert result.trace[0]["judge_parse"] == parse
    calls = 1 + len(replies)  # the produce call and each judge batch, 10 + 5 tokens each
    assert result.trace[0]["usage"] == Usage(10 * calls, 5 * calls).to_json()


def test_no_judge_call_leaves_no_judge_parse():
    result = run_mk(JUDGED, llm={"judge": [0]}, hooks={"never": lambda c, o: False})
    assert result.status == "done" and "judge_parse" not in result.trace[0]


# --- the scratchpad and where a checkpoint lives --------------------------------


def test_the_scratchpad_asks_alone_without_a_system_message_and_joins_every_block():
    from mklang.providers.scratchpad import INSTRUCTION, split, with_instruction

    assert with_instruction("") == INSTRUCTION
    assert with_instruction("Be brief.") == f"Be brief.\n\n{INSTRUCTION}"
    assert split("<think> a </think>x<reasoning>b</reasoning> y ") == ("x y", "a\n\nb")
