"""The typer application: one module per group of commands registers on `app`.

Command modules keep their heavy imports inside the command bodies. Every
command runs inside `handle_errors`, which turns an `MklangError` into one
error, printed once, and the documented exit code: a line on stderr, or, when
the command prints JSON, the one JSON document on stdout. A traceback is shown
only with MKLANG_DEBUG=1.
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import typer
from typer._click import exceptions as click_errors

from mklang import exitcodes
from mklang.cli.coercion import convert_plainly
from mklang.terminal import printable

app = typer.Typer(
    name="mklang",
    help="Run, check and resume LLM agent state machines written in .mk files.",
    no_args_is_help=True,
    add_completion=True,
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


# Set by `handle_errors(as_json=True)`: errors then go to stdout as the one JSON document, not to stderr.
_JSON_ERRORS: ContextVar[bool] = ContextVar("json_errors", default=False)


def print_json(data: Any) -> None:
    """One JSON document on stdout (results are printed without loading the renderer)."""
    sys.stdout.write(json.dumps(finite(data), indent=2, ensure_ascii=False, default=str, allow_nan=False) + "\n")


def finite(value: Any) -> Any:
    """`value` with every number JSON cannot hold (NaN, Infinity, which only a host's Python value
    can bring) as its name in a string, so JSON output is always JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value).replace("inf", "Infinity").replace("nan", "NaN")
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def fail(message: str, code: int = exitcodes.USAGE, diagnostics: list | None = None) -> typer.Exit:
    """Report an error once, and return the Exit to raise: in JSON mode as the one document on
    stdout (a script reads it there, and nothing else is printed for it), else as one line on
    stderr, or as the rendered `diagnostics` with their source lines."""
    from mklang.errors import redacted

    message = redacted(message)  # a store or broker URI in it keeps its password
    if _JSON_ERRORS.get():
        document = {"status": "error", "error": message, "exit_code": code}
        if diagnostics is not None:
            document["diagnostics"] = [d.to_json() for d in diagnostics]
        print(json.dumps(finite(document), ensure_ascii=False, allow_nan=False))
    elif diagnostics is not None:
        from mklang.syntax.diagnostics import render_text

        print(render_text(diagnostics), file=sys.stderr)
    else:
        print(error_line(message), file=sys.stderr)
    return typer.Exit(code)


def error_line(message: str) -> str:
    """The one line an error is printed as (`mklang mcp` answers it as a tool error too)."""
    from mklang.errors import redacted

    return f"mklang: error: {printable(redacted(message))}"


def internal_error(error: Exception) -> str:
    """What a failure nobody planned for says, without its traceback."""
    return f"internal error: {type(error).__name__}: {error} (set MKLANG_DEBUG=1 for details)"


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
        raise fail(internal_error(error), 1) from None
    finally:
        _JSON_ERRORS.reset(token)


def version_callback(value: bool) -> None:
    if value:
        from mklang.version import __version__

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
    "diff": "history_cmds",
    "verify-resume": "history_cmds",
    "fork": "history_cmds",
    "check": "syntax_cmds",
    "fmt": "syntax_cmds",
    "config": "provider_cmds",
    "graph": "authoring_cmds",
    "lsp": "authoring_cmds",
    "runs": "scale_cmds",
    "pool": "pool_cmds",
    "batch": "scale_cmds",
    "worker": "scale_cmds",
    "serve": "console_cmds",
    "tools": "mcp_cmds",
    "mcp": "mcp_cmds",
    "init": "setup_cmds",
    "doctor": "setup_cmds",
    "lint": "syntax_cmds",  # mklang 1.x's name of check
}


def _register_commands(args: list[str]) -> None:
    import importlib

    command = next((a for a in args if not a.startswith("-")), None)
    wanted = COMMAND_MODULES.get(command) if command else None
    # Help lists commands in registration order: the order of COMMAND_MODULES.
    modules = [wanted] if wanted else list(dict.fromkeys(COMMAND_MODULES.values()))
    for name in modules:
        importlib.import_module(f"mklang.cli.{name}")


# What `--format` each command prints when it is not given: commands printing JSON when
# piped also report their errors as a JSON document then (the rest only under --format json).
DEFAULT_FORMATS = {
    "run": "auto",
    "resume": "auto",
    "show": "auto",
    "diff": "auto",
    "fork": "auto",
    "config": "auto",
    "check": "text",
    "test": "text",
}


def json_errors_for(args: list[str]) -> bool:
    """Whether a command line that did not parse wants its error as a JSON document:
    under `--format json`, or when piped and its format is auto (or itself unreadable)."""
    command = next((a for a in args if not a.startswith("-")), None)
    if command in COMMAND_MODULES and command not in DEFAULT_FORMATS:
        return False  # fmt, graph, lsp print no JSON
    given = None
    for index, arg in enumerate(args):
        if arg == "--format" and index + 1 < len(args):
            given = args[index + 1]
        elif arg.startswith("--format="):
            given = arg.split("=", 1)[1]
    fmt = given if given is not None else DEFAULT_FORMATS.get(command or "", "auto")
    if fmt in ("json", "text"):
        return fmt == "json"
    return not sys.stdout.isatty()


