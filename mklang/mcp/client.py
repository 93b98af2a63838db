"""The tools of MCP servers as host tools `(dict, idempotency_key) -> str` (docs/mcp.md, ADR 0047).

The engine calls tools from its threads and journals each result as it does a
host tool's (the call goes through the same tool-call path), so exactly once
holds as it does for every tool: a kill mid-call repeats at most that call,
which carries the run's idempotency key in `_meta`. The SDK is asynchronous,
so one event loop in a thread of its own keeps every server's session open
for as long as the host lives; a call waits at most the server's timeout.
Whatever goes wrong with a server (it does not start, dies, hangs, answers
what is no tool result) is an `McpError`: one line, which the run reports as
`state-error: tool NAME: ...`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import re
import sys
import threading
from collections.abc import Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from mklang.errors import MklangError, UsageError
from mklang.mcp.servers import McpServer

START_TIMEOUT = 60.0  # seconds a server may take to start and list its tools, however short its call timeout
IDEMPOTENCY_META = "idempotency_key"  # the `_meta` key a call's idempotency key travels under


class McpError(MklangError):
    """An MCP server that cannot be used, or a call of it that failed: one line."""


@dataclass(frozen=True)
class Listed:
    """One tool a server lists: its name there, its description and whether the host treats it read-only."""

    server: str
    name: str
    description: str
    read_only: bool
    annotated: bool  # whether the server said `readOnlyHint: true` (the host may say otherwise)


def classify(server: McpServer, name: str, read_only_hint: bool | None, read_only_tools: frozenset[str]) -> bool:
    """Read-only when the host says so (the server's `read_only`, the config's `[tools] read_only`),
    else when the server annotates it `readOnlyHint: true`; the server's `effectful` list wins over both."""
    if name in server.effectful:
        return False
    if name in server.read_only or name in read_only_tools or qualified(server.name, name) in read_only_tools:
        return True
    return read_only_hint is True


class McpTool:
    """A host tool that calls one tool of one server."""

    def __init__(self, hub: McpHub, listed: Listed):
        self.hub = hub
        self.listed = listed
        self.read_only = listed.read_only  # what `effects.host_read_only` reads
        self.__doc__ = listed.description

    def __call__(self, input: dict, idempotency_key: str) -> str:
        return self.hub.call(self.listed.server, self.listed.name, input, idempotency_key)


class Ambiguous:
    """A tool name two servers list: calling it says how to name the one meant."""

    def __init__(self, name: str, servers: list[str]):
        self.name = name
        self.servers = servers

    def __call__(self, input: dict) -> str:
        raise McpError(ambiguity(self.name, self.servers))


def ambiguity(name: str, servers: list[str]) -> str:
    names = " or ".join(qualified(server, name) for server in servers)
    return f"listed by the MCP servers {' and '.join(servers)}: name it {names}"


def spelled(tool: str) -> str:
    """A tool's name as a machine can write it: each character a `.mk` name cannot hold becomes `_`."""
    return re.sub(r"[^A-Za-z0-9_]", "_", tool)


def qualified(server: str, tool: str) -> str:
    """A tool's name with its server's, which a machine may use whatever other servers list."""
    return f"{server}__{tool}"


