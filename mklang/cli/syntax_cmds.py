"""`mklang check` and `mklang fmt`: diagnostics and canonical formatting of machine files.

Diagnostics go to stderr (or, with `--format json`, one JSON list on
stdout); formatted text and results go to stdout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from mklang import exitcodes
from mklang.cli.app import OutputFormat, app, fail, handle_errors, wants_json
from mklang.vocabulary import MK_SUFFIX


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


@app.command("check")
def check_command(
    files: list[Path] = typer.Argument(..., help="Machine files (.mk, .mkl, .yaml) or directories of .mk files."),
    output_format: OutputFormat = typer.Option(OutputFormat.text, "--format", help="text (stderr) or json (stdout)."),
) -> None:
    """Report errors and warnings; exit 2 when there is any error."""
    with handle_errors(wants_json(output_format)):
        code = check_paths(files, wants_json(output_format))
    raise typer.Exit(code)


@app.command("fmt")
def fmt_command(
    files: list[Path] = typer.Argument(..., help="Machine files or directories of .mk files."),
    check: bool = typer.Option(False, "--check", help="List files that are not canonical; exit 1 if any."),
    write: bool = typer.Option(False, "--write", help="Rewrite files in place (YAML machines are written as .mk)."),
) -> None:
    """Print machines in the canonical .mk layout (YAML machines convert to .mk)."""
    from mklang.errors import LoadError
    from mklang.syntax import format_machine, load_file
    from mklang.syntax.diagnostics import render_text, wants_color
    from mklang.vocabulary import YAML_SUFFIXES

    if check and write:
        raise fail("--check and --write cannot be combined")
    with handle_errors():
        failed, changed = False, []
        for path in expand(files):
            try:
                text = format_machine(load_file(path))
            except LoadError as error:
                print(render_text(error.diagnostics, color=wants_color(sys.stderr)), file=sys.stderr)
                failed = True
                continue
            is_yaml = path.suffix.lower() in YAML_SUFFIXES
            if check:
                if is_yaml or path.read_text(encoding="utf-8") != text:
                    changed.append(path)
            elif write:
                target = path.with_suffix(MK_SUFFIX) if is_yaml else path
                if is_yaml or path.read_text(encoding="utf-8") != text:
                    target.write_text(text, encoding="utf-8")
                    print(f"wrote {target}", file=sys.stderr)
            else:
                sys.stdout.write(text)
        for path in changed:
            print(path)
        if changed:
            import shlex

            files_text = " ".join(shlex.quote(str(path)) for path in changed)
            count = f"{len(changed)} file{'s' if len(changed) > 1 else ''}"
            print(f"{count} would be reformatted; fix with: mklang fmt --write {files_text}", file=sys.stderr)
    if failed:
        raise typer.Exit(exitcodes.USAGE)
    raise typer.Exit(exitcodes.HALT if changed else exitcodes.OK)
