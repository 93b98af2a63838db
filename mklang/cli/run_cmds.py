"""`mklang run`, `test`, `resume` and `show`."""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import typer

from mklang import exitcodes
from mklang.cli.app import OutputFormat, app, fail, handle_errors, print_json, wants_json
from mklang.cli.groups import grouped, option
from mklang.cli.hosting import Hosting, hosted
from mklang.cli.observe import AnswerStream, EventsOpt, StreamOpt, TraceContentOpt, event_stream
from mklang.limits import load_json_object, parse_assignments, read_text
from mklang.terminal import printable
from mklang.vocabulary import DEFAULT_RUN_CONCURRENCY, FLOW_POLICIES

if TYPE_CHECKING:
    from mklang.engine import RunResult
    from mklang.engine.decisions import Decision
    from mklang.model import Machine
    from mklang.runs import Resumable


# Options shared by `run`, `resume` and `batch`; the host options are in `mklang.cli.hosting`.
SetOpt = typer.Option(
    None, "--set", metavar="K.PATH=VALUE", help="Set a context value (JSON when it parses, else text). Repeatable."
)
FormatOpt = typer.Option(OutputFormat.auto, "--format", help="auto: rich on a terminal, JSON when piped.")
MaxTokensOpt = typer.Option(None, "--max-tokens", min=0, help="Token budget of the whole run (a new total on resume).")
MaxCostOpt = typer.Option(None, "--max-cost", min=0.0, help="Dollar budget of the whole run (needs prices).")
MaxTimeOpt = typer.Option(
    None, "--max-time", metavar="DURATION", help="Wall-clock budget of this process: 90s, 10m, 1h30m."
)
ConcurrencyOpt = typer.Option(
    None, "--concurrency", min=1, help=f"Calls in flight for the whole run (default {DEFAULT_RUN_CONCURRENCY})."
)
HitlOpt = typer.Option(None, "--hitl/--no-hitl", help="Escalate gates suspend for a human reply.")
ReplaceOpt = typer.Option(
    False, "--replace", help="Replace whatever the --checkpoint holds, even a run that is not finished."
)
UntrustedFlowOpt = typer.Option(
    None,
    "--untrusted-flow",
    metavar="report|halt",
    help="When a judge reading outside data chose the way to an effectful tool: "
    "report it in the trace (default) or halt before the tool runs.",
)


class Output(NamedTuple):
    """Where a command's run events and its result go: `--events`, `--trace-content`, `--format`."""

    events: str | None = None
    trace_content: bool = False
    format: OutputFormat = OutputFormat.auto

    @property
    def as_json(self) -> bool:
        return wants_json(self.format)


class RunFlags(NamedTuple):
    """How a run may go, as `run` and `resume` are told: its budgets, human gates, flow policy and concurrency."""

    replace: bool = False
    hitl: bool | None = None
    untrusted_flow: str | None = None
    max_tokens: int | None = None
    max_cost: float | None = None
    max_time: str | None = None
    concurrency: int | None = None

    def keywords(self) -> dict[str, Any]:
        """The keywords of `runs.start` and of a `runs.RunRequest` these flags give; a bad value is a usage error."""
        return {
            **self._asdict(),
            "untrusted_flow": policy(self.untrusted_flow),
            "max_time": parse_duration(self.max_time),
        }


# Gives a command `--events`, `--trace-content` and `--format`, passed to it as `output: Output`.
reported = grouped(
    "output",
    [
        option("events", str | None, EventsOpt),
        option("trace_content", bool, TraceContentOpt),
        option("format", OutputFormat, FormatOpt),
    ],
    Output,
)

# Gives a command the options of `RunFlags`, passed to it as `options: RunFlags`.
run_options = grouped(
    "options",
    [
        option("replace", bool, ReplaceOpt),
        option("hitl", bool | None, HitlOpt),
        option("untrusted_flow", str | None, UntrustedFlowOpt),
        option("max_tokens", int | None, MaxTokensOpt),
        option("max_cost", float | None, MaxCostOpt),
        option("max_time", str | None, MaxTimeOpt),
        option("concurrency", int | None, ConcurrencyOpt),
    ],
    RunFlags,
)


def policy(value: str | None) -> str | None:
    """`--untrusted-flow`: report or halt (None: the run's or checkpoint's own setting)."""
    if value is not None and value not in FLOW_POLICIES:
        raise fail(f"--untrusted-flow expects {' or '.join(FLOW_POLICIES)}, got {value!r}")
    return value