class McpHub:
    """The open sessions of a host's MCP servers, on one event loop in a thread of its own."""

    def __init__(self, servers: Iterable[McpServer], read_only_tools: frozenset[str] = frozenset()):
        self.servers = {server.name: server for server in servers}
        self.read_only_tools = read_only_tools
        self.listed: list[Listed] = []
        self._sessions: dict[str, Any] = {}
        self._stops: list[asyncio.Event] = []
        self._served: list[concurrent.futures.Future[None]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mklang-mcp", daemon=True)
        self._thread.start()

    def connect(self) -> McpHub:
        """Start (or reach) every server and list its tools; a server that cannot be used closes them all."""
        try:
            for server in self.servers.values():
                self._open(server)
        except BaseException:
            self.close()
            raise
        return self

    def tools(self) -> dict[str, Any]:
        """Every tool by `server__tool`, and by its bare name when one server alone lists it; a name
        with characters a `.mk` name cannot hold (`get-sum`) is also spelled with `_` for them (`get_sum`)."""
        by_name: dict[str, list[Listed]] = {}
        found: dict[str, Any] = {}
        for listed in self.listed:
            for name in dict.fromkeys((listed.name, spelled(listed.name))):
                found[qualified(listed.server, name)] = McpTool(self, listed)
                by_name.setdefault(name, []).append(listed)
        for name, listings in by_name.items():
            if len(listings) == 1:
                found[name] = McpTool(self, listings[0])
            else:
                found[name] = Ambiguous(name, [listed.server for listed in listings])
        return found

    def _open(self, server: McpServer) -> None:
        ready: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
        stop = asyncio.Event()
        self._stops.append(stop)
        self._served.append(asyncio.run_coroutine_threadsafe(self._serve(server, ready, stop), self._loop))
        starting = max(server.timeout, START_TIMEOUT)
        try:
            tools = ready.result(timeout=starting)
        except concurrent.futures.TimeoutError:
            raise McpError(f"MCP server {server.name} did not start within {starting:g} s") from None
        except Exception as error:
            raise McpError(f"MCP server {server.name} cannot be used: {_reason(error)}") from None
        for tool in tools:
            annotations = getattr(tool, "annotations", None)
            hint = getattr(annotations, "read_only_hint", None)
            self.listed.append(
                Listed(
                    server.name,
                    str(tool.name),
                    str(tool.description or ""),
                    classify(server, str(tool.name), hint, self.read_only_tools),
                    hint is True,
                )
            )

    async def _serve(self, server: McpServer, ready: concurrent.futures.Future[list[Any]], stop: asyncio.Event) -> None:
        """Hold the server's session open until the hub closes (the SDK's scopes must end in the task
        that entered them); tell `ready` its tools, or why there are none."""
        from mcp import ClientSession
        from mcp.types import PaginatedRequestParams

        try:
            async with AsyncExitStack() as stack:
                streams = await stack.enter_async_context(_transport(server))
                session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await session.initialize()
                tools: list[Any] = []
                cursor = None
                while True:
                    params = None if cursor is None else PaginatedRequestParams(cursor=cursor)
                    page = await session.list_tools(params=params)
                    tools.extend(page.tools)
                    cursor = page.next_cursor
                    if cursor is None:
                        break
                self._sessions[server.name] = session
                ready.set_result(tools)
                await stop.wait()
        except BaseException as error:  # the SDK raises groups and cancellations too
            if not ready.done():
                ready.set_exception(error if isinstance(error, Exception) else McpError("the connection was closed"))
            if not isinstance(error, Exception):
                raise

    def call(self, server: str, tool: str, arguments: dict[str, Any], idempotency_key: str) -> str:
        """The text a tool answers; an error result, a dead or silent server, or an answer that is
        not a tool result raises `McpError`."""
        limit = self.servers[server].timeout
        session = self._sessions.get(server)
        if session is None:
            raise McpError(f"MCP server {server} is not connected")
        call = session.call_tool(tool, arguments, meta={IDEMPOTENCY_META: idempotency_key})
        pending = asyncio.run_coroutine_threadsafe(asyncio.wait_for(call, limit), self._loop)
        try:
            result = pending.result(timeout=limit + 5)
        except (concurrent.futures.TimeoutError, TimeoutError):
            pending.cancel()
            raise McpError(f"MCP server {server} did not answer within {limit:g} s") from None
        except Exception as error:
            raise McpError(f"MCP server {server}: {_reason(error)}") from None
        return _observation(server, result)

    def close(self) -> None:
        """End every session (a stdio server's input closes, so it exits) and the loop's thread."""
        if self._loop.is_closed():
            return
        for stop in self._stops:
            self._loop.call_soon_threadsafe(stop.set)
        for served in self._served:
            with contextlib.suppress(BaseException):  # a server that fails while closing changes nothing now
                served.result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()


def _transport(server: McpServer) -> Any:
    """The SDK's stdio or streamable HTTP transport for `server`."""
    if server.url is not None:
        from mcp.client.streamable_http import streamable_http_client

        return streamable_http_client(server.url)
    from mcp import StdioServerParameters, stdio_client

    errlog = sys.stderr if _has_fileno(sys.stderr) or sys.__stderr__ is None else sys.__stderr__
    return stdio_client(StdioServerParameters(command=server.command[0], args=list(server.command[1:])), errlog)


def _has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


def _observation(server: str, result: Any) -> str:
    """The text blocks of a tool result, one per line, else its structured content as JSON."""
    texts = [block.text for block in getattr(result, "content", None) or [] if getattr(block, "type", None) == "text"]
    if getattr(result, "is_error", False):
        said = " ".join(" ".join(texts).split()) or "no reason given"
        raise McpError(f"MCP server {server} answered an error: {said}")
    if texts:
        return "\n".join(texts)
    structured = getattr(result, "structured_content", None)
    if structured is not None:
        return json.dumps(structured, ensure_ascii=False)
    raise McpError(f"MCP server {server} answered no text")


def _reason(error: BaseException) -> str:
    """One line for what the SDK raised (an exception group says what its first member does)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    text = " ".join(str(error).split())
    return text or type(error).__name__


def require_sdk() -> None:
    """A usage error naming the extra when the SDK is not installed."""
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise UsageError("MCP servers need the mcp extra: pip install 'mklang[mcp]>=2'") from None
