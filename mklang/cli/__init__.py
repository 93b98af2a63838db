"""Command-line entry point.

`mklang --version` is answered before typer (and everything else) is imported,
so the most common probe of the tool costs only the interpreter's start-up;
every other command line is parsed by the typer application (`mklang.cli.app`).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--version"]:
        from mklang.version import __version__

        print(f"mklang {__version__}")
        raise SystemExit(0)
    from mklang.cli.app import run_app

    run_app(args)