def parse_duration(text: str | None, option: str = "--max-time") -> float | None:
    """`90`, `90s`, `10m`, `1h30m`, `7d` -> seconds."""
    if text is None:
        return None
    number = r"(\d+(?:\.\d+)?)"
    match = re.fullmatch(rf"\s*(?:{number}d)?\s*(?:{number}h)?\s*(?:{number}m)?\s*(?:{number}s?)?\s*", text)
    if not match or not any(match.groups()):
        raise fail(f"{option} expects a duration such as 90s, 10m, 1h30m or 7d, got {text!r}")
    days, hours, minutes, seconds = (float(group or 0) for group in match.groups())
    return days * 86400 + hours * 3600 + minutes * 60 + seconds


@contextmanager
def interrupts(control, forward: Callable[[], object] | None = None, quiet: bool = False) -> Iterator[None]:
    """First SIGINT/SIGTERM: suspend (or stop) at the next loop-top. Second: exit now.

    `forward` passes each one on (to the processes of a spread batch) first; `quiet`: say nothing
    (a child of a spread batch, whose parent says it once)."""

    def handler(signum, frame):
        if forward is not None:
            forward()
        if control.interrupted.is_set():
            if not quiet:
                print("mklang: interrupted again: exiting now; the last durable checkpoint stays", file=sys.stderr)
            os._exit(exitcodes.INTERRUPTED)
        control.interrupted.set()
        if not quiet:
            print(
                "mklang: interrupt received: stopping at the next state boundary (again to exit now)", file=sys.stderr
            )

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def observed(output: Output, stream_answers: bool = False) -> Iterator[Any]:
    """What watches a run: the `--events` stream, the answers as they arrive (`--stream`, on
    stderr), else a live line of state and spend on a terminal (not when the events go to
    stderr); None when nothing does."""
    from mklang.engine.events import joined

    with event_stream(output.events, output.trace_content) as stream:
        if stream_answers:
            yield joined(AnswerStream(sys.stderr), stream)
            return
        if output.as_json or output.events == "-" or not sys.stderr.isatty():
            yield stream
            return
        from mklang.cli.render import LiveView

        with LiveView() as view:
            yield joined(view, stream)


def report(result, as_json: bool, checkpoint: str | None = None) -> None:
    """Print the result and exit with its code (SPEC section 7).

    A suspension also says which budget ran out and the command that
    continues it, read back from the checkpoint as `mklang show` does.
    """
    document = result.to_json()
    if result.status == "suspended" and checkpoint is not None:
        from mklang.runs.inspection import describe

        summary = describe(checkpoint, last=0)
        document.update(checkpoint=summary["path"], ran_out=summary["ran_out"], continue_with=summary["continue_with"])
    print_document(document, as_json)
    if result.status == "halted" and result.error == "interrupted":
        raise typer.Exit(exitcodes.INTERRUPTED)
    raise typer.Exit(exitcodes.EXIT_BY_STATUS[result.status])


def print_document(document: dict[str, Any], as_json: bool) -> None:
    """A run's document on stdout (JSON, or rendered), and on stderr the command that continues it."""
    if as_json:
        print_json(document)
    else:
        from mklang.cli.render import render_result

        render_result(document)
    if "continue_with" in document:
        from mklang.cli.render import stderr

        if document["ran_out"]:
            stderr.print(document["ran_out"], markup=False)
        line = f"checkpoint: {document['checkpoint']}; continue with: {document['continue_with']}"
        stderr.print(printable(line), markup=False, soft_wrap=True)  # one line, so it can be pasted


@app.command()
@hosted()
@run_options
@reported
def run(
    machine: Path = typer.Argument(..., help="The machine file (.mk, .mkl, .yaml)."),
    set_: list[str] | None = SetOpt,
    input_file: Path | None = typer.Option(None, "--input", help="JSON map merged into the context."),
    checkpoint: str | None = typer.Option(
        None, "--checkpoint", help="Persist the run here; suspend instead of halting on budgets."
    ),
    options: RunFlags = RunFlags(),
    hosting: Hosting = Hosting(),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Do not print the machine's check warnings."),
    stream: bool = StreamOpt,
    output: Output = Output(),
) -> None:
    """Run a machine."""
    with handle_errors(output.as_json):
        from mklang import runs
        from mklang.checker import require_runnable
        from mklang.cli.habits import machine_file
        from mklang.engine import Control
        from mklang.syntax import load_file

        as_json = output.as_json
        loaded = require_runnable(load_file(machine_file(machine)))
        where = run_name_of(checkpoint)
        if options.replace and checkpoint is None:
            raise fail("--replace replaces the run at a checkpoint: it needs --checkpoint")
        context: dict[str, Any] = {}
        if input_file is not None:
            context.update(_read_input(input_file))
        context.update(parse_assignments(set_))
        keywords = options.keywords()
        control = Control()
        host = runs.build_host(runs.RunRequest(hosting=hosting.settings, max_cost=options.max_cost))
        if not quiet:
            _print_warnings(loaded, {**(host.scenario.input if host.scenario else {}), **context})
        with host, interrupts(control), observed(output, stream) as observer:
            result = runs.start(loaded, context, host, checkpoint=where, **keywords, control=control, observer=observer)
        report(result, as_json, checkpoint)


