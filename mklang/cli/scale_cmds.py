"""`mklang runs` (list, rm, prune), `batch` and `worker`: many runs in one store (docs/scale.md, docs/runs.md)."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

from mklang import exitcodes
from mklang.cli.app import OutputFormat, app, fail, handle_errors, print_json, wants_json
from mklang.cli.hosting import Hosting, hosted
from mklang.cli.observe import EventsOpt, TraceContentOpt, event_stream
from mklang.cli.run_cmds import (
    FormatOpt,
    MaxTimeOpt,
    Output,
    UntrustedFlowOpt,
    interrupts,
    parse_duration,
    policy,
    reported,
)
from mklang.errors import UsageError, redacted
from mklang.stores.summary import SUMMARY_STATUSES
from mklang.vocabulary import DEFAULT_BATCH_CONCURRENCY, DEFAULT_WORKER_CONCURRENCY

StoreOpt = typer.Option(..., "--store", help="The checkpoint store: a folder, sqlite:///runs.db or postgresql://...")
SweepOpt = typer.Option(
    None,
    "--sweep",
    min=0.1,
    metavar="SECONDS",
    help="Sweep the store every SECONDS as `mklang runs sweep` does: decisions whose deadline passed go on.",
)


runs_app = typer.Typer(help="The runs of a store: list them, remove them, prune old ones, migrate parked ones.")
app.add_typer(runs_app, name="runs")


@runs_app.callback(invoke_without_command=True)
def runs(
    context: typer.Context,
    store: str | None = typer.Option(None, "--store", help="The checkpoint store to list."),
    status: list[str] | None = typer.Option(None, "--status", help="Only runs with this status. Repeatable."),
    machine: str | None = typer.Option(None, "--machine", help="Only runs of this root machine (its name)."),
    since: str | None = typer.Option(
        None, "--since", metavar="WHEN", help="Only runs updated since: a duration ago (2h, 7d) or an ISO date."
    ),
    limit: int | None = typer.Option(None, "--limit", min=1, help="At most this many runs (a page)."),
    page: int = typer.Option(1, "--page", min=1, help="Which page of --limit runs."),
    format: OutputFormat = FormatOpt,
) -> None:
    """The runs of a store, newest first: status, reason or question, spend, started, updated;
    then its budget pools: cap, spent, reserved, calls in flight, runs waiting for a top-up.

    What is listed is each run's summary, kept beside it: it is shown, never
    trusted; `mklang show STORE#RUN` reads and verifies the run itself."""
    if context.invoked_subcommand is not None:
        return
    with handle_errors(wants_json(format)):
        from mklang.stores import RunQuery, open_store, pools_of, summaries_of

        if store is None:
            raise fail("mklang runs needs --store URI (a folder, sqlite:///runs.db or postgresql://...)")
        unknown = sorted(set(status or []) - set(SUMMARY_STATUSES))
        if unknown:
            raise fail(f"--status expects one of {', '.join(SUMMARY_STATUSES)}, got {', '.join(unknown)}")
        query = RunQuery(
            statuses=tuple(status or ()),
            machine=machine,
            since=_since(since),
            limit=None if limit is None else limit + 1,  # one more: is there a next page
            offset=0 if limit is None else (page - 1) * limit,
        )
        opened = open_store(store, create=False)
        try:
            found = summaries_of(opened, query)
            pools = pools_of(opened)
        finally:
            opened.close()
        more = limit is not None and len(found) > limit
        listed = [_summary_json(store, summary) for summary in found[:limit]]
        if wants_json(format):
            shown = [pool.to_json() for pool in pools]
            print_json(
                {"store": redacted(store), "page": page, "limit": limit, "more": more, "runs": listed, "pools": shown}
            )
        else:
            from mklang.cli.render import render_runs  # rich, for people only

            render_runs(listed)
            for pool in pools:
                print(f"pool {pool.line()}")
            if more:
                print(f"more: --page {page + 1}", file=sys.stderr)


def _since(text: str | None) -> float | None:
    """`--since`: a duration ago (2h, 7d), or an ISO date or time (UTC unless it says), as epoch seconds."""
    import time
    from datetime import UTC, datetime

    if text is None:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        seconds = parse_duration(text, "--since")
        return None if seconds is None else time.time() - seconds
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def _summary_json(store: str, summary: Any) -> dict[str, Any]:
    """One run of `runs --format json`: its summary, times in ISO 8601 (UTC), and how to name it."""

    def iso(seconds: float | None) -> str | None:
        from datetime import UTC, datetime

        return None if seconds is None else datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")

    from mklang.stores import run_name, target

    data = summary.to_json()
    data.update(started=iso(summary.started), updated=iso(summary.updated), checkpoint=None)
    try:
        data["checkpoint"] = redacted(target(store, run_name(summary.run)))
    except UsageError as error:  # a row no mklang run would write: listed, never named for a command
        data.update(status=None, reason=str(error))
    return data


@runs_app.command("rm")
def runs_rm(
    checkpoints: list[str] = typer.Argument(..., help="The runs: STORE-URI#RUN, or FOLDER/RUN of a folder store."),
    unfinished: bool = typer.Option(
        False, "--unfinished", help="Also remove runs not finished (suspended, interrupted, or not signed by you)."
    ),
    format: OutputFormat = FormatOpt,
) -> None:
    """Remove runs by name: envelope, journal, summary, and a batch's record and report of each.

    A finished run is removed; an unfinished one only with --unfinished; one
    still going in a process (its lock held) never. Exit 0 when every named
    run was removed, 1 when one was kept (each said on stderr)."""
    with handle_errors(wants_json(format)):
        from mklang.errors import MklangError, first_line
        from mklang.runs import Removal, remove_run
        from mklang.stores import locate, split_target

        for checkpoint in checkpoints:  # every name checked before any run is removed
            split_target(checkpoint)
        done = []
        for checkpoint in checkpoints:
            try:
                location = locate(checkpoint, create=False)
            except MklangError as error:  # its store cannot be opened: the other runs are still removed
                done.append(Removal(redacted(checkpoint), False, None, first_line(error)))
                continue
            try:
                done.append(remove_run(location, unfinished=unfinished))
            finally:
                location.store.close()
        _report_removed(done, wants_json(format))


@runs_app.command("migrate")
def runs_migrate(
    store: str = StoreOpt,
    machine: Path = typer.Option(..., "--machine", help="The new version of the root machine file."),
    map_: list[str] | None = typer.Option(None, "--map", metavar="OLD=NEW", help="State OLD is named NEW now."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only say what each parked run is to the new version."),
) -> None:
    """Move every parked run of the machine to its new version: one line each, compatible,
    migratable or incompatible at a frame (and why), or refused (busy, not signed by you).

    Without --dry-run the compatible and migratable ones are migrated, each under its own lock;
    the rest are left as they were. Exit 0 when none was incompatible or refused, else 1."""
    with handle_errors():
        from mklang.checkpoint.migration import parse_map
        from mklang.runs import migrate_store

        lines = migrate_store(store, machine, parse_map(map_), write=not dry_run)
        for run, line in lines:
            print(f"{run}: {line}")
        moved = ("compatible", "migratable")
        raise typer.Exit(exitcodes.OK if all(line in moved for _, line in lines) else exitcodes.HALT)


@runs_app.command("prune")
def runs_prune(
    store: str = StoreOpt,
    older_than: str = typer.Option(
        ..., "--older-than", metavar="DURATION", help="Remove finished runs last updated longer ago (30d, 12h)."
    ),
    status: str = typer.Option(
        "done,halted", "--status", help="Which finished runs: done, halted, or both (comma-separated)."
    ),
    format: OutputFormat = FormatOpt,
) -> None:
    """Remove the finished runs of a store last updated before --older-than ago.

    Unfinished runs are never pruned (`mklang runs rm --unfinished` removes one
    by name). Each candidate is checked under its lock against its signed
    envelope; its age is the store's record of its last write."""
    with handle_errors(wants_json(format)):
        import time

        from mklang.runs import FINISHED, location, remove_run
        from mklang.stores import RunQuery, open_store, summaries_of

        statuses = tuple(part.strip() for part in status.split(",") if part.strip())
        if not statuses or set(statuses) - set(FINISHED):
            raise fail(
                f"--status of prune expects done, halted or done,halted (unfinished runs are kept), got {status!r}"
            )
        age = parse_duration(older_than, "--older-than") or 0.0
        cutoff = time.time() - age
        opened = open_store(store, create=False)
        try:
            candidates = [
                summary.run
                for summary in summaries_of(opened, RunQuery(statuses=statuses))
                if summary.updated is not None and summary.updated < cutoff
            ]
            done = [remove_run(location(opened, store, run), statuses=statuses) for run in candidates]
        finally:
            opened.close()
        _report_removed(done, wants_json(format), pruned=True)


