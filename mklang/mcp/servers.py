"""The MCP servers a host takes tools from: `[mcp.servers.NAME]` in the host config, `--mcp NAME=COMMAND`.

A server is started as a command (stdio) or reached at a URL (streamable HTTP).
Its tools are effectful unless it annotates them `readOnlyHint: true`; the
host's `read_only` and `effectful` lists win over what the server says, as the
host implements nothing here but decides what it trusts (ADR 0021).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from mklang.errors import UsageError

SERVER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a machine may qualify a tool with it: `time__get_current_time`
DEFAULT_TIMEOUT = 60.0  # seconds a server has to answer one call


@dataclass(frozen=True)
class McpServer:
    """One MCP server: how to reach it, how long to wait for it, and the host's word on its tools."""

    name: str
    command: tuple[str, ...] = ()
    url: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    read_only: frozenset[str] = frozenset()
    effectful: frozenset[str] = frozenset()

    def describe(self) -> str:
        """How it is reached, as a person would write it (the note of a config not yet allowed)."""
        return (
            f"connects to the MCP server {self.name} at {self.url}"
            if self.url
            else (f"starts the MCP server {self.name} ({shlex.join(self.command)})")
        )


def parse_option(text: str) -> McpServer:
    """`NAME=COMMAND ARGS...` (split as a shell would) or `NAME=http(s)://...`: a `--mcp` value."""
    name, sep, rest = text.partition("=")
    if not sep or not rest.strip():
        raise UsageError(f"--mcp {text!r}: expected NAME=COMMAND or NAME=URL")
    table: dict[str, Any] = {"url": rest.strip()} if _is_url(rest.strip()) else {"command": _split(rest, text)}
    return server(name.strip(), table, "--mcp")


def parse_servers(table: Any, where: str) -> tuple[McpServer, ...]:
    """The `[mcp]` table of a config: `[mcp.servers.NAME]` tables, nothing else."""
    if not isinstance(table, dict) or set(table) - {"servers"}:
        raise UsageError(f"{where}: [mcp] holds only [mcp.servers.NAME] tables")
    servers = table.get("servers", {})
    if not isinstance(servers, dict):
        raise UsageError(f"{where}: [mcp.servers] must be a table of servers")
    return tuple(server(name, entry, f"{where}: [mcp.servers.{name}]") for name, entry in servers.items())


def server(name: str, table: Any, where: str) -> McpServer:
    """One server from its table: exactly one of `command` (a list of strings) and `url`."""
    if not SERVER_NAME.fullmatch(name):
        raise UsageError(f"{where}: server name {name!r} must be letters, digits and _ (not starting with a digit)")
    if not isinstance(table, dict):
        raise UsageError(f"{where}: must be a table")
    unknown = sorted(set(table) - {"command", "url", "timeout", "read_only", "effectful"})
    if unknown:
        raise UsageError(f"{where}: unknown key {unknown[0]!r} (expected command, url, timeout, read_only, effectful)")
    command, url = table.get("command"), table.get("url")
    if (command is None) == (url is None):
        raise UsageError(f'{where}: give exactly one of command = [...] (stdio) and url = "..." (HTTP)')
    if command is not None and (
        not isinstance(command, list) or not command or not all(isinstance(part, str) and part for part in command)
    ):
        raise UsageError(f"{where}: command must be a non-empty list of strings")
    if url is not None and not (isinstance(url, str) and _is_url(url)):
        raise UsageError(f"{where}: url must be an http:// or https:// URL")
    timeout = table.get("timeout", DEFAULT_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 86400:
        raise UsageError(f"{where}: timeout must be a number of seconds above 0 (at most a day)")
    read_only, effectful = (_names(table.get(key, []), f"{where}: {key}") for key in ("read_only", "effectful"))
    both = sorted(read_only & effectful)
    if both:
        raise UsageError(f"{where}: tool {both[0]!r} cannot be both read_only and effectful")
    return McpServer(name, tuple(command or ()), url, float(timeout), read_only, effectful)


def _names(value: Any, where: str) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise UsageError(f"{where} must be a list of tool names")
    return frozenset(value)


def _is_url(text: str) -> bool:
    parts = urlsplit(text)
    return parts.scheme in ("http", "https") and bool(parts.netloc)


def _split(command: str, given: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError as error:
        raise UsageError(f"--mcp {given!r}: {error}") from None
