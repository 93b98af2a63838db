"""`mklang diff` (two runs compared step by step, mklang.comparison) and `mklang verify-resume`
(resume parity of a machine's scenarios, mklang.verification)."""

from __future__ import annotations

from pathlib import Path

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


@app.command("verify-resume")
def verify_resume(
    machine: Path = typer.Argument(..., help="The machine file."),
    script: Path = typer.Option(..., "--script", help="The scenario script (YAML) that answers its calls."),
    scenario: list[str] | None = typer.Option(None, "--scenario", help="Only these scenarios."),
    plugin: list[str] | None = typer.Option(
        None, "--plugin", help="Host tools and hooks (a module or .py file with TOOLS/HOOKS) beside the script's."
    ),
    every: bool = typer.Option(False, "--every", help="Crash at every occurrence of each point, not a spread of six."),
    format: OutputFormat = typer.Option(OutputFormat.text, "--format", help="text or json."),
) -> None:
    """Suspend each scenario at every loop-top and kill it at every crash point, resume each, and
    check it ends as the uninterrupted run with no call answered twice; exit 1 at the first divergence."""
    as_json = wants_json(format)
    with handle_errors(as_json):
        from mklang.checker import require_runnable
        from mklang.host.plugins import load_plugins
        from mklang.scenarios import load_script, named
        from mklang.syntax import load_file
        from mklang.verification import verify

        loaded = require_runnable(load_file(machine))
        scenarios = named(load_script(script), scenario, script)
        tools, hooks = load_plugins(plugin or [])
        results = [verify(loaded, item, tools, hooks, every=every) for item in scenarios]
        if as_json:
            print_json([result.to_json() for result in results])
        else:
            for result in results:
                print(result.text())
    failed = any(result.divergence is not None for result in results)
    raise typer.Exit(exitcodes.HALT if failed else exitcodes.OK)
