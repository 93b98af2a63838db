"""`mklang run --stream` and `resume --stream` against the fake server: each answer is written to stderr
as it arrives, stdout keeps the result, `--events` writes the pieces without their text unless
`--trace-content`, and a resume streams only the answers it pays for."""

from __future__ import annotations

import json

import pytest
from providers.test_providers_cli import KEY, mklang
from support.commands import cli_env
from support.commands import mklang as subprocess_mklang
from support.fakeserver import answer

TWO = """\
mklang 0.4
machine two
entry a
budget 5
result y

state a {
  structure "s"
  prompt "first"
  output x
  otherwise -> b
}

state b {
  structure "s"
  prompt "second"
  output y
  otherwise -> END
}
"""
FIRST, SECOND = "one two three four", "five six \x1b[31mseven"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The current folder of the test, with no user config to find."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path


def run(workdir, server, *args):
    machine = workdir / "two.mk"
    machine.write_text(TWO)
    return mklang("run", str(machine), "--provider", "openai", "--model", "m", *args, server=server)


def test_run_stream_writes_each_answer_to_stderr_as_it_arrives(workdir, server):
    server.add(answer(FIRST), answer(SECOND))
    events = workdir / "events.jsonl"
    done = run(workdir, server, "--stream", "--events", str(events), "--format", "json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["result"] == SECOND
    assert f"{FIRST}\nfive six \\x1b[31mseven\n" in done.stderr  # a line an answer, control characters shown
    assert [request.body.get("stream") for request in server.requests] == [True, True]
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    deltas = [line for line in lines if line["event"] == "model.delta"]
    assert len(deltas) == len(FIRST.split()) + len(SECOND.split())
    assert all("text" not in line for line in deltas)  # --stream shows the text; --events keeps it without content
    assert all("prompt" not in line for line in lines if line["event"] == "model.started")


def test_run_without_stream_asks_for_whole_answers(workdir, server):
    server.add(answer(FIRST), answer(SECOND))
    done = run(workdir, server, "--format", "json")
    assert done.returncode == 0, done.stderr
    assert FIRST not in done.stderr
    assert [request.body.get("stream") for request in server.requests] == [None, None]


def test_resume_stream_writes_only_the_answers_it_pays_for(workdir, server):
    server.add(answer(FIRST, input_tokens=10, output_tokens=5), answer(SECOND))
    checkpoint = workdir / "cp.json"
    parked = run(workdir, server, "--checkpoint", str(checkpoint), "--max-tokens", "10", "--stream")
    assert parked.returncode == 3, parked.stderr
    assert FIRST in parked.stderr
    resumed = mklang("resume", str(checkpoint), "--max-tokens", "1000", "--stream", "--format", "json", server=server)
    assert resumed.returncode == 0, resumed.stderr
    assert "five six" in resumed.stderr and FIRST not in resumed.stderr
    assert server.count == 2


def test_a_run_killed_mid_stream_pays_only_that_call_again(workdir, server):
    server.add(answer(FIRST), answer(SECOND), answer(SECOND))
    machine = workdir / "two.mk"
    machine.write_text(TWO)
    checkpoint = workdir / "cp.json"
    given = {"OPENAI_API_KEY": KEY, "OPENAI_BASE_URL": server.openai_url}
    killed_at = len(FIRST.split()) + 2  # two pieces into the second answer
    args = ("--provider", "openai", "--model", "m", "--stream", "--format", "json")
    env = cli_env(**given, MKLANG_KILL_AT=f"call.delta:{killed_at}")
    died = subprocess_mklang("run", str(machine), *args, "--checkpoint", str(checkpoint), env=env)
    assert died.returncode == -9, died.stderr  # SIGKILL, mid-stream
    assert f"{FIRST}\nfive " in died.stderr and SECOND not in died.stderr and server.count == 2
    resumed = mklang("resume", str(checkpoint), "--stream", "--format", "json", server=server)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["result"] == SECOND
    assert server.count == 3  # the first answer was journaled; only the one cut by the kill is bought again
    assert "five six" in resumed.stderr and FIRST not in resumed.stderr
