"""`mklang mcp`: machines as the tools of an MCP server, over stdio or streamable HTTP (docs/mcp.md).

The seven tools are declared once with typed parameters, from which the SDK
derives their input schemas; each answers a typed document (its output
schema) or a tool error whose text is the one line the CLI prints. The work
is `mklang.mcp.tools`', run in a worker thread (the engine is synchronous);
the run's events reach the caller as progress notifications. Over HTTP the
server listens on the loopback by default, and every request must carry the
token printed at start-up (`Authorization: Bearer TOKEN`), as the console's
pages need theirs (ADR 0031).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Annotated, Any, Literal

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field

from mklang.cli.app import debug_enabled, error_line, internal_error
from mklang.cli.listening import LOOPBACK, bind
from mklang.engine.events import Event
from mklang.errors import MklangError, redacted
from mklang.mcp import tools
from mklang.version import __version__


class Question(BaseModel):
    id: str = Field(description="Name it when answering: an answer to another question changes nothing.")
    ask: str | None
    reply_to: str | None = Field(description="Where the answer goes in the run's context.")
    answer_with: str
    choices: list[str] | None = Field(
        default=None, description="A decision's answers: answer with one of them as `choice` (and a `note`)."
    )
    deadline: str | None = Field(default=None, description="When the decision times out (ISO 8601, UTC).")


class RunOutcome(BaseModel):
    run: str = Field(description="The run's name in the server's store: resume, answer or show it by this name.")
    status: Literal["done", "halted", "suspended"]
    reason: str | None = Field(description="Why a suspended run waits (escalated: a question; a budget; ...).")
    error: str | None = Field(description="Why a halted run ended.")
    at: str | None
    result: Any = None
    question: Question | None
    usage: dict[str, Any]


class Diagnosed(BaseModel):
    machine: str
    ok: bool
    diagnostics: list[dict[str, Any]]


class GateShape(BaseModel):
    when: str
    policy: str
    to: str | None
    ask: str | None
    reply_to: str | None


class StateShape(BaseModel):
    name: str
    does: str
    output: str
    gates: list[GateShape]


class Described(BaseModel):
    name: str
    entry: str
    budget: int = Field(description="The machine's step budget.")
    result: str | None
    context: dict[str, Any]
    tools: list[str]
    states: list[StateShape]
    budgets: dict[str, float | None] = Field(description="This server's ceilings: a run may ask for less.")
    mermaid: str


class Shown(BaseModel):
    model_config = ConfigDict(extra="allow")
    status: str | None = None


class Listing(BaseModel):
    runs: list[dict[str, Any]]


MaxTokens = Annotated[int | None, Field(description="At most this many tokens (at most the server's ceiling).", gt=0)]
MaxCost = Annotated[float | None, Field(description="At most this many dollars (at most the server's ceiling).", gt=0)]
MaxTime = Annotated[float | None, Field(description="At most this many seconds (at most the server's ceiling).", gt=0)]
Machine = Annotated[str, Field(description="A machine file, relative to a folder the server runs machines from.")]
RunName = Annotated[str, Field(description="The run's name, as run, runs or a question gave it.")]
READ_ONLY = ToolAnnotations(read_only_hint=True)
RUNS = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=True)


def build(owner: tools.Owner) -> MCPServer[Any]:
    """The MCP server of `owner`'s machines and store, its seven tools registered."""
    server: MCPServer[Any] = MCPServer(
        "mklang",
        version=__version__,
        instructions="Run mklang machines; a run that asks a question suspends: answer it with `answer`.",
        log_level="WARNING",
    )

    @server.tool(annotations=READ_ONLY)
    async def check(machine: Machine) -> Annotated[CallToolResult, Diagnosed]:
        """The static checks of a machine: its errors and warnings, as `mklang check` reports them."""
        return await _answer(Diagnosed, partial(tools.check, owner, machine))

    @server.tool(annotations=READ_ONLY)
    async def describe(machine: Machine) -> Annotated[CallToolResult, Described]:
        """A machine's states and gates, its budgets and this server's, and its graph as Mermaid."""
        return await _answer(Described, partial(tools.describe, owner, machine))

    @server.tool(annotations=RUNS)
    async def run(
        machine: Machine,
        ctx: Context,
        context: Annotated[dict[str, Any] | None, Field(description="Values set in the run's context.")] = None,
        max_tokens: MaxTokens = None,
        max_cost: MaxCost = None,
        max_time: MaxTime = None,
    ) -> Annotated[CallToolResult, RunOutcome]:
        """Run a machine to its end or its first question (then answer it with `answer`)."""
        asked = {"max_tokens": max_tokens, "max_cost": max_cost, "max_time": max_time}
        sink = Progress(ctx)
        return await _answer(RunOutcome, partial(tools.run, owner, machine, dict(context or {}), asked, sink))

    @server.tool(annotations=RUNS)
    async def resume(
        run: RunName,
        ctx: Context,
        max_tokens: MaxTokens = None,
        max_cost: MaxCost = None,
        max_time: MaxTime = None,
    ) -> Annotated[CallToolResult, RunOutcome]:
        """Continue a suspended or interrupted run of the store (new budgets, at most the server's)."""
        asked = {"max_tokens": max_tokens, "max_cost": max_cost, "max_time": max_time}
        return await _answer(RunOutcome, partial(tools.resume, owner, run, None, asked, Progress(ctx)))

    @server.tool(annotations=RUNS)
    async def answer(
        run: RunName,
        question: Annotated[str, Field(description="The id of the question answered.")],
        ctx: Context,
        reply: Annotated[
            str | None, Field(description="A free-text answer (JSON is read as a value, anything else as text).")
        ] = None,
        choice: Annotated[str | None, Field(description="A decision's answer: one of its `choices`.")] = None,
        note: Annotated[str | None, Field(description="Free text that goes with a choice.", max_length=4000)] = None,
    ) -> Annotated[CallToolResult, RunOutcome]:
        """Answer the question a run waits on and continue the run: a decision with one of its
        `choices` (and a `note`), a free-text question with a `reply`. Refused, changing nothing, when
        the run no longer waits on that question (someone answered it first, or it timed out) or the
        choice is not one of its choices."""
        asked: dict[str, float | None] = {}
        answering = tools.Answering(question, reply, choice, note)
        return await _answer(RunOutcome, partial(tools.resume, owner, run, answering, asked, Progress(ctx)))

    @server.tool(annotations=READ_ONLY)
    async def show(
        run: RunName,
        last: Annotated[int, Field(description="How many of its last steps to include.", ge=0, le=1000)] = 5,
    ) -> Annotated[CallToolResult, Shown]:
        """A run of the store: status, reason, frames, spend against budgets, last steps, pending question."""
        return await _answer(Shown, partial(tools.show, owner, run, last))

    @server.tool(annotations=READ_ONLY)
    async def runs(
        status: Annotated[
            list[Literal["running", "suspended", "done", "halted", "failed"]] | None,
            Field(description="Only runs with one of these statuses."),
        ] = None,
        limit: Annotated[int, Field(description="At most this many runs, newest first.", ge=1, le=1000)] = 50,
    ) -> Annotated[CallToolResult, Listing]:
        """The runs of the store, newest first: status, reason or question, spend, times."""
        return await _answer(Listing, partial(tools.listing, owner, list(status or []), limit))

    return server