def run_name_of(checkpoint: str | None) -> str | None:
    """The checkpoint a run is given, once its run name is checked (before the run prints or spends anything)."""
    if checkpoint is not None:
        from mklang.stores import split_target

        split_target(checkpoint)
    return checkpoint


def _print_warnings(machine: Machine, context: dict[str, Any]) -> None:
    """The machine's check warnings, one line each on stderr, before the run spends anything;
    the keys the run is given count as written."""
    from mklang.checker import check
    from mklang.syntax.diagnostics import render_one

    for diagnostic in check(machine, provided={key.split(".")[0] for key in context}):
        if diagnostic.severity == "warning":
            print(render_one(diagnostic, None), file=sys.stderr)


def _read_input(path: Path) -> dict[str, Any]:
    return load_json_object(read_text(path, "--input file"), str(path), "--input")


@app.command()
@hosted()
@run_options
@reported
def resume(
    checkpoint: str = typer.Argument(
        ..., help="The checkpoint of a suspended or crashed run: a file, or STORE-URI#RUN (docs/scale.md)."
    ),
    set_: list[str] | None = SetOpt,
    answer: str | None = typer.Option(
        None, "--answer", metavar="CHOICE", help="Answer the decision the run waits on with one of its choices."
    ),
    note: str | None = typer.Option(
        None, "--note", metavar="TEXT", help="A note that travels with the --answer (untrusted data)."
    ),
    question: str | None = typer.Option(
        None, "--question", metavar="ID", help="The question the --answer answers (default: the one pending)."
    ),
    budget: int | None = typer.Option(None, "--budget", min=0, help="New step budget of the innermost frame."),
    force: bool = typer.Option(False, "--force", help="Resume even if a machine file changed."),
    trust: bool = typer.Option(
        False,
        "--trust",
        help="Resume a checkpoint not signed with your key, as untrusted data: host settings from this command only.",
    ),
    allow_rollback: bool = typer.Option(
        False,
        "--allow-rollback",
        help="Resume an older generation of the run than one already written (a restored copy): "
        "what ran after it may repeat.",
    ),
    machine: Path | None = typer.Option(None, "--machine", help="Where the root machine file is now."),
    check: bool = typer.Option(
        False,
        "--check",
        help="Only check that the machines fit every frame (no provider, no spend); with --machine NEW, "
        "whether the run is compatible, migratable or incompatible with it; exit 0 or 2.",
    ),
    migrate: bool = typer.Option(
        False, "--migrate", help="Move the parked run to --machine NEW (if compatible or migratable), then resume it."
    ),
    map_: list[str] | None = typer.Option(
        None, "--map", metavar="OLD=NEW", help="With --migrate or --check: state OLD is named NEW now. Repeatable."
    ),
    out: str | None = typer.Option(
        None, "--checkpoint", help="Write a re-suspension here, a file or STORE-URI#RUN (default: the same)."
    ),
    options: RunFlags = RunFlags(),
    hosting: Hosting = Hosting(),
    stream: bool = StreamOpt,
    output: Output = Output(),
) -> None:
    """Continue a suspended, interrupted or crashed run."""
    with handle_errors(output.as_json):
        from mklang import runs
        from mklang.engine import Control

        if options.replace and out is None:
            raise fail("--replace replaces the run at another --checkpoint: it needs --checkpoint")
        if answer is None and (note is not None or question is not None):
            raise fail("--note and --question go with --answer CHOICE")
        decision: Decision | None = None
        if answer is not None:
            decision = {"choice": answer, "note": note, "question": question, "by": "human"}
        request = runs.RunRequest(
            source=checkpoint,
            reply=parse_assignments(set_),
            decision=decision,
            budget=budget,
            checkpoint=out,
            force=force,
            machine_path=str(machine) if machine else None,
            trust=trust,
            allow_rollback=allow_rollback,
            hosting=hosting.settings,
            **options.keywords(),
        )
        from mklang.checkpoint.migration import parse_map

        renames = parse_map(map_)
        moving = migrate or (check and (machine is not None or bool(renames)))
        if moving and machine is None:
            raise fail("--migrate and --map move a parked run to a new machine: they need --machine NEW")
        if check and moving:
            _report_verdict(runs.migrate(checkpoint, str(machine), renames, write=False), output.as_json)
        if check:
            with runs.opened(checkpoint, **request.opening()) as resumable:
                _report_compatible(resumable, output.as_json)
        control = Control()
        with interrupts(control), observed(output, stream) as observer:
            if migrate:
                result = runs.resume_migrated(request, str(machine), renames, control=control, observer=observer)
            else:
                result = runs.resume(request, control=control, observer=observer)
        report(result, output.as_json, out or checkpoint)


