"""`mklang run --stream` and `resume --stream` against the fake server: each answer is written to stderr
as it arrives, stdout keeps the result, `--events` writes the pieces without their text unless
`--trace-content`, and a resume streams only the answers it pays for. On a terminal the live view
streams them too."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import subprocess
import sys

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


def on_a_terminal(workdir, server, *args: str) -> tuple[int, str, bytes]:
    """`mklang run two.mk` in a subprocess whose stderr is a terminal (a pseudo-terminal, read as it is
    written): its exit code, stdout and every byte drawn on the terminal."""
    machine = workdir / "two.mk"
    machine.write_text(TWO)
    env = cli_env(OPENAI_API_KEY=KEY, OPENAI_BASE_URL=server.openai_url, TERM="xterm-256color", COLUMNS="100")
    leader, follower = pty.openpty()
    command = [sys.executable, "-m", "mklang", "run", str(machine), "--provider", "openai", "--model", "m", *args]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=follower, env=env, text=True) as process:
        os.close(follower)
        drawn = b""
        with contextlib.suppress(OSError):  # the terminal is gone once the process ended
            while chunk := os.read(leader, 65536):
                drawn += chunk
        stdout = process.stdout.read() if process.stdout else ""
    os.close(leader)
    return process.returncode, stdout, drawn


def test_the_live_view_on_a_terminal_streams_each_answer_as_it_is_written(workdir, server):
    server.add(answer(FIRST, stream_pause=0.15), answer(SECOND, stream_pause=0.15))
    code, stdout, drawn = on_a_terminal(workdir, server, "--format", "text")
    assert code == 0, drawn
    assert [request.body.get("stream") for request in server.requests] == [True, True]  # the view asked
    assert "five six" in stdout  # the result, whole, on stdout
    shown = drawn.decode("utf-8", "replace")
    assert "▶ two:a" in shown and "▶ two:b" in shown
    assert "one two three" in shown and "five six" in shown  # the answers' last lines, as they grew
    assert "\\x1b[31mseven" in shown and "\x1b[31mseven" not in shown  # a model's escape shown, never obeyed


def test_the_live_view_is_not_drawn_and_nothing_streams_when_stderr_is_not_a_terminal(workdir, server):
    server.add(answer(FIRST), answer(SECOND))
    done = run(workdir, server)
    assert done.returncode == 0, done.stderr
    assert "▶" not in done.stderr and FIRST not in done.stderr
    assert [request.body.get("stream") for request in server.requests] == [None, None]