@runs_app.command("cancel")
def runs_cancel(
    store: str = StoreOpt,
    names: list[str] = typer.Argument(..., metavar="NAME...", help="The runs of the store to cancel."),
    format: OutputFormat = FormatOpt,
) -> None:
    """Cancel runs by name: a parked one halts `cancelled` at once, a running one at its next
    loop-top; a cancelled run cannot be resumed or answered (docs/runs.md).

    One line each: cancelled, cancel requested (running), or refused (finished, busy, not
    signed by you, no such run). Exit 0 when none was refused, else 1."""
    with handle_errors(wants_json(format)):
        from mklang.runs import location
        from mklang.runs.cancelling import cancel
        from mklang.stores import open_store, run_name

        runs = [run_name(name) for name in names]  # every name checked before any run is cancelled
        opened = open_store(store, create=False)
        try:
            done = [cancel(location(opened, store, run), by="cli") for run in runs]
        finally:
            opened.close()
        if wants_json(format):
            print_json({"store": redacted(store), "cancelled": [one.to_json() for one in done]})
        for one in [] if wants_json(format) else done:
            print(one.line(), file=sys.stderr if one.outcome == "refused" else sys.stdout)
        if any(one.outcome == "refused" for one in done):
            raise typer.Exit(exitcodes.HALT)


