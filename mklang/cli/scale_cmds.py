"""`mklang runs`, `batch` and `worker`: many runs in one store (docs/scale.md)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from mklang.cli.app import OutputFormat, app, fail, handle_errors, print_json, wants_json
from mklang.cli.hosting import Hosting, hosted
from mklang.cli.observe import EventsOpt, TraceContentOpt, event_stream
from mklang.cli.run_cmds import FormatOpt, MaxTimeOpt, UntrustedFlowOpt, interrupts, parse_duration, policy
from mklang.vocabulary import DEFAULT_BATCH_CONCURRENCY, DEFAULT_WORKER_CONCURRENCY

StoreOpt = typer.Option(..., "--store", help="The checkpoint store: a folder, sqlite:///runs.db or postgresql://...")
STATUSES = ("running", "suspended", "done", "halted", "failed")


@app.command()
def runs(
    store: str = StoreOpt,
    status: list[str] | None = typer.Option(None, "--status", help="Only runs with this status. Repeatable."),
    format: OutputFormat = FormatOpt,
) -> None:
    """Every run of a store: status, reason, spend against budgets, position and pending ask."""
    with handle_errors(wants_json(format)):
        from mklang.batching import described
        from mklang.cli.render import render_runs
        from mklang.stores import open_store

        unknown = sorted(set(status or []) - set(STATUSES))
        if unknown:
            raise fail(f"--status expects one of {', '.join(STATUSES)}, got {', '.join(unknown)}")
        opened = open_store(store, create=False)
        try:
            listed = []
            for run in opened.runs():
                summary = described(opened, store, run)
                if not status or summary["status"] in status:
                    listed.append(summary)
        finally:
            opened.close()
        if wants_json(format):
            print_json(listed)
        else:
            render_runs(listed)


@app.command()
@hosted("provider", "model", "config", "script", "scenario", "replay", "plugin")
def batch(
    machine: Path = typer.Argument(..., help="The machine file run for every input."),
    inputs: Path = typer.Option(..., "--inputs", help="JSON Lines: one context object per run (its `id` names it)."),
    store: str = StoreOpt,
    out: Path | None = typer.Option(None, "--out", help="Write one result line per input here (JSON Lines)."),
    concurrency: int = typer.Option(DEFAULT_BATCH_CONCURRENCY, "--concurrency", min=1, help="Runs in flight at once."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", min=0, help="Token budget of each run."),
    max_cost: float | None = typer.Option(None, "--max-cost", min=0.0, help="Dollar budget of each run."),
    max_time: str | None = MaxTimeOpt,
    batch_tokens: int | None = typer.Option(None, "--batch-max-tokens", min=0, help="Tokens for the whole batch."),
    batch_cost: float | None = typer.Option(None, "--batch-max-cost", min=0.0, help="Dollars for the whole batch."),
    executor: str = typer.Option("local", "--executor", help="local (threads here) or celery (workers)."),
    broker: str | None = typer.Option(None, "--broker", help="Celery broker URL (amqp://... or redis://...)."),
    stall_timeout: str | None = typer.Option(
        None,
        "--stall-timeout",
        metavar="DURATION",
        help="With --executor celery: stop following once no run was reported for this long (exit 3).",
    ),
    hitl: bool = typer.Option(
        False, "--hitl", help="Escalate gates park their run for a human reply: mklang resume STORE#RUN --set ..."
    ),
    untrusted_flow: str | None = UntrustedFlowOpt,
    hosting: Hosting = Hosting(),
    events: str | None = EventsOpt,
    trace_content: bool = TraceContentOpt,
    format: OutputFormat = FormatOpt,
) -> None:
    """Run a machine once per input line, each run durable in the store; re-run to resume."""
    with handle_errors(wants_json(format)):
        from mklang import batching
        from mklang.checker import require_runnable
        from mklang.stores import open_store
        from mklang.syntax import load_file

        as_json = wants_json(format)
        if executor not in ("local", "celery"):
            raise fail(f"--executor expects local or celery, got {executor!r}")
        if executor == "celery" and broker is None:
            raise fail("--executor celery needs --broker URL")
        if executor == "celery" and events is not None:
            raise fail("--events with --executor celery: the workers run the runs, give it to mklang worker")
        stall = parse_duration(stall_timeout, "--stall-timeout")
        if stall is not None and executor != "celery":
            raise fail("--stall-timeout follows workers: it needs --executor celery")
        loaded = require_runnable(load_file(machine))
        items = batching.read_inputs(inputs)
        host_settings = hosting.settings()
        from contextlib import nullcontext

        from mklang.session import Host

        if executor == "celery":  # the workers host the runs, with their own options
            _say_host_settings_unused(host_settings)
            host_settings = {}
        # Built before any run, so a bad host option (or a dollar limit on a model without a price) is a
        # usage error. A real provider is shared by every run (it is thread-safe); a scripted host keeps
        # a state per run, so each gets its own.
        shared = (
            Host.build(**host_settings, **_dollar_limit(max_cost, batch_cost)) if executor == "local" else Host(None)
        )
        budgets: dict[str, Any] = dict(
            max_tokens=max_tokens,
            max_cost=max_cost,
            max_time=parse_duration(max_time),
            untrusted_flow=policy(untrusted_flow),
        )
        opened = open_store(store)
        try:
            with event_stream(events, trace_content) as observer, _progress(as_json, len(items)) as progress:
                if executor == "local":
                    from mklang.engine import Control

                    control = Control()  # Ctrl-C: every run in flight suspends at its next loop-top
                    runner = batching.Batch(
                        loaded,
                        opened,
                        store,
                        (lambda: Host.build(**host_settings, max_cost=max_cost))
                        if hosting.script
                        else (lambda: nullcontext(shared)),
                        **budgets,
                        ceilings=batching.Ceilings(batch_tokens, batch_cost),
                        on_outcome=progress,
                        hitl=hitl,
                        stop=control.interrupted,
                        observer=observer,
                    )
                    with interrupts(control):
                        outcomes = runner.run(items, concurrency)
                else:
                    from mklang.distributed import enqueue_and_follow, queue_for

                    queue = queue_for(opened)
                    outcomes = enqueue_and_follow(
                        broker or "",
                        opened,
                        loaded,
                        items,
                        budgets,
                        ceilings=batching.Ceilings(batch_tokens, batch_cost),
                        hitl=hitl,
                        stall=stall,
                        on_outcome=progress,
                        on_wait=progress.waiting,
                    )
        finally:
            opened.close()
            shared.close()
        if out is not None:
            batching.write_results(out, outcomes)
        unreported = sum(1 for result in outcomes if result.status == "pending")
        if executor == "celery" and stall is not None and unreported:
            print(
                f"mklang: no run was reported for {stall_timeout}: {unreported} run(s) not finished, still queued on "
                f"{queue}. Is a worker running for this store (mklang worker --store ... --broker ...)? "
                "Re-run this command to follow them again.",
                file=sys.stderr,
            )
        totals = batching.summary(outcomes)
        _say_failed(outcomes, out)
        if as_json:
            print_json(totals)
        else:
            from mklang.cli.render import render_batch

            render_batch(totals)
        raise typer.Exit(totals["exit_code"])


FAILED_SHOWN = 10  # failed runs named one per line on stderr; the rest are counted


def _say_failed(outcomes: list[Any], out: Path | None) -> None:
    """One line per failed run with its reason (the first few), so a failure is seen without --out."""
    from mklang.errors import redacted
    from mklang.terminal import printable

    failed = [result for result in outcomes if result.status == "failed"]
    for result in failed[:FAILED_SHOWN]:
        print(printable(redacted(f"mklang: run {result.run} failed: {result.reason}")), file=sys.stderr)
    if len(failed) > FAILED_SHOWN:
        where = f"{out} lists each" if out is not None else "--out FILE lists each"
        print(f"mklang: and {len(failed) - FAILED_SHOWN} more failed run(s): {where}", file=sys.stderr)


def _dollar_limit(max_cost: float | None, batch_cost: float | None) -> dict[str, Any]:
    """The dollar limit a batch's host must be able to keep, and the option that set it."""
    if max_cost is None and batch_cost is not None:
        return {"max_cost": batch_cost, "priced_for": "--batch-max-cost"}
    return {"max_cost": max_cost}


