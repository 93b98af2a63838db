"""`mklang check` (and 1.x's `lint`) and `mklang fmt`: diagnostics and canonical formatting of machine files.

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
    cost: bool = typer.Option(
        False, "--cost", help="Also print each machine's fewest and most steps, calls, tokens, dollars."
    ),
    prompt_tokens: int | None = typer.Option(
        None, "--prompt-tokens", min=1, help="With --cost: the most tokens a call's prompt takes."
    ),
    config: Path | None = typer.Option(
        None, "--config", help="With --cost: the host config whose routes and prices count."
    ),
    provider: str | None = typer.Option(None, "--provider", help="With --cost: the provider of every tier."),
    model: str | None = typer.Option(None, "--model", help="With --cost: the model of every tier."),
) -> None:
    """Report errors and warnings; exit 2 when there is any error. With --cost, the bounds of what a
    run can cost (stdout), after the diagnostics of machines that are well formed."""
    as_json = wants_json(output_format)
    pricing = {"--prompt-tokens": prompt_tokens, "--config": config, "--provider": provider, "--model": model}
    with handle_errors(as_json):
        if not cost and (given := [name for name, value in pricing.items() if value is not None]):
            raise fail(f"{', '.join(given)} only take effect with --cost")
        if not cost:
            raise typer.Exit(check_paths(files, as_json))
        code = check_paths(files, False) if not as_json else _errors_only(files)
        if code != exitcodes.OK:
            raise typer.Exit(code)
        from mklang.cli.cost_report import report

        code = report(expand(files), as_json, prompt_tokens, config, provider, model)
    raise typer.Exit(code)


@app.command("lint", hidden=True)
def lint(
    files: list[Path] = typer.Argument(..., help="Machine files (.mk, .mkl, .yaml) or directories of .mk files."),
    output_format: OutputFormat = typer.Option(OutputFormat.text, "--format", help="text (stderr) or json (stdout)."),
) -> None:
    """mklang 1.x's `lint`: runs `mklang check`."""
    print("mklang: lint is mklang check in mklang 2: running mklang check", file=sys.stderr)
    as_json = wants_json(output_format)
    with handle_errors(as_json):
        raise typer.Exit(check_paths(files, as_json))


def _errors_only(paths: list[Path]) -> int:
    """With --cost in JSON, stdout holds the bounds: diagnostics of a machine that has errors go to stderr."""
    from mklang.checker import check_file
    from mklang.syntax.diagnostics import render_text

    found = [d for path in expand(paths) for d in check_file(path) if d.severity == "error"]
    if found:
        print(render_text(found, color=False), file=sys.stderr)
        return exitcodes.USAGE
    return exitcodes.OK


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
                machine = load_file(path)
            except LoadError as error:
                print(render_text(error.diagnostics, color=wants_color(sys.stderr)), file=sys.stderr)
                failed = True
                continue
            text = format_machine(machine)
            is_yaml = path.suffix.lower() in YAML_SUFFIXES
            if is_yaml and not check:
                print(version_note(path, machine.version), file=sys.stderr)
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


def version_note(path: Path, version: str | None) -> str:
    """What `fmt` did to the language version of a YAML machine it printed as `.mk`: kept, never raised."""
    from mklang.vocabulary import LANGUAGE_VERSION

    if version is None:
        return f"{path}: printed as .mk without a version line, as the YAML had none"
    current = "" if version == LANGUAGE_VERSION else f"; this release's is {LANGUAGE_VERSION}: edit the line to upgrade"
    return f"{path}: printed as .mk with its language version kept: mklang {version}{current}"