@runs_app.command("sweep")
@hosted()
def runs_sweep(
    store: str = StoreOpt,
    untrusted_flow: str | None = UntrustedFlowOpt,
    max_time: str | None = MaxTimeOpt,
    hosting: Hosting = Hosting(),
    format: OutputFormat = FormatOpt,
) -> None:
    """One pass, for cron: continue every run whose human decision's deadline has passed,
    along the decision's timeout transition, exactly once (docs/runs.md).

    Each run is decided under its lock: one another process holds is passed over (`busy`),
    one a human answered meanwhile is no longer due. The host options answer the runs it
    continues, as those of `resume` do. Exit 0, or 1 when a run could not be continued."""
    with handle_errors(wants_json(format)):
        from mklang import exitcodes
        from mklang.batching import location
        from mklang.runs import RunRequest
        from mklang.runs.sweeping import sweep
        from mklang.stores import open_store

        request = RunRequest(
            hosting=hosting.settings, untrusted_flow=policy(untrusted_flow), max_time=parse_duration(max_time)
        )
        opened = open_store(store, create=False)
        try:
            swept = sweep(opened, lambda run: location(opened, store, run), request)
        finally:
            opened.close()
        if wants_json(format):
            print_json({"store": redacted(store), "swept": [done.to_json() for done in swept]})
        elif not swept:
            print("mklang: no run's deadline has passed", file=sys.stderr)
        for done in [] if wants_json(format) else swept:
            print(done.line())
        if any(done.outcome == "failed" for done in swept):
            raise typer.Exit(exitcodes.HALT)


@contextmanager
def sweeping(uri: str, every: float | None, hosting: Mapping[str, Any]) -> Iterator[None]:
    """With `every` (--sweep), the store `uri` swept that often while the block runs (`Sweeper`):
    its runs continued by a host made of `hosting`, each line on stderr."""
    if every is None:
        yield
        return
    from mklang.runs import RunRequest, location, on_stderr
    from mklang.runs.sweeping import Sweeper
    from mklang.stores import open_store

    store = open_store(uri, create=False)
    try:
        with Sweeper(store, lambda run: location(store, uri, run), RunRequest(hosting=hosting), every, on_stderr):
            yield
    finally:
        store.close()


def _report_removed(done: list[Any], as_json: bool, pruned: bool = False) -> None:
    """What `runs rm` and `runs prune` removed: one line per run (kept ones on stderr), and the exit code.

    A run `prune` chose that turned out not to qualify (its summary was stale) is kept quietly: exit 0."""
    from mklang import exitcodes
    from mklang.terminal import printable

    kept = [removal for removal in done if not removal.removed]
    if as_json:
        print_json({"removed": [r.run for r in done if r.removed], "kept": [r.to_json() for r in kept]})
    else:
        for removal in done:
            if removal.removed:
                print(printable(f"removed {removal.run} ({removal.status or 'unverified'})"))
        print(f"{len(done) - len(kept)} run(s) removed, {len(kept)} kept")
    for removal in kept:
        print(printable(f"mklang: kept {removal.why}"), file=sys.stderr)
    raise typer.Exit(exitcodes.OK if pruned or not kept else exitcodes.KEPT)


