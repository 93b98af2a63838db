"""A local `mklang batch`: its runs in this process, or spread over N processes sharing the store (ADR 0041).

One process spends at most one core (the GIL). With `--processes N` this
process checks everything a batch checks, then starts N children, each in a
process group of its own, and hands each its share on stdin as one JSON
line: every Nth item, and its part of `--concurrency` (the total of runs in
flight, split evenly). A child runs its share as a one-process batch does,
with the batch-wide ceilings kept in the store (`StoreLedger`, as workers
keep them), and writes each run's outcome on stdout as one JSON line. This
process draws the one progress line from them, forwards Ctrl-C and SIGTERM
to every child, reports a child that dies (the runs it had not reported are
`pending`: their locks died with it, so the next pass resumes them), and
writes the one summary, results file and exit code. A child whose stdin
closes (this process is gone) stops its runs as on SIGTERM. A child is handed
the model prices this process looked up, so it need not load the price table.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import asdict, dataclass
from typing import IO, Any

from mklang.batching import Batch, Ceilings, Item, Ledger, StoreLedger, batch_id
from mklang.engine import Control
from mklang.engine.events import EventSink
from mklang.host.config import catalog_prices, known_catalog_prices
from mklang.model import Machine
from mklang.runs import Outcome
from mklang.session import Host
from mklang.stores import Store


@dataclass(frozen=True)
class LocalBatch:
    """What each run of a local batch is started with, the same in this process and in a child (as JSON)."""

    machine: str  # the machine file, as given (a child runs in the same folder)
    store: str
    host_settings: dict[str, Any]
    budgets: dict[str, Any]  # max_tokens, max_cost, max_time, untrusted_flow of each run
    ceilings: dict[str, Any]  # `Ceilings.to_json`
    hitl: bool
    events: str | None = None  # `--events`: a child appends its runs' events there itself
    trace_content: bool = False

    def runner(
        self,
        machine: Machine,
        store: Store,
        host_for: Callable[[], AbstractContextManager[Host]],
        *,
        ledger: Ledger | None,
        on_outcome: Callable[[Outcome], None],
        stop: threading.Event,
        observer: EventSink | None,
    ) -> Batch:
        """The batch that runs this plan's items in this process (a child's share, or all of them)."""
        return Batch(
            machine,
            store,
            self.store,
            host_for,
            **self.budgets,
            ceilings=Ceilings.from_json(self.ceilings),
            ledger=ledger,
            on_outcome=on_outcome,
            hitl=self.hitl,
            stop=stop,
            observer=observer,
        )


@contextmanager
def hosts(
    host_settings: dict[str, Any], max_cost: float | None, batch_cost: float | None
) -> Iterator[Callable[[], AbstractContextManager[Host]]]:
    """What gives each run its host. Built before any run, so a bad host option (or a dollar limit
    on a model without a price) is a usage error. A real provider is shared by every run (it is
    thread-safe); a scripted host keeps a state per run, so each gets its own."""
    from mklang.runs import RunRequest, build_host

    limit = (
        RunRequest(hosting=host_settings, max_cost=batch_cost, priced_for="batch_max_cost")
        if max_cost is None and batch_cost is not None
        else RunRequest(hosting=host_settings, max_cost=max_cost)
    )
    shared = build_host(limit)
    try:
        if host_settings["script"]:
            yield lambda: build_host(RunRequest(hosting=host_settings, max_cost=max_cost))
        else:
            yield lambda: nullcontext(shared)
    finally:
        shared.close()


def shares(items: list[Item], concurrency: int, processes: int) -> list[tuple[list[Item], int]]:
    """Each process's items (every Nth, from its number on) and runs in flight (`concurrency` split
    evenly); a process that would get no item is not started."""
    split = [
        (items[number::processes], concurrency // processes + (number < concurrency % processes))
        for number in range(processes)
    ]
    return [(share, runs) for share, runs in split if share]


class Child:
    """One child process of a spread batch, and the runs it was handed."""

    def __init__(self, number: int, of: int, plan: LocalBatch, batch: str, items: list[Item], concurrency: int):
        self.name = f"process {number + 1} of {of}"
        self.runs = [item.run for item in items]
        self.stopping = False  # an interrupt was passed on to it
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from mklang.cli.local_batch import child; child()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            process_group=0,  # a terminal's Ctrl-C reaches this process only, which forwards it once
        )
        share = {
            "plan": asdict(plan),
            "batch": batch,
            "concurrency": concurrency,
            "items": [{"run": item.run, "context": item.context} for item in items],
            "prices": catalog_prices(),  # what this process's host was priced at: the child need not look
        }
        assert self.process.stdin is not None
        with suppress(BrokenPipeError):  # it ended already: said when its output ends
            self.process.stdin.write(json.dumps(share, ensure_ascii=False) + "\n")
            self.process.stdin.flush()  # and kept open: its end tells the child that this process is gone

    def stop(self) -> None:
        """Pass an interrupt on: the first suspends the child's runs at their next loop-top, the
        next ends it at once, as it ends this process. The next is a kill, not a second SIGTERM:
        two signals sent in a row reach a child that is slow to handle the first as one."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL if self.stopping else signal.SIGTERM)
            self.stopping = True

    def how_it_ended(self) -> str:
        """Once its output has ended: wait for it, close its pipes, and say how it ended."""
        code = self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with suppress(BrokenPipeError):
                    pipe.close()
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"ended with exit code {code}"