def _report_verdict(verdict: Any, as_json: bool) -> None:
    """`resume --check --machine NEW`: compatible or migratable (exit 0), or incompatible at a frame (exit 2)."""
    if as_json:
        print_json({"status": verdict.kind, "frame": verdict.frame, "reason": verdict.reason})
    else:
        print(verdict.text())
    raise typer.Exit(exitcodes.OK if verdict.movable else exitcodes.USAGE)


def _report_compatible(resumable: Resumable, as_json: bool) -> None:
    """`resume --check`: the checkpoint opened, so every frame fits its machine (an error said otherwise)."""
    frames = [f"{frame.machine.name}:{frame.state}" for frame in resumable.chain]
    if as_json:
        print_json({"status": "compatible", "frames": frames})
    else:
        print(f"compatible ({' > '.join(frames)})")
    raise typer.Exit(exitcodes.OK)


@app.command()
def show(
    checkpoint: str = typer.Argument(..., help="A checkpoint: a file, or STORE-URI#RUN (docs/scale.md)."),
    summary: bool = typer.Option(
        False, "--summary", help="The run's state instead: frames, spend against budgets, last steps, host."
    ),
    last: int = typer.Option(5, "--last", min=0, help="With --summary: how many of the last steps to show."),
    format: OutputFormat = FormatOpt,
) -> None:
    """What `mklang run` printed for a stored run: status, result, context, trace, usage, pending ask.

    `--format json` is the document of `run --format json` (less `calls`); `--summary` tells the
    run's state for an operator instead (docs/runs.md)."""
    with handle_errors(wants_json(format)):
        from mklang.runs.inspection import describe, run_document

        if not summary:
            print_document(run_document(checkpoint), wants_json(format))
            return
        described = describe(checkpoint, last=last)
        if wants_json(format):
            print_json(described)
        else:
            from mklang.cli.render import render_checkpoint

            render_checkpoint(described)


@app.command()
def test(
    machine: Path = typer.Argument(..., help="The machine file."),
    script: Path = typer.Option(..., "--script", help="The scenario script (YAML)."),
    scenario: list[str] | None = typer.Option(None, "--scenario", help="Only these scenarios."),
    untrusted_flow: str | None = UntrustedFlowOpt,
    events: str | None = EventsOpt,
    trace_content: bool = TraceContentOpt,
    format: OutputFormat = typer.Option(OutputFormat.text, "--format"),
) -> None:
    """Run the named scenarios of a script (resumes included) and compare them with their expectations."""
    with handle_errors(wants_json(format)):
        from mklang.checker import require_runnable
        from mklang.cli.habits import machine_file
        from mklang.cli.render import render_scenarios
        from mklang.player import play
        from mklang.scenarios import load_script, named
        from mklang.syntax import load_file

        loaded = require_runnable(load_file(machine_file(machine)))
        scenarios = named(load_script(script), scenario, script)
        chosen = policy(untrusted_flow)
        with event_stream(events, trace_content) as observer:
            outcomes = [(item, play(loaded, item, chosen, observer)) for item in scenarios]
        if wants_json(format):
            print_json([_outcome_json(item.name, parts) for item, parts in outcomes])
        else:
            render_scenarios(outcomes)
        failed = any(part.problems for _, parts in outcomes for part in parts)
        raise typer.Exit(exitcodes.HALT if failed else exitcodes.OK)


def _outcome_json(name: str, parts: list) -> dict[str, Any]:
    """One scenario in `mklang test --format json`: its verdict, then each part's outcome."""
    from mklang.scenarios import ending

    def outcome(result: RunResult) -> dict[str, Any]:
        data = result.to_json()
        return {key: data.get(key) for key in ("status", "error", "reason", "at")}

    return {
        "name": name,
        "passed": not any(part.problems for part in parts),
        "problems": [f"{part.label}: {p}" if part.label != "run" else p for part in parts for p in part.problems],
        **outcome(parts[-1].result),
        "ended": ending(parts[-1].result),
        "parts": [{"part": part.label, **outcome(part.result)} for part in parts],
    }