@app.command()
@hosted("record")
@reported
def batch(
    machine: Path = typer.Argument(..., help="The machine file run for every input."),
    inputs: Path = typer.Option(..., "--inputs", help="JSON Lines: one context object per run (its `id` names it)."),
    store: str = StoreOpt,
    out: Path | None = typer.Option(None, "--out", help="Write one result line per input here (JSON Lines)."),
    concurrency: int = typer.Option(
        DEFAULT_BATCH_CONCURRENCY, "--concurrency", min=1, help="Runs in flight at once (over all --processes)."
    ),
    processes: int = typer.Option(
        1,
        "--processes",
        min=1,
        help="Spread the runs over this many local processes sharing the store, to use more cores.",
    ),
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
    output: Output = Output(),
) -> None:
    """Run a machine once per input line, each run durable in the store; re-run to resume."""
    with handle_errors(output.as_json):
        from contextlib import ExitStack

        from mklang import batching
        from mklang.checker import require_runnable
        from mklang.cli.local_batch import LocalBatch, hosts, spread
        from mklang.engine import Control
        from mklang.runs.pooling import require_pool
        from mklang.stores import open_note_store
        from mklang.syntax import load_file

        as_json = output.as_json
        if executor not in ("local", "celery"):
            raise fail(f"--executor expects local or celery, got {executor!r}")
        if executor == "celery" and broker is None:
            raise fail("--executor celery needs --broker URL")
        if executor == "celery" and output.events is not None:
            raise fail("--events with --executor celery: the workers run the runs, give it to mklang worker")
        stall = parse_duration(stall_timeout, "--stall-timeout")
        if stall is not None and executor != "celery":
            raise fail("--stall-timeout follows workers: it needs --executor celery")
        if processes > 1 and executor == "celery":
            raise fail("--processes spreads a local batch: with --executor celery the workers are the processes")
        if processes > concurrency:
            raise fail(
                f"--processes {processes} needs --concurrency {processes} or more: it is the runs in flight "
                "over all the processes"
            )
        loaded = require_runnable(load_file(machine))
        items = batching.read_inputs(inputs)
        host_settings = hosting.settings
        if executor == "celery":  # the workers host the runs, with their own options
            _say_host_settings_unused(host_settings)
        budgets: dict[str, Any] = dict(
            max_tokens=max_tokens,
            max_cost=max_cost,
            max_time=parse_duration(max_time),
            untrusted_flow=policy(untrusted_flow),
        )
        ceilings = batching.Ceilings(batch_tokens, batch_cost)
        plan = LocalBatch(
            str(machine), store, host_settings, budgets, ceilings.to_json(), hitl, output.events, output.trace_content
        )
        with ExitStack() as stack:
            host_for = stack.enter_context(hosts(host_settings, max_cost, batch_cost)) if executor == "local" else None
            opened = open_note_store(store, "a batch")
            stack.callback(opened.close)
            if host_for is not None:
                require_pool(opened, host_settings)
            observer = stack.enter_context(event_stream(output.events, output.trace_content))
            if host_for is not None:  # the hosts, the store and the observer are ready: the runs start next
                from mklang.cli.cost_report import batch_preflight

                print(f"mklang: {batch_preflight(loaded, len(items), host_settings, batch_cost)}", file=sys.stderr)
            progress = stack.enter_context(_progress(as_json, len(items)))
            control = Control()  # Ctrl-C: every run in flight suspends at its next loop-top
            if host_for is None:  # the workers host the runs
                from mklang.distributed import enqueue_and_follow, queue_for

                queue = queue_for(opened)
                outcomes = enqueue_and_follow(
                    broker or "",
                    opened,
                    loaded,
                    items,
                    budgets,
                    ceilings=ceilings,
                    hitl=hitl,
                    stall=stall,
                    on_outcome=progress,
                    on_wait=progress.waiting,
                )
            elif processes > 1:
                outcomes = spread(plan, items, concurrency, processes, opened, progress, control)
            else:
                runner = plan.runner(
                    loaded,
                    opened,
                    host_for,
                    ledger=None,
                    on_outcome=progress,
                    stop=control.interrupted,
                    observer=observer,
                )
                with interrupts(control):
                    outcomes = runner.run(items, concurrency)
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


def _say_host_settings_unused(host_settings: dict[str, Any]) -> None:
    """`batch --executor celery` hosts nothing: the provider options of this command line would not be used."""
    from mklang.host.settings import BY_NAME

    given = [BY_NAME[name].option for name, value in host_settings.items() if value]
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
@hosted("scenario", "record")
def worker(
    store: str = StoreOpt,
    broker: str = typer.Option(..., "--broker", help="Celery broker URL (amqp://... or redis://...)."),
    concurrency: int = typer.Option(
        DEFAULT_WORKER_CONCURRENCY, "--concurrency", min=1, help="Runs this worker runs at once (its threads)."
    ),
    hosting: Hosting = Hosting(),
    events: str | None = EventsOpt,
    trace_content: bool = TraceContentOpt,
    log_format: str = typer.Option(
        "text", "--log-format", help="The line logged per run taken and finished: text or json (logger mklang)."
    ),
    sweep: float | None = SweepOpt,
) -> None:
    """A Celery worker that runs the batches enqueued with `mklang batch --executor celery`
    (with --sweep, it also takes the deadlines of the store's parked decisions)."""
    with handle_errors():
        from mklang.distributed import LOG_FORMATS, celery_worker, log_runs

        if log_format not in LOG_FORMATS:
            raise fail(f"--log-format expects text or json, got {log_format!r}")
        log_runs(log_format)

        with event_stream(events, trace_content) as observer, sweeping(store, sweep, hosting.settings):
            celery = celery_worker(
                broker, store, concurrency=concurrency, host_settings=hosting.settings, observer=observer
            )
            celery.start()
