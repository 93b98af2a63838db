"""The typer application: one module per group of commands registers on `app`.

Command modules keep their heavy imports inside the command bodies. Every
command runs inside `handle_errors`, which turns an `MklangError` into one
line on stderr and the documented exit code; a traceback is shown only with
MKLANG_DEBUG=1.
"""

from __future__ import annotations

import enum
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import typer

from mklang import exitcodes
from mklang.terminal import printable

app = typer.Typer(
    name="mklang",
    help="Run, check and resume LLM agent state machines written in .mk files.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class OutputFormat(str, enum.Enum):
    auto = "auto"
    text = "text"
    json = "json"


def wants_json(fmt: OutputFormat) -> bool:
    """`auto` means JSON when stdout is not a terminal."""
    if fmt is OutputFormat.auto:
        return not sys.stdout.isatty()
    return fmt is OutputFormat.json


def debug_enabled() -> bool:
    return os.environ.get("MKLANG_DEBUG") == "1"


# Set by `handle_errors(as_json=True)`: errors then also go to stdout as the one JSON document.
_JSON_ERRORS: ContextVar[bool] = ContextVar("json_errors", default=False)


def print_json(data: Any) -> None:
    """One JSON document on stdout (results are printed without loading the renderer)."""
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n")


def fail(message: str, code: int = exitcodes.USAGE, diagnostics: list | None = None) -> typer.Exit:
    """Report an error (one line on stderr; in JSON mode also a document on stdout)
    and return the Exit to raise."""
    if diagnostics is None:
        print(f"mklang: error: {printable(message)}", file=sys.stderr)
    if _JSON_ERRORS.get():
        document = {"status": "error", "error": message, "exit_code": code}
        if diagnostics is not None:
            document["diagnostics"] = [d.to_json() for d in diagnostics]
        print(json.dumps(document, ensure_ascii=False))
    return typer.Exit(code)


@contextmanager
def handle_errors(as_json: bool = False) -> Iterator[None]:
    """Map expected failures to one line and an exit code; re-raise in debug mode.

    With `as_json`, stdout holds exactly one JSON document even on failure.
    """
    from mklang.errors import CheckpointError, LoadError, MklangError

    token = _JSON_ERRORS.set(as_json)
    try:
        yield
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except LoadError as error:
        if debug_enabled():
            raise
        from mklang.syntax.diagnostics import render_text

        print(render_text(error.diagnostics), file=sys.stderr)
        raise fail(str(error), exitcodes.USAGE, diagnostics=error.diagnostics) from None
    except (CheckpointError, MklangError) as error:
        if debug_enabled():
            raise
        raise fail(str(error)) from None
    except KeyboardInterrupt:
        if debug_enabled():
            raise
        print("mklang: interrupted", file=sys.stderr)
        raise typer.Exit(exitcodes.INTERRUPTED) from None
    except Exception as error:
        if debug_enabled():
            raise
        raise fail(f"internal error: {type(error).__name__}: {error} (set MKLANG_DEBUG=1 for details)", 1) from None
    finally:
        _JSON_ERRORS.reset(token)


def version_callback(value: bool) -> None:
    if value:
        from mklang import __version__

        print(f"mklang {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=version_callback, is_eager=True, help="Print the version."
    ),
) -> None:
    """Run, check and resume LLM agent state machines written in .mk files."""


# Which module defines each command. Only the module of the command being run
# is imported, which keeps start-up short; help imports them all.
COMMAND_MODULES = {
    "run": "run_cmds",
    "test": "run_cmds",
    "resume": "run_cmds",
    "show": "run_cmds",
    "check": "syntax_cmds",
    "fmt": "syntax_cmds",
    "config": "provider_cmds",
    "graph": "authoring_cmds",
    "lsp": "authoring_cmds",
}


def _register_commands(args: list[str]) -> None:
    import importlib

    command = next((a for a in args if not a.startswith("-")), None)
    wanted = COMMAND_MODULES.get(command) if command else None
    # Help lists commands in registration order: the order of COMMAND_MODULES.
    modules = [wanted] if wanted else list(dict.fromkeys(COMMAND_MODULES.values()))
    for name in modules:
        importlib.import_module(f"mklang.cli.{name}")


def run_app(args: list[str]) -> None:
    _register_commands(args)
    app(args=args, prog_name="mklang")