async def _answer(model: type[BaseModel], work: Callable[[], dict[str, Any]]) -> CallToolResult:
    """`work` done in a worker thread, answered as `model`'s document, or as the one line of its error."""
    try:
        data = await anyio.to_thread.run_sync(work)
    except MklangError as error:
        return _failed(error_line(str(error)))
    except Exception as error:
        if debug_enabled():
            raise
        return _failed(error_line(internal_error(error)))
    document = model.model_validate(data).model_dump(mode="json")
    return CallToolResult(content=[TextContent(type="text", text=json.dumps(document))], structured_content=document)


def _failed(line: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=line)], is_error=True)


class Progress:
    """An event sink that tells the caller of each state a run enters and how it stops, as progress
    notifications (the engine emits from its threads; the notification is sent on the server's loop)."""

    SHOWN = frozenset({"state.entered", "run.suspended", "run.halted", "run.finished"})

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.loop = asyncio.get_running_loop()
        self.count = 0

    def emit(self, event: Event) -> None:
        if event.kind not in self.SHOWN:
            return
        self.count += 1
        state = getattr(event, "state", None) or getattr(event, "at", None)
        message = f"{event.kind} {state}" if state else event.kind
        report: Awaitable[None] = self.ctx.report_progress(self.count, None, message)
        asyncio.run_coroutine_threadsafe(report, self.loop)  # type: ignore[arg-type]


def serve_stdio(owner: tools.Owner) -> None:
    """Answer one client on stdin and stdout until it closes them."""
    build(owner).run()


def serve_http(owner: tools.Owner, host: str, port: int) -> None:
    """Serve streamable HTTP at /mcp until interrupted, every request with the token printed here."""
    import uvicorn

    listening = bind(host, port)
    token = secrets.token_urlsafe(32)
    app = build(owner).streamable_http_app(host=host)
    bound = listening.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    if host not in LOOPBACK:
        print(
            f"mklang: warning: listening on {host}:{bound}: anyone who can reach this machine on that port and "
            f"has the token can run this server's machines and answer the questions of {redacted(owner.uri)}",
            file=sys.stderr,
        )
    print(f"mklang MCP server: http://{shown}:{bound}/mcp (header Authorization: Bearer {token})", flush=True)
    config = uvicorn.Config(Bearer(app, token), log_level="warning", access_log=False, lifespan="on")
    uvicorn.Server(config).run(sockets=[listening])


class Bearer:
    """ASGI middleware: an HTTP request without `Authorization: Bearer TOKEN` is answered 401."""

    def __init__(self, app: Any, token: str):
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                body = b'{"error": "this MCP server needs the token it printed: Authorization: Bearer TOKEN"}'
                headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
                await send({"type": "http.response.start", "status": 401, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
