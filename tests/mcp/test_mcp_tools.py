"""Tools of MCP servers in machines: real servers nobody here wrote (mcp-server-time, mcp-server-git
from PyPI) and a counting one written with the SDK (support/mcp_counter.py), reached through the
host the way every host tool is (docs/mcp.md)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import ROOT
from support.commands import cli, cli_env, error_of

import mklang
from mklang.mcp.client import McpError, McpHub
from mklang.mcp.servers import McpServer

COUNTER = str(ROOT / "tests" / "support" / "mcp_counter.py")
EVERYTHING = ROOT / ".ci" / "npm" / "node_modules" / ".bin" / "mcp-server-everything"  # .ci/run installs it
TIME = f"time={sys.executable} -m mcp_server_time --local-timezone UTC"
EMPTY_SCRIPT = "scenarios:\n  - name: tools-only\n    llm: {produce: []}\n"


class Events:
    def __init__(self) -> None:
        self.seen: list[object] = []

    def emit(self, event: object) -> None:
        self.seen.append(event)


def machine(tmp_path: Path, name: str, *states: tuple[str, str]) -> Path:
    """A machine of tool states run in order, each depositing its observation under its own name."""
    lines = ["mklang 0.4", f"machine {name}", f"entry {states[0][0]}", f"budget {len(states) + 1}", ""]
    for index, (state, use) in enumerate(states):
        following = states[index + 1][0] if index + 1 < len(states) else "END"
        lines += [f"state {state} {{", f"  {use}", f"  output {state}", f"  otherwise -> {following}", "}", ""]
    path = tmp_path / f"{name}.mk"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def script(tmp_path: Path) -> Path:
    path = tmp_path / "tools-only.yaml"
    path.write_text(EMPTY_SCRIPT, encoding="utf-8")
    return path


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()] if log.exists() else []


def test_a_machine_calls_get_current_time_of_mcp_server_time_which_is_read_only_by_its_annotations(tmp_path):
    clock = machine(tmp_path, "clock", ("now", 'tool get_current_time { timezone: "Europe/Paris" }'))
    events = Events()
    result = mklang.run(clock, script=script(tmp_path), mcp=[TIME], observer=events)
    assert result.status == "done", result
    answer = json.loads(result.result)
    assert answer["timezone"] == "Europe/Paris" and answer["datetime"].startswith(time.strftime("%Y-"))
    started = [e for e in events.seen if getattr(e, "kind", "") == "tool.started"]
    assert [(e.tool, e.read_only) for e in started] == [("get_current_time", True)]


def test_mcp_server_git_reads_a_repository_and_its_commit_tool_is_effectful(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", "-b", "trunk", str(repo)], check=True)
    (repo / "notes.txt").write_text("hello\n", encoding="utf-8")
    git = f"git={sys.executable} -m mcp_server_git"
    status = machine(tmp_path, "status", ("look", f'tool git_status {{ repo_path: "{repo}" }}'))
    listing = cli("tools", "--mcp", git, str(status), "--format", "json")
    assert listing.returncode == 0, listing.stderr
    effects = {row["name"]: row["read_only"] for row in json.loads(listing.stdout)["tools"]}
    assert effects["git_status"] is True and effects["git_log"] is True
    assert effects["git_commit"] is False and effects["git_add"] is False
    result = mklang.run(status, script=script(tmp_path), mcp=[git])
    assert result.status == "done" and "trunk" in result.result and "notes.txt" in result.result


@pytest.fixture
def everything() -> str:
    """`@modelcontextprotocol/server-everything` from npm, as `--mcp` names it, where Node is."""
    if shutil.which("node") is None:
        pytest.skip("no Node here: server-everything is an npm package")
    if not EVERYTHING.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{EVERYTHING} is missing: .ci/run installs it where npm is")
        pytest.skip("npm install --prefix .ci/npm @modelcontextprotocol/server-everything (as .ci/run does)")
    return f"every={EVERYTHING}"


def test_server_everything_from_npm_is_classified_by_its_annotations_and_echoes(tmp_path, everything):
    listing = cli("tools", "--mcp", everything, "--format", "json")
    assert listing.returncode == 0, listing.stderr
    effects = {row["name"]: row["read_only"] for row in json.loads(listing.stdout)["tools"]}
    assert effects["echo"] is True and effects["get-sum"] is True
    assert effects["toggle-simulated-logging"] is False and effects["gzip-file-as-resource"] is False
    both = machine(
        tmp_path,
        "both",
        ("say", 'tool echo { message: "hello" }'),
        ("add", "tool get_sum { a: 2, b: 3 }"),  # `get-sum` as a machine can write it
    )
    result = mklang.run(both, script=script(tmp_path), mcp=[everything])
    assert result.status == "done", result.error
    assert result.context["say"] == "Echo: hello" and "5" in result.context["add"]


def test_the_host_config_overrides_the_annotations_and_names_a_server_with_a_command(tmp_path):
    log = tmp_path / "calls.jsonl"
    config = tmp_path / "host.toml"
    config.write_text(
        f"[mcp.servers.counter]\ncommand = {json.dumps([sys.executable, COUNTER, str(log)])}\n"
        'effectful = ["peek"]\nread_only = ["slow"]\n',
        encoding="utf-8",
    )
    listing = cli("tools", "--config", str(config), "--format", "json")
    assert listing.returncode == 0, listing.stderr
    rows = {row["name"]: (row["read_only"], row["annotated_read_only"]) for row in json.loads(listing.stdout)["tools"]}
    assert rows["peek"] == (False, True)  # the server says read-only, the host says otherwise
    assert rows["slow"] == (True, False)
    assert rows["tick"] == (False, False)


def test_a_config_found_in_the_working_folder_starts_no_server_until_allowed(tmp_path):
    log = tmp_path / "calls.jsonl"
    (tmp_path / "mklang.toml").write_text(
        f"[mcp.servers.counter]\ncommand = {json.dumps([sys.executable, COUNTER, str(log)])}\n", encoding="utf-8"
    )
    env = cli_env(XDG_CONFIG_HOME=str(tmp_path / "user-config"))
    refused = cli("tools", "--format", "json", cwd=tmp_path, env=env)
    assert json.loads(refused.stdout)["tools"] == []
    assert "is not used: it starts the MCP server counter (" in refused.stderr
    assert cli("config", "allow", cwd=tmp_path, env=env).returncode == 0
    allowed = cli("tools", "--format", "json", cwd=tmp_path, env=env)
    assert {row["name"] for row in json.loads(allowed.stdout)["tools"]} >= {"tick", "peek"}


def test_tools_reports_a_missing_and_an_ambiguous_tool_at_the_tool_state(tmp_path):
    log = tmp_path / "calls.jsonl"
    one, two = (f"{name}={sys.executable} {COUNTER} {log}" for name in ("one", "two"))
    used = machine(tmp_path, "used", ("a", 'tool tick { label: "x" }'), ("b", 'tool nothing { label: "x" }'))
    qualified = machine(tmp_path, "qualified", ("a", 'tool one__tick { label: "x" }'))
    found = cli("tools", "--mcp", one, "--mcp", two, str(used), str(qualified), "--format", "json")
    assert found.returncode == 2
    assert [(d["file"], d["line"], d["code"], d["message"]) for d in json.loads(found.stdout)["diagnostics"]] == [
        (
            str(used),
            7,
            "tool-ambiguous",
            'tool "tick" is listed by the MCP servers one and two: name it one__tick or two__tick',
        ),
        (
            str(used),
            13,
            "tool-missing",
            'tool "nothing" is listed by none of the MCP servers one, two, nor a plugin or built-in',
        ),
    ]
    ran = mklang.run(qualified, script=script(tmp_path), mcp=[one, two])
    assert ran.status == "done" and ran.result == "ticked x"


@pytest.fixture
def counter(tmp_path):
    """A hub over the counting server, with a short timeout, closed after the test."""
    log = tmp_path / "calls.jsonl"
    hub = McpHub([McpServer("counter", (sys.executable, COUNTER, str(log)), timeout=2)]).connect()
    yield hub, log
    hub.close()


def test_a_call_carries_the_idempotency_key_in_its_meta(counter):
    hub, log = counter
    assert hub.tools()["tick"]({"label": "a"}, idempotency_key="run-1/r:1.0.1") == "ticked a"
    assert calls(log) == [{"tool": "tick", "label": "a", "key": "run-1/r:1.0.1"}]


@pytest.mark.parametrize(
    ("tool", "error"),
    [
        ("fail", "MCP server counter answered an error: Error executing tool fail: no such thing as x"),
        ("garbage", "MCP server counter did not answer within 2 s"),
        ("die", "MCP server counter: Connection closed"),
    ],
)
def test_a_server_that_errs_answers_garbage_hangs_or_dies_is_a_one_line_error(counter, tool, error):
    hub, _ = counter
    with pytest.raises(McpError) as raised:
        hub.tools()[tool]({"label": "x"}, idempotency_key="k")
    assert str(raised.value) == error


def test_a_run_whose_server_dies_mid_call_halts_with_a_tool_error(tmp_path):
    log = tmp_path / "calls.jsonl"
    dying = machine(tmp_path, "dying", ("a", 'tool tick { label: "x" }'), ("b", 'tool die { label: "y" }'))
    result = mklang.run(dying, script=script(tmp_path), mcp=[f"counter={sys.executable} {COUNTER} {log}"])
    assert (result.status, result.error, result.at) == (
        "halted",
        "state-error: tool die: MCP server counter: Connection closed",
        "b",
    )


def test_a_server_that_does_not_start_is_a_usage_error_before_the_run(tmp_path):
    clock = machine(tmp_path, "clock", ("now", 'tool get_current_time { timezone: "UTC" }'))
    done = cli("run", str(clock), "--script", str(script(tmp_path)), "--mcp", f"time={tmp_path}/no-such-server")
    assert done.returncode == 2
    assert error_of(done).startswith("mklang: error: MCP server time cannot be used: [Errno 2]")


@pytest.mark.crash
def test_a_kill_mid_call_repeats_at_most_that_call_with_the_same_key(tmp_path):
    log = tmp_path / "calls.jsonl"
    server = f"counter={sys.executable} {COUNTER} {log}"
    three = machine(
        tmp_path,
        "three",
        ("first", 'tool tick { label: "first" }'),
        ("second", 'tool slow { label: "second", seconds: 1 }'),
        ("third", 'tool tick { label: "third" }'),
    )
    checkpoint = tmp_path / "cp.json"
    args = ["--script", str(script(tmp_path)), "--mcp", server]
    running = subprocess.Popen(
        [sys.executable, "-m", "mklang", "run", str(three), "--checkpoint", str(checkpoint), *args],
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not any(call["tool"] == "slow" for call in calls(log)):
            assert running.poll() is None and time.monotonic() < deadline, "the run never reached the slow call"
            time.sleep(0.02)
        os.kill(running.pid, signal.SIGKILL)  # the client only: its server sees its input close
        running.wait(10)
    finally:
        if running.poll() is None:
            os.killpg(running.pid, signal.SIGKILL)
    resumed = cli("resume", str(checkpoint), *args, "--format", "json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["result"] == "ticked third"
    made = [(call["tool"], call["label"]) for call in calls(log)]
    assert made == [("tick", "first"), ("slow", "second"), ("slow", "second"), ("tick", "third")]
    keys = [call["key"] for call in calls(log)]
    assert keys[1] == keys[2] and len(set(keys)) == 3 and all(keys)
