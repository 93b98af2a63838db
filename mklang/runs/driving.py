"""Driving a run persisting to a location whose lock is held: a new one (`start`) or an opened
one (`proceed`), its journal, the runtime, `continue_run` and the finish (`drive`)."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from mklang.checkpoint import generations
from mklang.checkpoint.paths import MachinePaths
from mklang.effects import check_policy
from mklang.engine import Control, RunOptions, RunResult, continue_run, decisions, make_runtime
from mklang.engine.decisions import Decision
from mklang.engine.events import EventSink
from mklang.engine.frame import Frame
from mklang.engine.interpolate import assign
from mklang.engine.runtime import Caps
from mklang.errors import CheckpointError, DecisionRefused, did_you_mean
from mklang.runs.opening import Resumable, apply_resume
from mklang.runs.request import Tell, on_stderr
from mklang.session import Host, preflight
from mklang.stores import Location, RunLock, locate
from mklang.syntax.machines import MachineLoader
from mklang.telemetry import traced

if TYPE_CHECKING:
    from mklang.checkpoint.envelope import Envelope


class RunSettings(TypedDict, total=False):
    """How a run `start`s or `proceed`s: where it persists (else in memory, or, continued, where
    it was read from) and whether an unfinished run there is `replace`d; its token, dollar and
    time budgets (a continued run's are new totals), calls in flight, whether escalations wait
    for a human and the untrusted-flow policy (None: the scenario's, else the default; continued:
    the checkpoint's); the interrupt flag, and the observer told of its events."""

    checkpoint: str | Path | Location | None
    replace: bool
    max_tokens: int | None
    max_cost: float | None
    max_time: float | None
    concurrency: int | None
    hitl: bool | None
    untrusted_flow: str | None
    control: Control | None
    observer: EventSink | None


@contextmanager
def claimed(location: Location, held: RunLock | None, replace: bool) -> Iterator[int]:
    """Hold the lock of a location a run is about to take (`held`, else taken here and released
    after), once nothing there would be lost: no run, a finished one, or `replace` (docs/scale.md).

    The lock comes first: a run another process is still writing is busy, not replaced. Yields the
    generation written there last: a run replacing another writes the ones after it (ADR 0022).
    """
    lock = held or location.store.lock(location.run)
    try:
        if not replace:
            _require_vacant(location)
        yield generations.written(location.store, location.run)
    finally:
        if held is None:
            lock.release()


def _require_vacant(location: Location) -> None:
    """Refuse a location that holds a run not finished, or anything that is not a run."""
    from mklang.checkpoint.envelope import parse
    from mklang.checkpoint.journal import resume_change

    raw = location.store.read(location.run)
    if raw is None:
        return
    try:
        envelope = parse(raw, str(location))
    except CheckpointError as error:
        raise CheckpointError(f"{error}; it is not replaced: name another checkpoint, or give --replace") from None
    if envelope.status in ("done", "halted") and resume_change(location.store, location.run, envelope) is None:
        return
    state = envelope.status if envelope.status != "suspended" else f"suspended ({envelope.reason})"
    raise CheckpointError(
        f"{location}: a run that is not finished is there ({state}); continue it with "
        f"`mklang resume {shlex.quote(location.text)}`, or start over with --replace"
    )


# --- Driving an opened run ----------------------------------------------------------


def proceed(
    resumable: Resumable,
    host: Host,
    *,
    reply: dict[str, Any] | None = None,
    decision: Decision | None = None,
    budget: int | None = None,
    raised_by: str | None = None,
    on_end: Callable[[Envelope], None] | None = None,
    tell: Tell = on_stderr,
    **options: Unpack[RunSettings],
) -> RunResult:
    """Continue an opened checkpoint with `host`; raised budgets are new totals, spend included,
    and with `raised_by` (the console) recorded as that operator's `raise-budget` action.

    `reply` maps dotted context paths to the values set before the run continues (`--set`),
    the answer to a parked question among them. `decision` decides the human decision the run
    waits on (`--answer`, or its deadline): refused, with nothing changed, unless
    `decisions.refusal` allows it now, this process holding the run's lock.

    The checkpoint then records `host`'s settings, not the ones it was read
    with, so a later resume never reuses settings that an untrusted file
    brought in. The run persists to `checkpoint` (default: where it was read
    from; another location is `claimed`, so an unfinished run there is
    refused unless `replace`); the lock taken by `open_run` is released when
    the run ends. `on_end` is handed the envelope the run ended with, as `start`'s is.
    """
    from mklang.checkpoint.segments import copy_segments
    from mklang.checkpoint.trust import run_settings
    from mklang.host.settings import BUDGETS, RUN_NAMES, RUN_SETTINGS

    preflight(resumable.chain[0].machine, host, checked=resumable.checked)
    envelope = resumable.envelope
    given: dict[str, Any] = {name: options.get(name) for name in RUN_NAMES}
    untrusted_flow = options.get("untrusted_flow")
    given["untrusted_flow"] = None if untrusted_flow is None else check_policy(untrusted_flow)
    recorded = {
        setting.name: getattr(envelope.budgets if setting.budget else envelope, setting.name)
        for setting in RUN_SETTINGS
    }
    settings, ignored = run_settings(recorded, given, resumable.trusted)
    if ignored:
        tell(f"the checkpoint is not signed with your key: ignored its recorded {'; '.join(ignored)}")
    _require_answer(resumable, reply or {})
    decided_now = decided(resumable, reply or {}, decision)
    change = {
        "budgets": {name: settings[name] for name in BUDGETS},
        "hitl": settings["hitl"],
        "untrusted_flow": settings["untrusted_flow"],
        "concurrency": settings["concurrency"],
        "host": host.recorded().model_copy(update={"state": envelope.host.state}).model_dump(mode="json"),
        "budget": budget,
        "set": dict(reply or {}),
        **({"decision": decided_now} if decided_now is not None else {}),
    }
    if raised_by is not None:
        raised = {name: value for name, value in {**change["budgets"], "budget": budget}.items() if value is not None}
        at = decisions.stamp(decisions.now())
        change["action"] = {"action": "raise-budget", "by": raised_by, "at": at, "budgets": raised}
    chain = resumable.chain
    envelope = apply_resume(envelope, chain, change)
    if host.state is not None and resumable.host_state:
        try:
            host.state.restore(resumable.host_state)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            problem = f"{type(error).__name__}: {error}"
            raise CheckpointError(f"{resumable.location}: malformed host state: {problem}") from None
    checkpoint = options.get("checkpoint")
    target = locate(checkpoint) if checkpoint is not None else resumable.location
    in_place = target.key == resumable.location.key
    # A clean resume of a signed envelope continues it where it is instead of rewriting it.
    continues = in_place and resumable.trusted and not resumable.crashed and envelope.signature is not None
    replace = in_place or options.get("replace", False)
    try:
        with claimed(target, resumable.lock if in_place else None, replace) as above:
            if not in_place:
                envelope.generation = max(envelope.generation, above)
                copy_segments(resumable.location, target, chain)
            return drive(
                envelope,
                chain,
                resumable.answers,
                resumable.loader,
                target,
                host,
                change=change if continues else None,
                resumed=not resumable.crashed,
                recovered=resumable.crashed,
                control=options.get("control"),
                observer=options.get("observer"),
                on_end=on_end,
            )
    finally:
        resumable.release()


def _require_answer(resumable: Resumable, reply: dict[str, Any]) -> None:
    """Refuse a `--set` that misspells the reply the run waits on (`approval.anwser` for
    `approval.answer`) when none answers it: the run would only ask again. A value set
    under another name leaves the question pending, as documented."""
    ask = resumable.chain[-1].ask
    pending = str(ask.get("reply_to") or "") if ask else ""
    answering = [path for path in reply if pending == path or pending.startswith(path + ".")]
    if ask is not None and decisions.is_decision(ask) and answering:
        raise CheckpointError(
            f"{resumable.location}: question {ask['question']} is a decision, answered with "
            f"--answer {'|'.join(ask.get('choices') or [])}, not --set {answering[0]}"
        )
    if not pending or answering:
        return
    for path in sorted(reply):
        hint = did_you_mean(path, [pending])
        if hint:
            raise CheckpointError(
                f"{resumable.location}: the run waits for a reply to {pending}, and --set {path} does not "
                f"answer it{hint}; give --set {pending}=<reply>"
            )


def decided(resumable: Resumable, reply: dict[str, Any], decision: Decision | None) -> Decision | None:
    """`decision` as the resume applies it: naming its question and stamped now, once
    `decisions.refusal` allows it with the values of `reply` set; else refused, nothing changed."""
    if decision is None:
        return None
    frame = resumable.chain[-1]
    context = dict(frame.context)
    for path, value in reply.items():
        assign(context, path, value, copy_maps=True)
    at = decisions.now()
    refused = decisions.refusal(frame, decision, context, at)
    if refused is not None:
        raise DecisionRefused(f"{resumable.location}: {refused}")
    assert frame.ask is not None, "a decision allowed answers the question pending"
    return {**decision, "question": frame.ask["question"], "at": decisions.stamp(at)}


BUDGET_REASONS = ("budget-exhausted", "cost-exhausted", "time-exhausted", "batch-ceiling")  # a raise goes on


def require_raise(resumable: Resumable, budget: int | None, bounds: dict[str, Any]) -> None:
    """Refuse, before anything is changed, a raise of budgets (`budget` the innermost level's steps,
    `bounds` the run's caps by name) that cannot take effect: the run is not parked on a budget, or
    no budget given is above the run's (it would suspend again at once)."""
    envelope = resumable.envelope
    if envelope.status != "suspended" or envelope.reason not in BUDGET_REASONS:
        why = envelope.reason if envelope.status == "suspended" else envelope.status
        raise CheckpointError(f"{resumable.location}: the run is not parked on a budget ({why}): no budget raised")
    caps = envelope.budgets
    current = {"budget": resumable.chain[-1].budget, **{name: getattr(caps, name) for name in bounds}}
    given = {"budget": budget, **bounds}
    if not any(value is not None and _above(value, current[name]) for name, value in given.items()):
        raise CheckpointError(f"{resumable.location}: no budget given is above the run's: it would park again at once")


def _above(value: float, current: float | None) -> bool:
    return current is not None and value > current


def drive(
    envelope: Envelope,
    chain: list[Frame],
    answers: dict[str, dict[str, Any]],
    loader: MachineLoader,
    location: Location,
    host: Host,
    *,
    change: dict[str, Any] | None = None,
    resumed: bool = False,
    recovered: bool = False,
    control: Control | None,
    observer: EventSink | None,
    on_end: Callable[[Envelope], None] | None = None,
) -> RunResult:
    """Run `chain` persisting to `location`, whose lock the caller holds (`claimed`), its spans
    continuing the trace its envelope names, else naming the new one there (`telemetry.traced`).

    Budgets, concurrency, hitl and the untrusted-flow policy come from the envelope. With `change`
    the stored envelope is continued in place (`StoreJournal.resume`); otherwise a snapshot of
    `chain` starts the run's journal. A `resumed` suspension that has spent its caps launches
    nothing (`continue_run`); a run neither `resumed` nor `recovered` is a new one (`start`).
    `on_end` is handed the envelope the run ended with once it is written, its journal dropped.
    """
    from mklang.checkpoint.journal import StoreJournal, durability_setting
    from mklang.runs import cancelling
    from mklang.runs.live import LiveAnswers

    control = control or Control()
    watch = cancelling.Watch(location, control)
    provider, pool = host.provider, host.settings.get("pool")
    if pool is not None:
        from mklang.runs.pooling import pooled

        provider = pooled(provider, location.store, pool, location.run, control.interrupted)
    with traced(observer, envelope.trace, location.run) as (observer, envelope.trace):
        budgets = envelope.budgets
        journal = StoreJournal(
            location,
            envelope,
            hashes=loader.hashes,
            host_state=host.state,
            answers=answers,
            durability=durability_setting(),
            paths=MachinePaths(chain[0].machine.path),
            new_run=not (resumed or recovered),
            watch=watch,
        )
        if change is None:
            journal.snapshot(chain, status="running")
        else:
            journal.resume(change, envelope.stored_bytes)
        options: RunOptions = {**host.toolbox(), **envelope.run_options(), "control": control, "observer": observer}
        live = LiveAnswers(location)
        rt = make_runtime(provider, journal=journal, loader=loader, run_id=envelope.run_id, answers=live, **options)
        caps = Caps(budgets.max_tokens, budgets.max_cost)
        try:
            result = continue_run(rt, chain, caps, suspendable=True, resumed=resumed, recovered=recovered)
        finally:
            live.close()
        usage = result.usage.to_json()
        cancelled = watch.ended()
        if result.status == "suspended" and cancelled is not None:  # an operator's cancel: it halts
            cancelling.halt(journal, result.frames, cancelled, usage=usage)
            result = replace(result, status="halted", error=cancelling.CANCELLED, detail=None)
        elif result.status == "suspended":
            journal.finish(
                result.frames,
                status="suspended",
                reason=result.error,
                detail=result.detail,
                ask=result.ask,
                reply_to=result.reply_to,
                at=result.at,
                usage=usage,
            )
        else:
            journal.finish(
                [chain[0]], status=result.status, error=result.error, at=result.at, result=result.result, usage=usage
            )
        if on_end is not None:
            on_end(journal.envelope)
        return result