def _say_host_settings_unused(host_settings: dict[str, Any]) -> None:
    """`batch --executor celery` hosts nothing: the provider options of this command line would not be used."""
    given = [f"--{name.rstrip('s')}" for name, value in host_settings.items() if value]
    if given:
        print(
            f"mklang: {', '.join(given)} not used with --executor celery: each worker runs with its own "
            "(mklang worker --provider/--config ...)",
            file=sys.stderr,
        )


def _progress(as_json: bool, total: int) -> Any:
    """A progress bar with done/halted/suspended/failed counts on a terminal; silent otherwise."""
    from mklang.cli.render import BatchProgress

    return BatchProgress(total, visible=not as_json and sys.stderr.isatty())


@app.command()
@hosted("provider", "model", "config", "script", "replay", "plugin")
def worker(
    store: str = StoreOpt,
    broker: str = typer.Option(..., "--broker", help="Celery broker URL (amqp://... or redis://...)."),
    concurrency: int = typer.Option(
        DEFAULT_WORKER_CONCURRENCY, "--concurrency", min=1, help="Runs this worker runs at once (its threads)."
    ),
    hosting: Hosting = Hosting(),
    events: str | None = EventsOpt,
    trace_content: bool = TraceContentOpt,
) -> None:
    """A Celery worker that runs the batches enqueued with `mklang batch --executor celery`."""
    with handle_errors():
        from mklang.distributed import start_worker

        with event_stream(events, trace_content) as observer:
            start_worker(broker, store, concurrency=concurrency, host_settings=hosting.settings(), observer=observer)
