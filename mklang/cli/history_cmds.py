"""`mklang diff`: two runs compared step by step (mklang.comparison)."""

from __future__ import annotations

import typer

from mklang import exitcodes
from mklang.cli.app import OutputFormat, app, handle_errors, print_json, wants_json


@app.command()
def diff(
    first: str = typer.Argument(..., help="A run: a checkpoint file, or STORE-URI#RUN."),
    second: str = typer.Argument(..., help="The run to compare it with."),
    format: OutputFormat = typer.Option(OutputFormat.auto, "--format", help="auto, text or json."),
) -> None:
    """The first step where two runs differ, then every differing step (state, gate and policy,
    output, usage) and how their outcomes differ; exit 0 when they agree, 1 when they differ."""
    as_json = wants_json(format)
    with handle_errors(as_json):
        from mklang.comparison import compare, render, run_of

        difference = compare(run_of(first), run_of(second))
        if as_json:
            print_json(difference)
        else:
            print(render(difference, first, second))
    raise typer.Exit(exitcodes.OK if difference["same"] else exitcodes.HALT)
