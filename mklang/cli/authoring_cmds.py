"""Authoring commands: `graph` (the machine as a diagram) and `lsp` (the language server).

Both import their implementation inside the command body, so neither the
graph code nor pygls is loaded by any other command.
"""

from __future__ import annotations

import enum
import sys
from functools import partial
from pathlib import Path

import typer

from mklang import exitcodes
from mklang.cli.app import app, fail, handle_errors


class GraphFormat(str, enum.Enum):
    mermaid = "mermaid"
    dot = "dot"
    svg = "svg"


def _sealed_trace(checkpoint: Path, frame: dict) -> list[dict]:
    """The whole trace of a checkpoint's frame that names trace segments, read (and checked) through its store."""
    from mklang.checkpoint.segments import recorded_trace
    from mklang.stores import locate

    return [dict(step) for step in recorded_trace(locate(checkpoint), frame, trusted=False)]


@app.command()
def graph(
    machine: Path = typer.Argument(..., help="The machine file (.mk, .mkl, .yaml)."),
    fmt: GraphFormat = typer.Option(GraphFormat.mermaid, "--format", "-f", help="Diagram language."),
    trace: Path | None = typer.Option(
        None, "--trace", help="Highlight the path of a run: `mklang run --format json` output or a checkpoint."
    ),
) -> None:
    """Print the machine as a Mermaid state diagram, Graphviz DOT or SVG."""
    with handle_errors():
        from mklang.graph import load_trace, render
        from mklang.syntax import load_file

        loaded = load_file(machine)
        steps = load_trace(trace, loaded, partial(_sealed_trace, trace)) if trace is not None else None
        sys.stdout.write(render(loaded, fmt.value, steps))


@app.command()
def lsp() -> None:
    """Run the language server over stdio (install the lsp extra: pip install "mklang\\[lsp]>=2")."""
    with handle_errors():
        try:
            from mklang.lsp.server import serve
        except ImportError as error:
            if (error.name or "").split(".")[0] in ("pygls", "lsprotocol"):
                raise fail("the language server needs pygls: pip install 'mklang[lsp]>=2'", exitcodes.USAGE) from None
            raise
        serve()
