"""Trust at the host boundary (ADR 0014, ADR 0022, docs/limits.md "Trust").

What is around a checkpoint may decide only what its owner said: a config
found in a project folder routes no key until allowed, a `--trust`ed file
decides no run setting, a model server's numbers and a config's prices are
validated, a key file others can read or write is refused, resume cycles stay
within the bound, and JSON output is JSON (restored runs: test_restored_runs.py). Every test is one attack, against real `mklang`
processes, a real HTTP server, real files and real databases.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from support import ROOT
from support.commands import cli, cli_env, refused
from support.examples import HITL
from support.fakeserver import Reply, Request, answer, raw

from mklang.providers.base import Produced, Verdict
from mklang.providers.base import Usage as ProviderUsage
from mklang.session import Host

EXAMPLES = ROOT / "examples"
APPROVAL = ["--script", "approval/scenarios.yaml", "--scenario", "ask-then-publish", "--format", "json"]


@pytest.fixture
def approval(tmp_path: Path) -> Path:
    shutil.copytree(HITL / "approval", tmp_path / "approval")
    return tmp_path


# --- item 6: a key file others could plant or read, a short fleet key ---------------


@pytest.fixture
def own_home(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A config folder of this test's own, its key file, and the environment that uses it."""
    home = tmp_path / "home-config"
    env = cli_env(XDG_CONFIG_HOME=str(home))
    return home / "mklang" / "checkpoint.key", env


def test_a_key_file_readable_or_writable_by_others_or_owned_by_another_user_is_refused(approval, own_home):
    key, env = own_home
    run = cli("run", "approval/approval.mk", *APPROVAL, "--hitl", "--checkpoint", "cp.json", cwd=approval, env=env)
    assert run.returncode == 3, run.stderr
    resume = ["resume", "cp.json", "--set", "approval.answer=yes", *APPROVAL]
    for mode in (0o644, 0o606, 0o620):
        key.chmod(mode)
        line = refused(cli(*resume, cwd=approval, env=env))
        assert f"readable or writable by others (mode {mode:04o}): chmod 600" in line
    key.chmod(0o600)
    if os.getuid() == 0:  # only root can give a file away: the key another user planted
        os.chown(key, 65534, -1)
        assert "belongs to another user (uid 65534)" in refused(cli(*resume, cwd=approval, env=env))
        os.chown(key, 0, -1)
    assert cli(*resume, cwd=approval, env=env).returncode == 0


def test_a_fleet_key_shorter_than_32_bytes_is_refused(approval):
    short = cli_env(MKLANG_CHECKPOINT_KEY="fleet-secret")
    line = refused(
        cli("run", "approval/approval.mk", *APPROVAL, "-q", "--checkpoint", "cp.json", cwd=approval, env=short)
    )
    assert "MKLANG_CHECKPOINT_KEY is shorter than 32 bytes" in line and "fleet-secret" not in line
    assert not (approval / "cp.json").exists()


# --- item 3: a model server's token counts are validated -------------------------

LOOP = """\
mklang 0.4
machine loop
entry ask
budget 500
state ask {
  structure "One word."
  prompt "Say a word."
  output word
  when "the word is stop" -> END
  otherwise -> ask
}
"""

COMPLETION = (
    '{"choices": [{"index": 0, "message": {"role": "assistant", "content": "word"}, "finish_reason": "stop"}], '
    '"usage": {"prompt_tokens": %s, "completion_tokens": 4}}'
)


