"""`mklang check` without typer: the checking itself, and a plain argument reader.

Typer builds pydantic adapters for every parameter when a command runs,
which costs more than parsing and checking a machine. `mklang check FILE...
[--format text|json|auto]` is therefore answered here directly (see
`mklang.cli.main`); anything else (`--help`, an unknown option) goes through
the typer command in `syntax_cmds`, which calls the same `check_paths`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mklang import exitcodes
from mklang.vocabulary import MK_SUFFIX

FORMATS = ("text", "json", "auto")


def expand(paths: list[Path]) -> list[Path]:
    """Files as given; directories searched for `*.mk`."""
    files: list[Path] = []
    for path in paths:
        files += sorted(path.rglob(f"*{MK_SUFFIX}")) if path.is_dir() else [path]
    return files


def check_paths(paths: list[Path], as_json: bool) -> int:
    """Check every file, print the diagnostics, and return the exit code."""
    import json

    from mklang.checker import check_file
    from mklang.syntax.diagnostics import render_text, summary, wants_color

    files = expand(paths)
    found = [diagnostic for path in files for diagnostic in check_file(path)]
    if as_json:
        print(json.dumps([d.to_json() for d in found], indent=2))
    else:
        if found:
            print(render_text(found, color=wants_color(sys.stderr)), file=sys.stderr)
        print(summary(found, len(files)), file=sys.stderr)
    return exitcodes.USAGE if any(d.severity == "error" for d in found) else exitcodes.OK


def read_arguments(args: list[str]) -> tuple[list[Path], bool] | None:
    """(files, as_json) for a plain `check` command line, or None to let typer handle it."""
    files, output_format = [], "text"
    rest = iter(args)
    for arg in rest:
        if arg == "--format":
            output_format = next(rest, "")
        elif arg.startswith("--format="):
            output_format = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            return None
        else:
            files.append(Path(arg))
    if not files or output_format not in FORMATS:
        return None
    as_json = output_format == "json" or (output_format == "auto" and not sys.stdout.isatty())
    return files, as_json


def main(args: list[str]) -> int | None:
    """The exit code of `mklang check ARGS`, or None when typer should take the command."""
    parsed = read_arguments(args)
    if parsed is None:
        return None
    try:
        return check_paths(*parsed)
    except Exception as error:
        if os.environ.get("MKLANG_DEBUG") == "1":
            raise
        print(
            f"mklang: error: internal error: {type(error).__name__}: {error} (set MKLANG_DEBUG=1 for details)",
            file=sys.stderr,
        )
        return exitcodes.HALT