def _given(option: str, args: list[str]) -> str | None:
    """The value a command line gave an option, as typed."""
    for index, arg in enumerate(args):
        if arg == option and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


def _expected(param: Any) -> str:
    """What a parameter takes, in the user's words."""
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    least = f" of at least {param.min}" if getattr(param, "min", None) is not None else ""
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "one of " + ", ".join(str(member.value) for member in annotation)
    if annotation is int:
        return f"a whole number{least}"
    if annotation is float:
        return f"a number{least}"
    return "a valid value"


def usage_words(error: click_errors.UsageError, args: list[str]) -> str:
    """A command line that did not parse, said the way the user typed it."""
    from mklang.cli.habits import command_1x, flag_1x
    from mklang.errors import did_you_mean

    if isinstance(error, click_errors.NoSuchOption):
        option = error.option_name
        command = error.ctx.command if error.ctx else None
        options = [name for param in command.params for name in param.opts] if command else []
        return f"unknown option {option}{flag_1x(option, options) or did_you_mean(option, error.possibilities or [])}"
    if isinstance(error, click_errors.BadOptionUsage):
        if "requires an argument" in error.format_message():
            return f"{error.option_name} needs a value"
        return f"{error.option_name} takes no value"
    param = getattr(error, "param", None)
    if isinstance(error, click_errors.MissingParameter) and param is not None:
        name = param.opts[0] if param.opts and param.opts[0].startswith("-") else param.name.upper()
        return f"missing {name} (see mklang {args[0] if args else ''} --help)".replace("  ", " ")
    if isinstance(error, click_errors.BadParameter) and param is not None:
        option = param.opts[0] if param.opts else param.name
        value = _given(option, args)
        got = f", got {value!r}" if value is not None else ""
        return f"{option} expects {_expected(param)}{got}"
    message = error.format_message()
    unknown = re.match(r"No such command '([^']*)'", message)
    if unknown:
        name = unknown.group(1)
        return f"unknown command {name!r}{command_1x(name) or did_you_mean(name, COMMAND_MODULES)}"
    extra = re.match(r"Got unexpected extra argument(?:s|\(s\))? \((.*)\)", message)
    if extra:
        return f"unexpected argument {extra.group(1)!r}"
    return message[:1].lower() + message[1:]


def _completion_for_named_shell(args: list[str]) -> None:
    """`--show-completion SHELL` / `--install-completion SHELL` for the shell named.

    typer's options are flags that detect the shell from the parent processes
    and ignore a name after them, so they fail (or serve another shell) where
    no shell runs the command, as under CI or an editor.
    """
    if len(args) != 2 or args[0] not in ("--show-completion", "--install-completion"):
        return
    from typer.completion import Shells, get_completion_script, install

    if args[1] not in Shells.__members__:
        fail(f"unknown shell {args[1]!r} (choose from {', '.join(Shells.__members__)})")
        raise SystemExit(exitcodes.USAGE)
    if args[0] == "--show-completion":
        print(get_completion_script(prog_name="mklang", complete_var="_MKLANG_COMPLETE", shell=args[1]))
    else:
        shell, path = install(shell=args[1], prog_name="mklang", complete_var="_MKLANG_COMPLETE")
        print(f"{shell} completion installed in {path}\nCompletion will take effect once you restart the terminal")
    raise SystemExit(0)


_BUILT: dict[tuple[int, ...], Any] = {}


def _click_command() -> Any:
    """`app` as a click command, built once for each set of registered commands: building it reads
    every command's signature (about 15 ms), which a process running commands in turn paid each time."""
    registered = tuple(map(id, [*app.registered_commands, *app.registered_groups]))
    if registered not in _BUILT:
        _BUILT[registered] = typer.main.get_command(app)
    return _BUILT[registered]


def run_app(args: list[str]) -> None:
    """Run a command; a command line that does not parse gets the one error shape too."""
    _completion_for_named_shell(args)
    _register_commands(args)
    convert_plainly()
    try:
        code = _click_command()(args=args, prog_name="mklang", standalone_mode=False)
    except click_errors.NoArgsIsHelpError:
        code = exitcodes.USAGE  # the help has been printed
    except click_errors.UsageError as error:
        token = _JSON_ERRORS.set(json_errors_for(args))
        try:
            fail(usage_words(error, args))
        finally:
            _JSON_ERRORS.reset(token)
        code = exitcodes.USAGE
    except typer.Abort:
        code = exitcodes.INTERRUPTED
    raise SystemExit(code or 0)
