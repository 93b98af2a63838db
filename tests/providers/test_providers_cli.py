"""`mklang run` against real HTTP providers, as a subprocess talking to the fake server."""

from __future__ import annotations

import json
import shlex

import pytest
from support import ROOT
from support.commands import cli, cli_env
from support.fakeserver import answer, error
from support.models import PRICE_IN, PRICE_OUT, Model

KEY = "sk-cli-SECRET-5f5f5f5f5f5f"

ESSAY = """\
mklang 0.4
machine essay
entry draft
budget 10
result summary

state draft {
  tier reasoning
  reason
  structure "One paragraph."
  prompt "Write about {{topic}}."
  output draft
  when "the draft is finished" -> summarize
  when "the draft has gaps" repair 1 -> draft
  otherwise fail
}

state summarize {
  tier fast
  structure "One line."
  prompt "SUMMARY_PROMPT"
  output summary
  otherwise -> END
}
"""


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The current folder of the test, with no user config to find."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path


def write_machine(path, summary_prompt="Summarize: {{draft}}"):
    path.write_text(ESSAY.replace("SUMMARY_PROMPT", summary_prompt))
    return str(path)


def mklang(*args, server=None, env=None):
    """The CLI in process, with the test key and (given a server) its URL in the environment."""
    given = {"OPENAI_API_KEY": KEY, **({"OPENAI_BASE_URL": server.openai_url} if server is not None else {})}
    return cli(*args, env=cli_env(**given, **(env or {})))


def run_openai(machine, *args, server):
    """`mklang run MACHINE` on OpenAI model `m` at the fake server, with `args`, reporting JSON."""
    return mklang("run", machine, "--provider", "openai", "--model", "m", *args, "--format", "json", server=server)


def run_json(process):
    assert process.stdout, process.stderr
    return json.loads(process.stdout)


def test_run_with_provider_openai_reports_the_servers_usage(workdir, server):
    model = Model()
    server.handler = model
    process = run_openai(write_machine(workdir / "essay.mk"), "--set", "topic=tides", server=server)
    assert process.returncode == 0, process.stderr
    result = run_json(process)
    assert result["result"] == "A short summary."
    assert result["usage"]["input_tokens"] == sum(i for i, _ in model.served)
    assert result["usage"]["output_tokens"] == sum(o for _, o in model.served)
    assert all(r.body["model"] == "m" and r.headers["authorization"] == f"Bearer {KEY}" for r in server.requests)


def test_dollar_totals_come_from_the_config_prices(workdir, server):
    model = Model()
    server.handler = model
    (workdir / "mklang.toml").write_text(f'[prices."openai:m"]\ninput = {PRICE_IN}\noutput = {PRICE_OUT}\n')
    process = run_openai(write_machine(workdir / "essay.mk"), "--set", "topic=tides", "--max-cost", "5", server=server)
    assert process.returncode == 0, process.stderr
    assert run_json(process)["usage"]["cost_usd"] == pytest.approx(model.cost(), rel=1e-12)


def test_a_dollar_budget_without_a_price_exits_2_before_any_call(workdir, server):
    process = run_openai(write_machine(workdir / "essay.mk"), "--max-cost", "1", server=server)
    assert process.returncode == 2
    assert "--max-cost needs a price for openai:m" in process.stdout + process.stderr
    assert server.count == 0


def test_retries_running_out_halt_with_exit_1(workdir, server):
    (workdir / "mklang.toml").write_text("[providers.openai]\nretries = 1\nbackoff = 0.001\n")
    server.fallback = error(500, "boom")
    process = run_openai(write_machine(workdir / "essay.mk"), server=server)
    assert process.returncode == 1
    result = run_json(process)
    assert (result["status"], result["at"]) == ("halted", "draft")
    assert result["error"] == "provider-error: openai 500: boom (after 2 attempts)"
    assert server.count == 2


def test_record_then_replay_offline_and_a_changed_prompt(workdir, server):
    machine = write_machine(workdir / "essay.mk")
    server.handler = Model()
    recorded = run_openai(machine, "--set", "topic=tides", "--record", "run.yaml", server=server)
    assert recorded.returncode == 0, recorded.stderr
    calls = server.count
    server.stop()

    replayed = mklang("run", machine, "--set", "topic=tides", "--replay", "run.yaml", "--format", "json")
    assert replayed.returncode == 0, replayed.stderr
    assert run_json(replayed) == run_json(recorded)
    assert server.count == calls

    changed = write_machine(workdir / "changed.mk", "Summarise briefly: {{draft}}")
    failed = mklang("run", changed, "--set", "topic=tides", "--replay", "run.yaml", "--format", "json")
    assert failed.returncode == 1
    result = run_json(failed)
    assert (result["status"], result["at"]) == ("halted", "summarize")
    assert "closest is exchange 5:" in result["error"]
    assert "+  Summarise briefly: <data-NONCE>" in result["error"]


def test_the_api_key_never_reaches_any_output(workdir, server):
    machine = write_machine(workdir / "essay.mk")
    server.handler = Model()
    first = run_openai(machine, "--set", "topic=tides", "--record", "ok.yaml", "--checkpoint", "ok.json", server=server)
    server.handler = lambda request: error(401, f"Incorrect API key provided: {KEY}")
    second = run_openai(
        machine, "--set", "topic=tides", "--record", "bad.yaml", "--checkpoint", "bad.json", server=server
    )
    # with --checkpoint a provider error suspends (exit 3): the run can resume once the key is fixed
    assert (first.returncode, second.returncode) == (0, 3)
    assert run_json(second)["detail"] == "openai 401: Incorrect API key provided: ***"
    files = [path for path in workdir.iterdir() if path.is_file()]
    assert {p.name for p in files} >= {"ok.yaml", "ok.json", "bad.yaml", "bad.json"}
    texts = [first.stdout, first.stderr, second.stdout, second.stderr, *(p.read_text() for p in files)]
    for text in texts:
        assert KEY not in text


DOCS = ROOT / "docs" / "providers.md"


def test_the_documented_config_is_valid(workdir):
    text = DOCS.read_text()
    (workdir / "mklang.toml").write_text(text.split("```toml\n")[1].split("```")[0])
    process = mklang("config", "--format", "json")
    assert process.returncode == 0, process.stderr
    assert json.loads(process.stdout)["tiers"] == {
        "fast": "local:llama3.2",
        "balanced": "openai:gpt-4o-mini",
        "reasoning": "anthropic:claude-sonnet-4-5",
    }


def test_the_documented_openai_command_runs(workdir, server, monkeypatch):
    command = next(line for line in DOCS.read_text().splitlines() if line.startswith("mklang run") and "openai" in line)
    args = shlex.split(command)[1:]
    monkeypatch.chdir(DOCS.parent.parent)
    server.handler = lambda request: answer('{"choice": 1}' if "none of the above" in request.user else "22")
    process = mklang(*args, "--format", "json", server=server)
    assert process.returncode == 0, process.stderr
    assert run_json(process)["result"] == "22"
    assert "How many weekdays are in March 2026?" in server.requests[0].user
