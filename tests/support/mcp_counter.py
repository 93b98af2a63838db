"""A small MCP server written with the SDK, for the tests of MCP tools in machines: every call it
receives is appended to the JSON Lines file named by its first argument (tool, label and the
idempotency key of the call's `_meta`), so a test counts what the server was asked.

Run as `python tests/support/mcp_counter.py LOG`. Tools: `tick` (effectful by its annotations),
`peek` (read-only by them), `slow` (answers after `seconds`), `fail` (a tool error), `die` (the
process exits mid-call), `garbage` (writes what is no JSON-RPC to stdout and never answers).
"""

from __future__ import annotations

import json
import os
import sys
import time

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

LOG = sys.argv[1]
server = MCPServer("counter")


def _log(tool: str, label: str, ctx: Context) -> None:
    meta = ctx.request_context.meta or {}
    with open(LOG, "a", encoding="utf-8") as log:
        log.write(json.dumps({"tool": tool, "label": label, "key": meta.get("idempotency_key")}) + "\n")
        log.flush()
        os.fsync(log.fileno())


@server.tool(annotations=ToolAnnotations(read_only_hint=False))
def tick(label: str, ctx: Context) -> str:
    """Count one call."""
    _log("tick", label, ctx)
    return f"ticked {label}"


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def peek(label: str, ctx: Context) -> str:
    """Count one call that changes nothing."""
    _log("peek", label, ctx)
    return f"peeked {label}"


@server.tool()
def slow(label: str, seconds: float, ctx: Context) -> str:
    """Count one call, then answer after `seconds`."""
    _log("slow", label, ctx)
    time.sleep(seconds)
    return f"slept {label}"


@server.tool()
def fail(label: str) -> str:
    """Answer a tool error."""
    raise ToolError(f"no such thing as {label}")


@server.tool()
def die(label: str) -> str:
    """Exit in the middle of the call."""
    os._exit(3)


@server.tool()
def garbage(label: str) -> str:
    """Write what is no JSON-RPC message where the answer should be, then say nothing."""
    os.write(1, b'this is not JSON-RPC\n{"jsonrpc": "2.0", "id": "nope"}\n')
    time.sleep(60)
    return "never"


if __name__ == "__main__":
    server.run()
