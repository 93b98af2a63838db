"""Command-line entry point.

`mklang --version` is answered before typer (and everything else) is imported,
so the most common probe of the tool costs only the interpreter's start-up;
a plain `mklang check FILE...` is answered without typer too (`check_fast`),
and plain `run`, `test` and `resume` command lines skip typer's coercion (`plain`).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--version"]:
        from mklang.version import __version__

        print(f"mklang {__version__}")
        raise SystemExit(0)
    if args[:1] == ["check"]:
        from mklang.cli.check_fast import main as check_main

        code = check_main(args[1:])
        if code is not None:
            raise SystemExit(code)
    if args[:1] and args[0] in ("run", "test", "resume"):
        from mklang.cli.plain import main as plain_main

        code = plain_main(args)
        if code is not None:
            raise SystemExit(code)
    from mklang.cli.app import run_app

    run_app(args)