@pytest.mark.parametrize("count", ["-1000000", '"12"', "[10]", "1e400", "NaN", "true"])
def test_a_malformed_token_count_is_one_provider_error_line_and_the_call_counts_as_spent(tmp_path, server, count):
    (tmp_path / "loop.mk").write_text(LOOP)
    server.handler = lambda request: raw(COMPLETION % count)
    env = cli_env(OPENAI_BASE_URL=server.openai_url)
    model = ["--provider", "openai", "--model", "m", "--max-tokens", "100", "--format", "json"]
    done = cli("run", "loop.mk", *model, cwd=tmp_path, env=env)
    assert done.returncode == 1 and server.count == 1, (done.stderr, server.count)
    result = json.loads(done.stdout)
    (line,) = result["error"].splitlines()
    assert line.startswith("provider-error: openai m: the server's usage is malformed (prompt_tokens: ")
    assert "counted as" in line
    prompt_bytes = len(server.requests[0].user.encode()) + len(server.requests[0].system.encode())
    assert result["usage"]["input_tokens"] == prompt_bytes and result["usage"]["output_tokens"] == 4

    suspended = cli("run", "loop.mk", *model, "--checkpoint", "cp.json", cwd=tmp_path, env=env)
    assert suspended.returncode == 3, suspended.stderr
    assert json.loads(suspended.stdout)["usage"]["input_tokens"] == prompt_bytes
    server.handler = lambda request: answer("word", input_tokens=6, output_tokens=4)
    resumed = cli("resume", "cp.json", "--format", "json", "--provider", "openai", "--model", "m", cwd=tmp_path,
                     env=env)  # fmt: skip
    assert resumed.returncode == 3, resumed.stderr  # the paid call still counts: the 100 tokens run out sooner
    assert json.loads(resumed.stdout)["usage"]["input_tokens"] >= prompt_bytes
    assert server.count - 2 <= (100 - prompt_bytes - 4) // 10 + 1


# --- item 8: --format json prints JSON, whatever the values ------------------------

SCORE = """\
mklang 0.4
machine score
entry rate
budget 3
result score
state rate {
  structure "A JSON object with a number `value`."
  prompt "Rate it."
  output score
  parse json
  otherwise -> END
}
"""


def strict_json(text: str):
    """Parse as JSON is specified: NaN and Infinity are not JSON."""

    def refuse(constant: str):
        raise AssertionError(f"{constant} in JSON output")

    return json.loads(text, parse_constant=refuse)


