"""`mklang tools` (the tools MCP servers give machines, and whether a machine's tools are among
them) and `mklang mcp` (machines as the tools of an MCP server): docs/mcp.md. The `mcp` SDK is
the `mcp` extra, imported only in these command bodies."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from mklang import exitcodes
from mklang.cli.app import OutputFormat, app, fail, handle_errors, print_json, wants_json
from mklang.cli.hosting import Hosting, hosted
from mklang.cli.run_cmds import UntrustedFlowOpt, parse_duration, policy
from mklang.errors import Diagnostic

McpOpt = typer.Option(
    None, "--mcp", metavar="NAME=COMMAND", help="An MCP server: NAME=COMMAND or NAME=URL. Repeatable."
)


@app.command()
def tools(
    machines: list[Path] | None = typer.Argument(None, help="Machines whose tool states must name a listed tool."),
    mcp: list[str] | None = McpOpt,
    config: Path | None = typer.Option(None, "--config", help="Host config TOML ([mcp.servers.NAME], [tools])."),
    plugins: list[str] | None = typer.Option(None, "--plugin", metavar="MODULE|FILE.py", help="Host tools too."),
    output_format: OutputFormat = typer.Option(OutputFormat.auto, "--format", help="auto, text or json."),
) -> None:
    """List the tools of the MCP servers configured, read-only or effectful; with machines, report a
    tool state naming a tool no server, plugin or built-in has, or one two servers list (exit 2)."""
    from mklang.host.config import load_config
    from mklang.host.plugins import load_plugins
    from mklang.host.registry import BUILTIN_TOOLS, as_registry
    from mklang.session import connect_mcp

    as_json = wants_json(output_format)
    with handle_errors(as_json):
        hub = connect_mcp(list(mcp or []), load_config(config))
        try:
            listed = hub.listed if hub else []
            plugin_tools, _ = load_plugins(list(plugins or []))
            host = as_registry("mklang.tools", BUILTIN_TOOLS, {**(hub.tools() if hub else {}), **plugin_tools})
            found = [d for path in machines or [] for d in tool_findings(path, host, listed)]
        finally:
            if hub is not None:
                hub.close()
        rows = [
            {
                "name": item.name,
                "server": item.server,
                "read_only": item.read_only,
                "annotated_read_only": item.annotated,
                "description": item.description,
            }
            for item in listed
        ]
        if as_json:
            print_json({"tools": rows, "diagnostics": [d.to_json() for d in found]})
        else:
            for row in rows:
                effect = "read-only" if row["read_only"] else "effectful"
                said = "" if row["read_only"] == row["annotated_read_only"] else " (the host's word)"
                described = str(row["description"]).strip()
                first = described.splitlines()[0] if described else ""
                print(f"{row['server']}__{row['name']}\t{effect}{said}\t{first}")
            if found:
                from mklang.syntax.diagnostics import render_text, wants_color

                print(render_text(found, color=wants_color(sys.stderr)), file=sys.stderr)
    raise typer.Exit(exitcodes.USAGE if any(d.severity == "error" for d in found) else exitcodes.OK)


def tool_findings(path: Path, host: Any, listed: list[Any]) -> list[Diagnostic]:
    """An error at each tool state (of the machine and those it calls) whose tool nothing implements,
    or whose bare name two MCP servers list."""
    from mklang.mcp.client import Ambiguous, ambiguity
    from mklang.model import ToolUse
    from mklang.syntax import load_file
    from mklang.syntax.machines import machine_tree

    servers = sorted({item.server for item in listed})
    found = []
    for machine in machine_tree(load_file(path)):
        for state in machine.states:
            if not isinstance(state.face, ToolUse):
                continue
            name = state.face.tool
            tool = host.get(name)
            if isinstance(tool, Ambiguous):
                message, code = f'tool "{name}" is {ambiguity(name, tool.servers)}', "tool-ambiguous"
            elif tool is None:
                among = f"the MCP servers {', '.join(servers)}" if servers else "no MCP server configured"
                message, code = f'tool "{name}" is listed by none of {among}, nor a plugin or built-in', "tool-missing"
            else:
                continue
            span = state.face.span or state.span
            found.append(
                Diagnostic(
                    machine.path,
                    span.line if span else 1,
                    span.col if span else 1,
                    span.end_line if span else 1,
                    span.end_col if span else 1,
                    "error",
                    code,
                    message,
                )
            )
    return found


@app.command("mcp")
@hosted("record")
def mcp_server(
    store: str = typer.Option("mklang-runs", "--store", help="Where runs persist: a folder or a store URI."),
    http: str | None = typer.Option(
        None, "--http", metavar="HOST:PORT", help="Serve streamable HTTP here (port 0: a free one), not stdio."
    ),
    machines: list[Path] | None = typer.Option(
        None, "--machines", metavar="DIR", help="A folder machines are run from (default: this one). Repeatable."
    ),
    max_tokens: int | None = typer.Option(None, "--max-tokens", min=1, help="Ceiling of every run's tokens."),
    max_cost: float | None = typer.Option(None, "--max-cost", min=0.0, help="Ceiling of every run's dollars."),
    max_time: str | None = typer.Option(None, "--max-time", metavar="DURATION", help="Ceiling of a run's time."),
    untrusted_flow: str | None = UntrustedFlowOpt,
    hosting: Hosting = Hosting(),
) -> None:
    """Serve machines as the tools of an MCP server: check, describe, run, resume, answer, show, runs."""
    with handle_errors():
        try:
            from mklang.mcp import server
        except ImportError as error:
            if (error.name or "").split(".")[0] in ("mcp", "anyio", "uvicorn", "starlette", "pydantic"):
                raise fail("mklang mcp needs the mcp extra: pip install 'mklang[mcp]>=2'", exitcodes.USAGE) from None
            raise
        from mklang.mcp.tools import Owner
        from mklang.stores import open_store

        folders = [folder.resolve() for folder in machines or [Path.cwd()]]
        missing = [str(folder) for folder in folders if not folder.is_dir()]
        if missing:
            raise fail(f"--machines {missing[0]}: not a folder")
        ceilings = {"max_tokens": max_tokens, "max_cost": max_cost, "max_time": parse_duration(max_time)}
        opened = open_store(store)
        owner = Owner(folders, opened, store, ceilings, policy(untrusted_flow), hosting.settings)
        try:
            if http is None:
                server.serve_stdio(owner)
            else:
                host, sep, port = http.rpartition(":")
                if not sep or not port.isdigit() or not host:
                    raise fail(f"--http expects HOST:PORT (127.0.0.1:8766, port 0: a free one), got {http!r}")
                server.serve_http(owner, host.strip("[]"), int(port))
        finally:
            opened.close()
