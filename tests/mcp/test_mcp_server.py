"""`mklang mcp` driven by the SDK's own client (`ClientSession` over `stdio_client` and
`streamable_http_client`), as an agent would and as an attacker would (docs/mcp.md)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from support.commands import cli_env
from support.examples import HITL

import mklang
from mklang.graph import render

APPROVAL = HITL / "approval"  # the free-text question the `answer` tool replies to
SEVEN = ["answer", "check", "describe", "resume", "run", "runs", "show"]
PUBLISHED = "https://status.example.com/posts/118"


def server_args(tmp_path: Path, *extra: str) -> list[str]:
    """`mklang mcp` over the approval example's folder, answered by its ask-then-publish scenario."""
    return [
        "-m",
        "mklang",
        "mcp",
        "--store",
        str(tmp_path / "store"),
        "--machines",
        str(APPROVAL),
        "--script",
        str(APPROVAL / "scenarios.yaml"),
        "--scenario",
        "ask-then-publish",
        *extra,
    ]


@contextlib.asynccontextmanager
async def over_stdio(tmp_path: Path, *extra: str) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=sys.executable, args=server_args(tmp_path, *extra), env=cli_env())
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """`mklang mcp --http 127.0.0.1:0`: the URL and the token it printed."""
    server = subprocess.Popen(
        [sys.executable, *server_args(tmp_path, "--http", "127.0.0.1:0")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=cli_env(),
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line.startswith("mklang MCP server: http://127.0.0.1:"), line
        url, token = line.split()[3], line.split()[-1].rstrip(")")
        yield url, token
    finally:
        server.terminate()
        server.wait(10)


@contextlib.asynccontextmanager
async def over_http(url: str, token: str) -> AsyncIterator[ClientSession]:
    client = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
    async with (
        client,
        streamable_http_client(url, http_client=client) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


async def call(session: ClientSession, tool: str, **arguments: Any) -> dict[str, Any]:
    """A tool's document; a tool error fails the test with its line."""
    result = await session.call_tool(tool, arguments)
    assert not result.is_error, result.content
    assert result.structured_content is not None
    return result.structured_content


async def refused(session: ClientSession, tool: str, **arguments: Any) -> str:
    """The one line of a tool error."""
    result = await session.call_tool(tool, arguments)
    assert result.is_error, result.structured_content
    [content] = result.content
    text = getattr(content, "text", "")
    assert text.startswith("mklang: error: ") and "\n" not in text, text
    return text.removeprefix("mklang: error: ")


async def approve_to_the_end(session: ClientSession) -> None:
    """The seven tools listed, the approval example run to its question, answered, published."""
    listed = await session.list_tools()
    assert sorted(tool.name for tool in listed.tools) == SEVEN
    assert all(tool.input_schema["type"] == "object" and tool.output_schema for tool in listed.tools)
    progress: list[str] = []

    async def told(done: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    started = await session.call_tool("run", {"machine": "approval.mk"}, progress_callback=told)
    outcome = started.structured_content
    assert outcome is not None and not started.is_error
    assert (outcome["status"], outcome["reason"], outcome["at"]) == ("suspended", "escalated", "decide")
    assert outcome["question"]["ask"] == "Publish this announcement? Answer yes, or say what to change."
    assert outcome["question"]["reply_to"] == "approval.answer"
    assert progress[:2] == ["state.entered draft", "run.suspended decide"]
    shown = await call(session, "show", run=outcome["run"])
    assert shown["status"] == "suspended"
    done = await call(session, "answer", run=outcome["run"], question=outcome["question"]["id"], reply="yes, ship it")
    assert (done["status"], done["result"], done["run"]) == ("done", PUBLISHED, outcome["run"])
    listed_runs = await call(session, "runs")
    assert [(run["run"], run["status"]) for run in listed_runs["runs"]] == [(outcome["run"], "done")]


def test_over_stdio_an_agent_runs_the_approval_example_to_its_question_answers_it_and_gets_the_result(tmp_path):
    async def scenario() -> None:
        async with over_stdio(tmp_path) as session:
            await approve_to_the_end(session)

    anyio.run(scenario)


def test_over_http_with_the_printed_token_an_agent_does_the_same(http_server):
    url, token = http_server

    async def scenario() -> None:
        async with over_http(url, token) as session:
            await approve_to_the_end(session)

    anyio.run(scenario)


def test_over_http_a_request_without_the_token_is_refused(http_server):
    url, token = http_server
    for header in ({}, {"Authorization": "Bearer " + token[:-1] + "x"}):
        request = urllib.request.Request(url, data=b"{}", method="POST", headers=header)
        with pytest.raises(urllib.error.HTTPError) as refusal:
            urllib.request.urlopen(request, timeout=10)
        assert refusal.value.code == 401


def test_a_question_answered_from_another_connection_resumes_the_run(tmp_path):
    async def scenario() -> None:
        async with over_stdio(tmp_path) as first:
            outcome = await call(first, "run", machine="approval.mk")
        async with over_stdio(tmp_path) as second:
            question = outcome["question"]["id"]
            done = await call(second, "answer", run=outcome["run"], question=question, reply="yes, ship it")
            assert done["result"] == PUBLISHED

    anyio.run(scenario)


def test_two_clients_answering_one_question_one_wins_and_the_other_is_told(http_server):
    url, token = http_server

    async def scenario() -> None:
        async with over_http(url, token) as first, over_http(url, token) as second:
            outcome = await call(first, "run", machine="approval.mk")
            name, question = outcome["run"], outcome["question"]["id"]
            answers: list[Any] = []

            async def answer(session: ClientSession) -> None:
                answers.append(await session.call_tool("answer", {"run": name, "question": question, "reply": "yes"}))

            async with anyio.create_task_group() as both:
                both.start_soon(answer, first)
                both.start_soon(answer, second)
            won = [a.structured_content for a in answers if not a.is_error]
            lost = [a.content[0].text for a in answers if a.is_error]
            assert [w["result"] for w in won] == [PUBLISHED] and len(lost) == 1
            assert lost[0].startswith("mklang: error: ") and name in lost[0]
            shown = await call(first, "show", run=name, last=10)
            assert [step["state"] for step in shown["last_steps"]] == ["draft", "decide", "publish"]

    anyio.run(scenario)


def test_a_machine_outside_the_servers_folders_is_refused(tmp_path):
    folder = tmp_path / "machines"
    folder.mkdir()
    shutil.copy(APPROVAL / "approval.mk", folder / "approval.mk")
    outside = tmp_path / "outside.mk"
    shutil.copy(APPROVAL / "approval.mk", outside)
    os.symlink(outside, folder / "linked.mk")
    (folder / "notes.txt").write_text("not a machine\n", encoding="utf-8")
    inside = "is not a machine file inside the folders this server runs"

    async def scenario() -> None:
        async with over_stdio(tmp_path, "--machines", str(folder)) as session:
            for given in ("../outside.mk", str(outside), "linked.mk", "/etc/passwd", "sub/../../outside.mk"):
                assert inside in await refused(session, "run", machine=given)
                assert inside in await refused(session, "describe", machine=given)
            assert "is not a machine file (.mk" in await refused(session, "check", machine="notes.txt")
            assert (await call(session, "check", machine="approval.mk"))["ok"] is True
            assert not list((tmp_path / "store").glob("mcp-*"))  # nothing was run

    anyio.run(scenario)


def test_a_caller_may_lower_the_servers_budgets_never_raise_them(tmp_path):
    async def scenario() -> None:
        async with over_stdio(tmp_path, "--max-tokens", "1000", "--max-time", "10m") as session:
            described = await call(session, "describe", machine="approval.mk")
            assert described["budgets"] == {"max_tokens": 1000, "max_cost": None, "max_time": 600.0}
            assert described["mermaid"] == render(mklang.load(APPROVAL / "approval.mk"), "mermaid")
            assert [state["name"] for state in described["states"]] == ["draft", "decide", "publish"]
            assert described["states"][0]["gates"][0]["reply_to"] == "approval.answer"
            line = await refused(session, "run", machine="approval.mk", max_tokens=5000)
            assert (
                line
                == "max_tokens 5000 is refused: a caller may only lower a budget (above 0 and at most this server's 1000)"
            )
            assert "max_time 601" in await refused(session, "run", machine="approval.mk", max_time=601)
            lowered = await call(session, "run", machine="approval.mk", max_tokens=500)
            shown = await call(session, "show", run=lowered["run"])
            assert shown["tokens"]["budget"] == 500
            line = await refused(session, "resume", run=lowered["run"], max_tokens=2000)
            assert line.startswith("max_tokens 2000 is refused")

    anyio.run(scenario)


def test_a_forged_run_name_or_question_is_refused_and_changes_nothing(tmp_path):
    async def scenario() -> None:
        async with over_stdio(tmp_path) as session:
            outcome = await call(session, "run", machine="approval.mk")
            name, question = outcome["run"], outcome["question"]["id"]
            for forged in ("../../etc/passwd", "x/../../y", "", "mcp-" + "0" * 32):
                await refused(session, "answer", run=forged, question=question, reply="yes")
                await refused(session, "show", run=forged)
            line = await refused(session, "answer", run=name, question="0" * 16, reply="yes")
            assert (
                line
                == f"run {name} does not wait on question {'0' * 16} (it waits on question {question}): nothing changed"
            )
            still = await call(session, "show", run=name)
            assert (still["status"], still["reply_to"]) == ("suspended", "approval.answer")
            done = await call(session, "answer", run=name, question=question, reply="yes, ship it")
            assert done["result"] == PUBLISHED

    anyio.run(scenario)


def test_a_decision_is_answered_with_one_of_its_choices_bound_to_its_question(tmp_path):
    """The approval example's typed decision: the outcome names the decision's own id and choices;
    an answer that is not a choice, or names another question, is refused in the line `mklang
    resume --answer` prints, changing nothing; a choice and a note continue the run once."""
    from support.examples import EXAMPLES

    machines = tmp_path / "approval"
    shutil.copytree(EXAMPLES / "approval", machines)
    args = ["-m", "mklang", "mcp", "--store", str(tmp_path / "store"), "--machines", str(machines)]
    args += ["--script", str(machines / "scenarios.yaml"), "--scenario", "ask-then-publish"]

    async def scenario() -> None:
        params = StdioServerParameters(command=sys.executable, args=args, env=cli_env())
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            outcome = await call(session, "run", machine="approval.mk")
            name, question = outcome["run"], outcome["question"]
            assert question["choices"] == ["approve", "revise", "reject"] and question["deadline"]
            line = await refused(session, "answer", run=name, question=question["id"], choice="maybe")
            assert line.endswith(f"'maybe' is not a choice of question {question['id']}: approve, revise, reject")
            line = await refused(session, "answer", run=name, question="0" * 16, choice="approve")
            assert line.endswith(
                f"question {'0' * 16} was never asked by this run; the run waits on question {question['id']}"
            )
            line = await refused(session, "answer", run=name, question=question["id"], reply="approve")
            assert "is a decision, answered with --answer approve|revise|reject" in line
            assert (await call(session, "show", run=name))["status"] == "suspended"
            done = await call(session, "answer", run=name, question=question["id"], choice="approve", note="ok")
            assert (done["status"], done["result"]) == ("done", PUBLISHED)
            again = await refused(session, "answer", run=name, question=question["id"], choice="approve")
            assert "a finished run cannot be resumed" in again

    anyio.run(scenario)