def test_json_output_never_holds_nan_or_infinity(tmp_path, server):
    (tmp_path / "score.mk").write_text(SCORE)
    server.add(answer('{"value": NaN, "spread": [Infinity, -Infinity, 1e400]}'))
    env = cli_env(OPENAI_BASE_URL=server.openai_url)
    done = cli(
        "run", "score.mk", "--provider", "openai", "--model", "m", "--format", "json", "--set", "given=NaN",
        "--set", "huge=1e400", cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = strict_json(done.stdout)
    assert result["result"] == {"value": "NaN", "spread": ["Infinity", "-Infinity", "Infinity"]}
    assert (result["context"]["given"], result["context"]["huge"]) == ("NaN", "1e400")  # --set keeps them as text


# --- item 4: prices ----------------------------------------------------------------


def model_server(request: Request) -> Reply:
    """Answers examples/kill-9-resume/report.mk: an outline, sections, a report; every judge says 1."""
    if "strict judge" in request.system:
        text = "1"
    elif "Outline" in request.user:
        text = '["Leaks", "Meters", "Pressure", "Results"]'
    else:
        text = "A paragraph."
    return answer(text, input_tokens=10_000, output_tokens=2_000)  # $0.0027 a call for gpt-4o-mini


def test_max_cost_stops_a_run_of_a_known_model_within_the_cap_with_no_config_file(tmp_path, server):
    per_call = (10_000 * 0.15 + 2_000 * 0.6) / 1_000_000  # genai-prices: gpt-4o-mini, USD per million tokens
    server.handler = model_server
    done = cli(
        "run", str(EXAMPLES / "kill-9-resume" / "report.mk"), "--provider", "openai", "--model", "gpt-4o-mini",
        "--max-cost", "0.01", "--concurrency", "1", "--format", "json",
        cwd=tmp_path, env=cli_env(OPENAI_BASE_URL=server.openai_url, XDG_CONFIG_HOME=str(tmp_path / "no-config")),
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout)
    assert result["error"] == "cost-exhausted"
    assert server.count == 4  # outline, its judge, two of the four sections: then the cap
    spent = result["usage"]["cost_usd"]
    assert spent == pytest.approx(4 * per_call) and spent < 0.01 + per_call  # over by less than the call in flight


@pytest.mark.parametrize("price", ["nan", "-1", "inf", "1e400", "2e6"])
def test_a_nan_negative_or_infinite_price_is_refused_when_the_config_loads(tmp_path, server, price):
    (tmp_path / "mklang.toml").write_text(f'[prices."openai:gpt-4o-mini"]\ninput = {price}\noutput = 0.6\n')
    (tmp_path / "loop.mk").write_text(LOOP)
    server.handler = lambda request: answer("word")
    env = cli_env(OPENAI_BASE_URL=server.openai_url)
    model = ["--provider", "openai", "--model", "gpt-4o-mini", "--max-cost", "0.01"]
    line = refused(cli("run", "loop.mk", *model, "--config", "mklang.toml", cwd=tmp_path, env=env))
    assert "mklang.toml: [prices.'openai:gpt-4o-mini']: prices must be numbers from 0 to 1,000,000" in line
    assert server.count == 0


def test_mklang_config_shows_each_tiers_price_and_where_it_came_from(tmp_path):
    (tmp_path / "mine.toml").write_text(
        '[tiers]\nfast = "openai:gpt-4o-mini"\nbalanced = "openai:gpt-4o"\nreasoning = "ollama:llama3.2"\n'
        '[prices."openai:gpt-4o"]\ninput = 2\noutput = 8\n'
    )
    shown = cli("config", "--config", "mine.toml", "--format", "json", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    prices = json.loads(shown.stdout)["tier_prices"]
    assert prices["fast"] == {"input": 0.15, "output": 0.6, "source": prices["fast"]["source"]}
    assert prices["fast"]["source"].startswith("genai-prices ")
    assert prices["balanced"] == {"input": 2.0, "output": 8.0, "source": "the config"}  # the config overrides it
    assert prices["reasoning"] is None
    text = cli("config", "--config", "mine.toml", "--format", "text", cwd=tmp_path).stdout
    assert "fast       openai:gpt-4o-mini  ($0.15 in / $0.6 out per million tokens, from genai-prices " in text
    assert "reasoning  ollama:llama3.2  (no price)" in text


# --- item 1: a config found in a project folder sends no key until allowed ----------

FASTLANE = """\
[providers.fastlane]
kind = "openai"
base_url = "{url}"
api_key_env = "OPENAI_API_KEY"

[tiers]
fast = "fastlane:m"
balanced = "fastlane:m"
reasoning = "fastlane:m"
"""


def test_a_found_config_sends_the_users_key_to_its_server_only_once_the_user_allows_it(tmp_path, server):
    from support.fakeserver import FakeServer

    project = tmp_path / "cloned"
    project.mkdir()
    (project / "loop.mk").write_text(LOOP)
    (project / "mklang.toml").write_text(FASTLANE.format(url=server.openai_url))
    server.handler = model_server  # every run: a word, then its judge says it was "stop"
    home = tmp_path / "home"
    (home / "mklang").mkdir(parents=True)
    with FakeServer() as own:  # the user's own config routes the tiers to the user's own server
        own.handler = model_server
        (home / "mklang" / "config.toml").write_text(f'[providers.mine]\nkind = "openai"\nbase_url = '
                                                     f'"{own.openai_url}"\napi_key_env = "MINE_OPENAI_KEY"\n'
                                                     '[tiers]\ndefault = "mine:m"\n')  # fmt: skip
        env = cli_env(OPENAI_API_KEY="sk-users-own", MINE_OPENAI_KEY="sk-mine", XDG_CONFIG_HOME=str(home))

        done = cli("run", "loop.mk", "--format", "json", cwd=project, env=env)
        assert done.returncode == 0, done.stderr
        assert server.count == 0  # the found file outranks nothing: the user's config answered
        assert [r.headers["authorization"] for r in own.requests] == ["Bearer sk-mine"] * 2
        (note,) = done.stderr.strip().splitlines()
        assert note == (
            f"mklang: note: {project / 'mklang.toml'} (found in the working folder) is not used: it sends "
            f"OPENAI_API_KEY to {server.openai_url}; `mklang config allow {project / 'mklang.toml'}` to use it, "
            "or name it with --config"
        )

        allowed = cli("config", "allow", cwd=project, env=env)
        assert allowed.returncode == 0 and f"it sends OPENAI_API_KEY to {server.openai_url}" in allowed.stdout
        assert f" {project / 'mklang.toml'}\n" in (home / "mklang" / "allowed-configs").read_text()
        assert cli("run", "loop.mk", cwd=project, env=env).returncode == 0
        assert [r.headers["authorization"] for r in server.requests] == ["Bearer sk-users-own"] * 2

        with (project / "mklang.toml").open("a") as edited:  # a pull changes the file: allowed no more
            edited.write("# changed\n")
        changed = cli("run", "loop.mk", cwd=project, env=env)
        assert changed.returncode == 0 and server.count == 2 and len(own.requests) == 4
        assert "is not used (changed since it was allowed)" in changed.stderr

        named = cli("run", "loop.mk", "--config", "mklang.toml", cwd=project, env=env)  # named: the user's choice
        assert named.returncode == 0 and named.stderr == "" and server.count == 4


# --- item 2: a --trust file decides no run setting, and its numbers are checked ----


def edited(checkpoint: Path, change) -> None:
    """Edit the checkpoint's JSON as someone else would (its signature no longer holds)."""
    document = json.loads(checkpoint.read_text(encoding="utf-8"))
    change(document)
    checkpoint.write_text(json.dumps(document), encoding="utf-8")


@pytest.mark.parametrize(
    "where, value",
    [
        ("frame", -1_000_000),
        ("frame", float("nan")),
        ("answer", -1_000_000),
        ("answer", float("inf")),
        ("budget", float("nan")),
        ("budget", -5),
    ],
)
def test_a_trusted_files_negative_or_nan_spend_or_budget_refuses_the_file(approval, where, value):
    run = cli("run", "approval/approval.mk", *APPROVAL, "--max-tokens", "0", "--checkpoint", "cp.json", cwd=approval)
    assert run.returncode == 3, run.stderr

    def change(document: dict) -> None:
        usage = {"input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0}
        if where == "frame":
            document["frames"][0]["usage"] = {**usage, ("cost_usd" if value != value else "input_tokens"): value}
        elif where == "answer":
            spend = {**usage, "input_tokens" if value < 0 else "cost_usd": value}
            document["answers"]["r.draft.1"] = {"kind": "produce", "v": {"text": "x", "usage": spend}}
        else:
            document["budgets"]["max_cost" if value != value else "max_tokens"] = value

    edited(approval / "cp.json", change)
    line = refused(cli("resume", "cp.json", "--trust", "--max-tokens", "90", *APPROVAL, cwd=approval))
    assert line.startswith("mklang: error: cp.json: ")
    assert ("malformed" in line and "usage" in line) or "not a valid mklang checkpoint: budgets" in line


def test_a_trusted_file_cannot_turn_the_human_gate_off_or_raise_concurrency(approval):
    # Suspended on its token budget before the draft: the question is still to come.
    run = cli("run", "approval/approval.mk", *APPROVAL, "--hitl", "--max-tokens", "0", "--checkpoint", "cp.json",
                 cwd=approval)  # fmt: skip
    assert run.returncode == 3, run.stderr
    edited(approval / "cp.json", lambda document: document.update(hitl=False, concurrency=64))
    done = cli("resume", "cp.json", "--trust", "--max-tokens", "100000", *APPROVAL, cwd=approval)
    assert done.returncode == 3, done.stderr  # parked at the question instead of publishing
    assert json.loads(done.stdout)["reason"] == "escalated"
    assert (
        "mklang: the checkpoint is not signed with your key: ignored its recorded hitl false (human gates stay on; "
        "--no-hitl turns them off); concurrency 64 (at most 8; --concurrency N)"
    ) in done.stderr.splitlines()
    resumed = json.loads((approval / "cp.json").read_text())
    assert (resumed["hitl"], resumed["concurrency"]) == (True, 8)

    edited(approval / "cp.json", lambda document: document.update(hitl=False, status="suspended"))
    # What the resuming user says wins: here, no human gate.
    mine = cli("resume", "cp.json", "--trust", "--no-hitl", "--set", "approval.answer=yes", *APPROVAL, cwd=approval)
    assert mine.returncode == 0, mine.stderr
    assert "hitl" not in mine.stderr


def test_a_trusted_files_step_budget_is_at_most_its_machines(approval):
    # Suspended on its token budget before the draft; the file then claims a huge step budget
    # with the machine's 12 steps already taken.
    run = cli("run", "approval/approval.mk", *APPROVAL, "--max-tokens", "0", "--checkpoint", "cp.json", cwd=approval)
    assert run.returncode == 3, run.stderr
    edited(approval / "cp.json", lambda document: document["frames"][0].update(budget=10**6, steps=12))
    done = cli("resume", "cp.json", "--trust", "--max-tokens", "100000", *APPROVAL, cwd=approval)
    assert done.returncode == 3, done.stderr
    assert json.loads(done.stdout)["reason"] == "budget-exhausted"  # not a step further than the machine allows
    assert (
        "mklang: note: the checkpoint is not signed with your key: ignored its step budget 1000000 for approval "
        "(at most the machine's 12; --budget N)"
    ) in done.stderr.splitlines()
    assert json.loads((approval / "cp.json").read_text())["frames"][0]["budget"] == 12


# --- item 7: resume cycles spend no more than the bound --------------------------------

STEPS = """\
mklang 0.4
machine steps
entry one
budget 10
state one {
  structure "s"
  prompt "first {{item}}"
  output a
  otherwise -> two
}
state two {
  structure "s"
  prompt "second {{item}}"
  output b
  otherwise -> three
}
state three {
  structure "s"
  prompt "third {{item}}"
  output c
  otherwise -> END
}
"""

FAN = """\
mklang 0.4
machine fan
entry each
budget 100
state each {
  over items
  call steps { item: "{{item}}" }
  output done
  otherwise -> END
}
"""


class Paid:
    """An in-process model: 15 tokens a call, slow enough that every slot has a call in flight."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def produce(self, system: str, user: str, tier: str, reason: bool) -> Produced:
        with self.lock:
            self.calls += 1
        time.sleep(0.005)
        return Produced("ok", None, ProviderUsage(10, 5, 0.0))

    def judge(self, conditions, output, reasoning, context, tier) -> Verdict:
        return Verdict(0, ProviderUsage())


@pytest.mark.parametrize("concurrency", [4, 8, 16])
def test_ten_resume_cycles_of_a_fan_out_stay_within_the_bound_of_one(tmp_path, concurrency):
    from mklang import resume
    from mklang.runs import start
    from mklang.syntax import load_file

    (tmp_path / "steps.mk").write_text(STEPS)
    (tmp_path / "fan.mk").write_text(FAN)
    checkpoint = tmp_path / "cp.json"
    model = Paid()
    items = {"items": [f"item-{i}" for i in range(60)]}
    result = start(load_file(tmp_path / "fan.mk"), items, Host(model), checkpoint=checkpoint, concurrency=concurrency, max_tokens=90)  # fmt: skip
    bound = 90 + concurrency * 15  # docs/language.md: the cap, the call crossing it and N - 1 others in flight
    for _ in range(10):
        assert (result.status, result.reason) == ("suspended", "cost-exhausted")
        assert model.calls * 15 <= bound and result.usage.tokens == model.calls * 15
        result = resume(checkpoint, provider=model, max_tokens=90)
    assert model.calls * 15 <= bound, (model.calls * 15, bound)
    assert result.usage.tokens == model.calls * 15  # what every process paid, each call once
