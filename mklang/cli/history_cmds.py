"""`mklang diff` (two runs compared step by step, mklang.comparison), `mklang verify-resume`
(resume parity of a machine's scenarios, mklang.verification) and `mklang fork` (a run from any
step of another, its prefix replayed from the source's trace, mklang.forking)."""

from __future__ import annotations

from pathlib import Path

import typer

from mklang import exitcodes
from mklang.cli.app import OutputFormat, app, fail, handle_errors, print_json, wants_json
from mklang.cli.hosting import Hosting, hosted
from mklang.cli.run_cmds import (
    Output,
    RunFlags,
    SetOpt,
    interrupts,
    observed,
    report,
    reported,
    run_options,
)
from mklang.limits import parse_assignments


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


@app.command()
@hosted()
@run_options
@reported
def fork(
    source: str = typer.Argument(..., help="The run to fork: a checkpoint file, or STORE-URI#RUN (finished or not)."),
    at: str = typer.Option(..., "--at", metavar="STEP", help="The step it starts at: 7, or 4.2 inside a call."),
    set_: list[str] | None = SetOpt,
    machine: Path | None = typer.Option(None, "--machine", help="Run this machine file from the step on."),
    checkpoint: str | None = typer.Option(None, "--checkpoint", help="The fork's own checkpoint (a file)."),
    store: str | None = typer.Option(None, "--store", metavar="URI#NAME", help="The fork's own run in a store."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Say where it starts and what it may run again, running nothing."
    ),
    options: RunFlags = RunFlags(),
    hosting: Hosting = Hosting(),
    output: Output = Output(),
) -> None:
    """A new run that replays the source's steps before STEP from its trace (no call paid again),
    applies the --set edits at that loop-top, and goes on live; the source is never changed."""
    with handle_errors(output.as_json):
        from mklang import runs
        from mklang.engine import Control
        from mklang.forking import fork as forked
        from mklang.forking import preview, read_source, step_path
        from mklang.syntax import load_file

        if (checkpoint is None) == (store is None) and not dry_run:
            raise fail("fork needs one place of its own: --checkpoint FILE or --store URI#NAME")
        path = step_path(at)
        read = read_source(source)
        other = load_file(machine) if machine is not None else None
        if dry_run:
            shown = preview(read, path, other)
            if output.as_json:
                print_json(shown.to_json())
            else:
                print(shown.text())
            return
        place = checkpoint or store
        edits = parse_assignments(set_)
        request = runs.RunRequest(reply=edits, checkpoint=place, hosting=hosting.settings, **options.keywords())
        control = Control()
        with interrupts(control), observed(output) as observer:
            result = forked(read, path, request, machine=other, control=control, observer=observer)
        report(result, output.as_json, place)
