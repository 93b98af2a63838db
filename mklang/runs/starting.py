"""Starting a run: in memory through the engine, or durably at a checkpoint it then persists to.

The envelope and journal modules (pydantic) are imported by the functions that
store a run, so a run kept in memory does not load them.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Unpack

from mklang.checkpoint.texts import keep_texts
from mklang.effects import check_policy
from mklang.engine import RunOptions, RunResult, run
from mklang.engine.frame import Frame
from mklang.errors import UsageError
from mklang.model import Machine
from mklang.runs.driving import RunSettings, claimed, drive
from mklang.session import Host, preflight
from mklang.stores import RunLock, locate
from mklang.syntax.machines import MachineLoader
from mklang.telemetry import traced
from mklang.version import __version__
from mklang.vocabulary import DEFAULT_RUN_CONCURRENCY

if TYPE_CHECKING:
    from mklang.checkpoint.envelope import Ancestor, Envelope


def start(
    machine: Machine,
    context: dict[str, Any] | None,
    host: Host,
    *,
    suspendable: bool = False,
    held: RunLock | None = None,
    texts: dict[str, str] | None = None,
    on_end: Callable[[Envelope], None] | None = None,
    lineage: list[Ancestor] | None = None,
    **options: Unpack[RunSettings],
) -> RunResult:
    """Run `machine` with `host`; with a checkpoint the run persists and suspends, and a
    resumable checkpoint exists from its first loop-top on.

    Without one, `suspendable` makes budgets suspend into the result's frames.
    A run not finished at the checkpoint is refused unless `replace`; `held`
    is the checkpoint's lock when the caller took it already; `texts` the
    machine texts its store keeps already (`keep_texts`: a batch keeps them
    once for all its runs); `on_end` is handed the envelope the run ended with,
    once it is written (`drive`); `lineage` the runs a fork comes from (`forking`).

    A scenario's input lies under `context`, and its `run:` settings under the
    given options. Scripted branches run concurrently like real ones: a
    scripted host answers them by branch index, so the answers stay the same.
    """
    preflight(machine, host)
    if host.scenario is not None:
        context = {**host.scenario.input, **(context or {})}
    budget = host.run_setting("budget", None)
    if budget is not None:
        machine = machine.replace(budget=int(budget))
    # What the run goes by, in memory or in its envelope: the caller's, else the scenario's, else the default.
    flow = host.run_setting("on_untrusted_flow", options.get("untrusted_flow"))
    chosen: RunOptions = {
        "max_tokens": host.run_setting("max_tokens", options.get("max_tokens")),
        "max_cost": host.run_setting("max_cost", options.get("max_cost")),
        "max_time": options.get("max_time"),
        "concurrency": host.run_setting("concurrency", options.get("concurrency"), DEFAULT_RUN_CONCURRENCY),
        "hitl": bool(host.run_setting("hitl", options.get("hitl"), False)),
        "untrusted_flow": check_policy(flow or "report"),
    }
    checkpoint, control, observer = options.get("checkpoint"), options.get("control"), options.get("observer")
    replace = options.get("replace", False)
    if checkpoint is None:
        if replace:
            raise UsageError("replace=True replaces the run at a checkpoint: it needs checkpoint=")
        if host.settings.get("pool") is not None:
            raise UsageError("--pool draws from a pool kept in a store: it needs --checkpoint STORE-URI#RUN")
        with traced(observer, None) as (observer, _):
            in_memory: RunOptions = {**chosen, **host.toolbox(), "control": control, "observer": observer}
            return run(machine, context, provider=host.provider, suspendable=suspendable, **in_memory)
    from mklang.checkpoint.envelope import Budgets, Envelope, MachineRef

    loader = MachineLoader()
    loader.add(machine)
    location = locate(checkpoint)
    if not location.anchor.parent.is_dir():  # a checkpoint path in no folder: said before anything is written
        raise UsageError(f"{location}: no folder {location.anchor.parent} to keep the run in: make it first")
    envelope = Envelope(
        mklang_version=__version__,
        run_id=uuid.uuid4().hex,
        status="running",
        machine=MachineRef(name=machine.name, path=machine.path, sha256=loader.hashes.get(machine.path or "")),
        texts=texts if texts is not None else keep_texts(location.store, machine, location),
        frames=[],
        budgets=Budgets(max_tokens=chosen["max_tokens"], max_cost=chosen["max_cost"], max_time=chosen["max_time"]),
        hitl=chosen["hitl"],
        untrusted_flow=chosen["untrusted_flow"],
        concurrency=chosen["concurrency"],
        host=host.recorded(),
        input=dict(context or {}),
        lineage=list(lineage or []),
        edits=[],
    )
    frame = Frame.start(machine, context or {})
    with claimed(location, held, replace) as above:
        envelope.generation = above
        return drive(envelope, [frame], {}, loader, location, host, control=control, observer=observer, on_end=on_end)