def spread(
    plan: LocalBatch,
    items: list[Item],
    concurrency: int,
    processes: int,
    store: Store,
    on_outcome: Callable[[Outcome], None],
    control: Control,
) -> list[Outcome]:
    """Run `items` over `processes` children sharing `store`; their outcomes, in input order.

    A run a child did not report (it died) is `pending`, with which process and how it ended, said
    once on stderr. `control.interrupted` is set by the first Ctrl-C or SIGTERM, which every child
    is sent too."""
    from mklang.cli.run_cmds import interrupts

    batch = batch_id(items)
    ceilings = Ceilings.from_json(plan.ceilings)
    if ceilings.any():  # every earlier pass counts before any child starts a run
        StoreLedger(ceilings, store, batch).count(store, items)
    children: list[Child] = []
    lines: queue.Queue[tuple[Child, str | None]] = queue.Queue()
    found: dict[str, Outcome] = {}

    def stop_every_child() -> None:
        for each in children:
            each.stop()

    with interrupts(control, forward=stop_every_child):
        for number, (share, runs) in enumerate(shares(items, concurrency, processes)):
            if control.interrupted.is_set():  # interrupted while starting them: no more is started
                break
            children.append(Child(number, processes, plan, batch, share, runs))
            threading.Thread(target=_read_lines, args=(children[-1], lines), daemon=True).start()
        ended = 0
        while ended < len(children):
            each, line = lines.get()
            if line is not None:
                done = Outcome.from_json(json.loads(line))
                found[done.run] = done
                on_outcome(done)
                continue
            ended += 1
            how = each.how_it_ended()
            lost = [run for run in each.runs if run not in found]
            if lost:
                print(
                    f"mklang: {each.name} (pid {each.process.pid}) {how}: the {len(lost)} run(s) it had not "
                    "reported are pending; re-run the batch to continue them",
                    file=sys.stderr,
                )
            for run in lost:
                found[run] = Outcome(run, "pending", f"{each.name} {how}")
                on_outcome(found[run])
    return [found.get(item.run) or Outcome(item.run, "pending", "interrupted") for item in items]


def _read_lines(each: Child, lines: queue.Queue[tuple[Child, str | None]]) -> None:
    """Every whole line a child writes, then None at its end (a child killed mid-line leaves a part)."""
    assert each.process.stdout is not None
    for line in each.process.stdout:
        if line.endswith("\n"):
            lines.put((each, line))
    lines.put((each, None))


def child() -> None:
    """A child of a spread batch: its share from stdin, each run's outcome as a JSON line on stdout."""
    import typer

    from mklang.cli.app import handle_errors
    from mklang.cli.run_cmds import interrupts

    share = json.loads(sys.stdin.readline())
    report = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # whatever else is printed goes to stderr
    control = Control()
    threading.Thread(target=_stop_at_end_of, args=(sys.stdin, control.interrupted), daemon=True).start()
    try:
        with handle_errors(), interrupts(control, quiet=True):
            _run_share(share, control, report)
    except typer.Exit as stop:
        raise SystemExit(stop.exit_code) from None
    finally:
        with suppress(BrokenPipeError):  # the parent is gone: what was left to tell it is dropped
            report.close()


def _run_share(share: dict[str, Any], control: Control, report: IO[bytes]) -> None:
    from mklang.checker import require_runnable
    from mklang.cli.observe import event_stream
    from mklang.stores import open_note_store
    from mklang.syntax import load_file

    plan = LocalBatch(**share["plan"])
    ceilings = Ceilings.from_json(plan.ceilings)
    guard = threading.Lock()

    def tell(done: Outcome) -> None:
        with guard:
            try:
                report.write(json.dumps(done.to_json(), ensure_ascii=False).encode("utf-8") + b"\n")
                report.flush()
            except BrokenPipeError:  # the parent is gone: stop, as its closed stdin says too
                control.interrupted.set()

    machine = require_runnable(load_file(plan.machine))
    known_catalog_prices(share["prices"])
    store = open_note_store(plan.store, "a batch")
    max_cost = plan.budgets["max_cost"]
    try:
        with (
            hosts(plan.host_settings, max_cost, ceilings.max_cost) as host_for,
            event_stream(plan.events, plan.trace_content) as observer,
        ):
            runner = plan.runner(
                machine,
                store,
                host_for,
                ledger=StoreLedger(ceilings, store, share["batch"]) if ceilings.any() else None,
                on_outcome=tell,
                stop=control.interrupted,
                observer=observer,
            )
            runner.run([Item(item["run"], item["context"]) for item in share["items"]], share["concurrency"])
    finally:
        store.close()


def _stop_at_end_of(stream: IO[str], stop: threading.Event) -> None:
    """The parent keeps this stream open while it lives: its end stops the runs, as SIGTERM does."""
    stream.read()
    stop.set()
