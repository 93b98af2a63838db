"""The run service: the one door through which a run is started, opened and driven.

`start` runs a machine with a `Host`, durably when given a checkpoint (a file
path, or `STORE-URI#RUN`), else in memory through the engine. A stored run is
opened in named steps, its lock held from the first (`open_run`):

    lock -> read -> verify -> rebuild -> recover -> fit

`_read` takes the envelope, `_verify` its seal, generation and status and the
sha256 of its machine files, `_rebuild` its frames on those machines,
`_recover` the journal of a run whose process died, and `_fit` checks that
the frames fit the machines and the spend is sane, and distrusts every value
of a run not signed with this user's key. `proceed` then drives it (`_drive`:
the journal, the runtime, `continue_run`, the finish); `resume` is both.

Batches and workers `claim` a run of a store: what it came to (`outcome`)
and whether it is started or continued are decided with its lock held. They
exchange signed notes (run records, worker reports) through `write_signed`
and `read_signed`. The CLI, the Python API, batches, workers and `mklang
show` reach stored runs only through here.

The envelope and journal modules (pydantic) are imported by the functions
that store a run, so a run kept in memory does not load them.
"""

from __future__ import annotations

import hashlib
import hmac
import shlex
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from mklang.checkpoint import generations
from mklang.checkpoint.paths import MachinePaths, located_host, root_file
from mklang.checkpoint.signing import SEAL_TEXT, checkpoint_key, seal_of, sign
from mklang.checkpoint.texts import keep_texts, machine_root
from mklang.effects import check_policy
from mklang.engine import Control, RunOptions, RunResult, continue_run, make_runtime, run
from mklang.engine.events import EventSink, Named
from mklang.engine.frame import Frame
from mklang.engine.runtime import Caps
from mklang.errors import CheckpointError, LoadError, MklangError, RunBusy, UsageError, did_you_mean, first_line
from mklang.limits import load_json
from mklang.model import Machine
from mklang.providers.base import Usage, decode_answer
from mklang.session import Host, preflight
from mklang.stores import Location, NoteStore, RunLock, Store, locate, run_name
from mklang.syntax.machines import MachineLoader, file_sha256
from mklang.telemetry import traced
from mklang.terminal import printable
from mklang.version import __version__
from mklang.vocabulary import DEFAULT_RUN_CONCURRENCY

if TYPE_CHECKING:
    from mklang.checkpoint.envelope import Envelope

__all__ = [
    "Claim",
    "OpenOptions",
    "Outcome",
    "Removal",
    "Resumable",
    "RunSettings",
    "claim",
    "fleet_mac",
    "open_run",
    "opened",
    "outcome",
    "proceed",
    "read_signed",
    "record_key",
    "remove_run",
    "report_key",
    "resume",
    "start",
    "verified",
    "write_signed",
]

PARKED = "escalated"  # a run waiting for a human reply; only `resume --set` continues it


# --- Starting a run -------------------------------------------------------------------


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


def start(
    machine: Machine,
    context: dict[str, Any] | None,
    host: Host,
    *,
    suspendable: bool = False,
    held: RunLock | None = None,
    texts: dict[str, str] | None = None,
    on_end: Callable[[Envelope], None] | None = None,
    **options: Unpack[RunSettings],
) -> RunResult:
    """Run `machine` with `host`; with a checkpoint the run persists and suspends, and a
    resumable checkpoint exists from its first loop-top on.

    Without one, `suspendable` makes budgets suspend into the result's frames.
    A run not finished at the checkpoint is refused unless `replace`; `held`
    is the checkpoint's lock when the caller took it already; `texts` the
    machine texts its store keeps already (`keep_texts`: a batch keeps them
    once for all its runs); `on_end` is handed the envelope the run ended with,
    once it is written (`_drive`).

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
        with traced(observer, None) as (observer, _):
            in_memory: RunOptions = {**chosen, **host.toolbox(), "control": control, "observer": observer}
            return run(machine, context, provider=host.provider, suspendable=suspendable, **in_memory)
    from mklang.checkpoint.envelope import Budgets, Envelope, MachineRef

    loader = MachineLoader()
    loader.add(machine)
    location = locate(checkpoint)
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
    )
    frame = Frame.start(machine, context or {})
    with _claimed(location, held, replace) as above:
        envelope.generation = above
        return _drive(envelope, [frame], {}, loader, location, host, control=control, observer=observer, on_end=on_end)


@contextmanager
def _claimed(location: Location, held: RunLock | None, replace: bool) -> Iterator[int]:
    """Hold the lock of a location a run is about to take (`held`, else taken here and released
    after), once nothing there would be lost: no run, a finished one, or `replace` (docs/scale.md).

    The lock comes first: a run another process is still writing is busy, not replaced. Yields the
    generation written there last: a run replacing another writes the ones after it (ADR 0022).
    """
    lock = held or location.store.lock(location.run)
    try:
        if not replace:
            _require_vacant(location)
        yield location.store.generation(location.run)
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


# --- Opening a stored run: lock, read, verify, rebuild, recover, fit ------------------


@dataclass
class Resumable:
    """A verified checkpoint, rebuilt into frames, ready for a host.

    `lock` is held from before the checkpoint was read until the resumed run
    ends (`proceed`) or `release` is called.
    """

    location: Location
    envelope: Envelope
    chain: list[Frame]
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)  # paid answers to replay
    host_state: dict[str, Any] | None = None  # the host's state the run continues with
    loader: MachineLoader = field(default_factory=MachineLoader)
    crashed: bool = False
    machines_note: str | None = None  # why the machines run from the texts the store keeps, when they do
    trusted: bool = True  # signed with this user's key: it may choose host settings (ADR 0014)
    lock: RunLock | None = None
    notes: list[str] = field(default_factory=list)  # what the caller should tell the user before it runs

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


@dataclass
class _Verified:
    """What `_verify` established: whether the run is trusted, where its machines are, what to tell."""

    trusted: bool
    paths: MachinePaths
    machines_note: str | None
    notes: list[str]


class OpenOptions(TypedDict, total=False):
    """What a checkpoint is let through with when it is opened (`open_run`); all off by default.

    `trust`: a checkpoint not signed with this user's key is resumed as untrusted data
    (`Resumable.trusted` is False) instead of refused. `force`: its machine files are not
    checked against the sha256 it records. `machine_path`: the root machine file, when it
    moved. `kept_texts` (a worker): edited machine files are replaced by the texts the store
    keeps, as missing ones always are, instead of refused. `allow_rollback`: an older
    generation of a run than one already written is not refused as a rollback (ADR 0022).
    """

    force: bool
    machine_path: str | None
    trust: bool
    kept_texts: bool
    allow_rollback: bool


def open_run(
    target: str | Path | Location, *, lock: bool = True, held: RunLock | None = None, **options: Unpack[OpenOptions]
) -> Resumable:
    """Lock (unless `lock` is False, or `held` is the lock already taken), read and verify a
    checkpoint, relaxed only as `options` say.

    The lock comes first, so no other process can change or run the
    checkpoint between this read and the end of the resumed run. Raises
    CheckpointError for anything unresumable, with the lock released.
    """
    location = locate(target)
    if held is None and lock:
        held = location.store.lock(location.run)
    try:
        envelope = _read(location)
        verified = _verify(location, envelope, **options)
        resumable = _rebuild(location, envelope, verified)
        _recover(resumable, verified.paths, options.get("trust", False))
        _fit(resumable)
    except BaseException:
        if held is not None:
            held.release()
        raise
    resumable.lock = held
    return resumable


def _read(location: Location) -> Envelope:
    """The run's envelope, its host's files where they are now."""
    from mklang.checkpoint.envelope import load

    envelope = load(location)
    return envelope.model_copy(update={"host": located_host(envelope.host, location.anchor)})


def _verify(
    location: Location,
    envelope: Envelope,
    *,
    trust: bool = False,
    allow_rollback: bool = False,
    force: bool = False,
    machine_path: str | None = None,
    kept_texts: bool = False,
) -> _Verified:
    """Its seal (refused unless signed with this user's key, or `trust`), its generation (no
    rollback), its status (not finished), and every machine file it loaded, unchanged."""
    trusted = _require_seal(location, envelope, trust)
    newest = max(location.store.generation(location.run), generations.seen(envelope.run_id))
    rolled_back = generations.rollback(str(location), envelope.run_id, envelope.generation, newest, allow_rollback)
    if envelope.status in ("done", "halted"):
        what = "finished" if envelope.status == "done" else f"halted ({envelope.error})"
        raise CheckpointError(f"{location}: the run already {what}; a finished run cannot be resumed")
    if not envelope.frames:
        raise CheckpointError(f"{location}: the checkpoint holds no frames")
    root = Path(machine_path) if machine_path else _recorded_root(location, envelope)
    note = None
    if machine_path is None and not force:  # files gone (or changed, on a worker): the texts the signature covers
        root, note = machine_root(location.store, root, {**envelope.texts, **envelope.machines}, changed=kept_texts)
    paths = MachinePaths(root)
    if not force:
        _verify_hashes(envelope.machines, paths)
    return _Verified(trusted, paths, note, [rolled_back] if rolled_back else [])


def _require_seal(location: Location, envelope: Envelope, trust: bool) -> bool:
    """Whether the envelope is signed with this user's key; refuse it otherwise, unless `trust`."""
    if envelope.seal == "signed":
        return True
    if not trust:
        raise CheckpointError(
            f"{location}: the checkpoint is {SEAL_TEXT[envelope.seal]}; resume it with --trust to run it "
            f"as untrusted data (host settings from your command line only)"
        )
    return False


def _recorded_root(location: Location, envelope: Envelope) -> Path:
    if not envelope.machine.path:
        raise CheckpointError(f"{location}: the checkpoint records no root machine file (use --machine PATH)")
    return root_file(envelope.machine.path, location.anchor)


def _verify_hashes(machines: dict[str, str], paths: MachinePaths) -> None:
    """Every machine file the run loaded is where the checkpoint says, unchanged."""
    for name, digest in sorted(machines.items()):
        file = paths.file(name)
        try:
            current = file_sha256(file)
        except OSError:
            raise CheckpointError(
                f"{file}: machine file of the checkpoint is missing (use --machine PATH if the root moved, or --force)"
            ) from None
        if current != digest:
            raise CheckpointError(
                f"{file}: machine file changed since the checkpoint was written "
                f"(resume with --force to accept the change)"
            )


def _rebuild(location: Location, envelope: Envelope, verified: _Verified) -> Resumable:
    """The recorded frames on the machines they run, the root machine first."""
    from mklang.checkpoint.compat import rebuild
    from mklang.checkpoint.segments import reader, require_present

    loader = MachineLoader()
    machine_for = _frame_reader(location, envelope.machines, verified.paths, loader)
    read = reader(location.store, location.run, str(location), trusted=verified.trusted)
    chain = [rebuild(frame, machine_for(frame), str(location), read) for frame in map(dict, envelope.frames)]
    require_present(location, chain)
    if verified.paths.root is not None and chain[0].machine.path != str(verified.paths.root):
        raise CheckpointError(f"{location}: the first frame does not run the root machine {verified.paths.root}")
    if envelope.reason == "escalated" and "ask" not in envelope.frames[-1]:
        # Written before frames kept their pending ask: the envelope's ask is the one pending.
        chain[-1].ask = {"ask": envelope.ask, "reply_to": envelope.reply_to}
    return Resumable(
        location,
        envelope,
        chain,
        dict(envelope.answers),
        envelope.host.state,
        loader,
        machines_note=verified.machines_note,
        trusted=verified.trusted,
        notes=verified.notes,
    )


def _frame_reader(
    location: Location, machines: dict[str, str], paths: MachinePaths, loader: MachineLoader, *, digests: bool = False
) -> Callable[[dict[str, Any]], Machine]:
    """Loads the machine of a recorded frame: only a hashed file.

    With `digests` (the `enter` lines of a signed journal) a frame may also
    carry the sha256 of a machine first loaded after the last snapshot.
    """
    from mklang.checkpoint.compat import frame_shape_error

    def machine_for(frame: dict[str, Any]) -> Machine:
        problem = frame_shape_error(frame)
        if problem is not None:
            raise CheckpointError(f"{location}: malformed frame: {problem}")
        name = str(paths.name(frame["path"]))  # format-1 journals hold absolute paths
        digest = machines.get(name) or (frame.get("sha256") if digests else None)
        if digest is None:
            raise CheckpointError(
                f"{location}: a frame of machine '{frame['machine']}' names {name}, "
                f"which is not one of the checkpoint's hashed machine files"
            )
        file = paths.file(name)
        try:
            machine = loader.load_path(file)
        except LoadError as error:
            raise CheckpointError(f"{location}: cannot load machine {file}: {error}") from None
        except OSError as error:
            raise CheckpointError(f"{location}: cannot read machine {file}: {error.strerror}") from None
        if name not in machines:
            _verify_hashes({name: digest}, paths)
        return machine

    return machine_for


def _recover(resumable: Resumable, paths: MachinePaths, trust: bool) -> None:
    """When the process died (the envelope says running, or a resume of it is journaled):
    replay its journal into the frames, the paid answers and the host's state."""
    from mklang.checkpoint.journal import recover, resume_change

    location, envelope = resumable.location, resumable.envelope
    change = resume_change(location.store, location.run, envelope)
    if envelope.status != "running" and change is None:
        return
    records, resumable.trusted = _journal(location, envelope, resumable.trusted, trust, resumable.notes)
    try:
        if change is not None:  # it died resuming this envelope: redo what that resume changed
            resumable.envelope = _resumed(envelope, resumable.chain, change)
        entered = _frame_reader(location, envelope.machines, paths, resumable.loader, digests=resumable.trusted)
        resumable.chain, resumable.answers, host_state = recover(resumable.chain, envelope.answers, records, entered)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
        raise CheckpointError(f"{location}: malformed journal: {type(error).__name__}: {error}") from None
    resumable.host_state = host_state or resumable.host_state
    resumable.crashed = True


def _journal(
    location: Location, envelope: Envelope, trusted: bool, trust: bool, notes: list[str]
) -> tuple[list[dict[str, Any]], bool]:
    """The journal records of a crashed run, and whether the checkpoint is still trusted.

    The journal of a signed envelope must carry its chained MACs; with `trust`
    an edited journal is read as untrusted data instead of refused. A torn end is reported in `notes`.
    """
    from mklang.checkpoint.journal import read_journal

    if not trusted or envelope.signature is None:
        return read_journal(location, envelope.generation, notes=notes), False
    try:
        return read_journal(location, envelope.generation, chain_from=envelope.signature.hmac, notes=notes), True
    except CheckpointError:
        if not trust:
            raise
        return read_journal(location, envelope.generation, notes=notes), False


def _fit(resumable: Resumable) -> None:
    """Every frame fits its machine and every spend is sane; an untrusted run's values are all
    tainted and its step budgets at most its machines' (a trusted run's generation is remembered)."""
    from mklang.checkpoint.compat import first_misfit

    location = resumable.location
    misfit = first_misfit(resumable.chain)
    if misfit is not None:
        raise CheckpointError(f"{location}: {misfit}")
    _check_spend(location, resumable)
    if resumable.trusted:
        generations.remember(resumable.envelope.run_id, resumable.envelope.generation)
        return
    for frame in resumable.chain:  # its taint marks are as untrusted as the rest: distrust every value
        frame.tainted.update(frame.context)
        frame.external.update(frame.context)
        frame.decision_tainted = True
        if frame.budget > frame.machine.budget:  # the lower step budget wins; --budget raises it
            resumable.notes.append(
                f"the checkpoint is not signed with your key: ignored its step budget {frame.budget} for "
                f"{frame.machine.name} (at most the machine's {frame.machine.budget}; --budget N)"
            )
            frame.budget = frame.machine.budget


def _check_spend(location: Location, resumable: Resumable) -> None:
    """Every spend the file records is a finite, non-negative number within limits: the run's,
    its frames' and their kept branches', and each paid answer's (budgets stop a run by them)."""
    try:
        Usage.from_json(resumable.envelope.usage)
        for frame in resumable.chain:
            _ = frame.spent
        for entry in resumable.answers.values():
            decode_answer(entry["kind"], entry["v"])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{location}: malformed spend: {type(error).__name__}: {error}") from None


@contextmanager
def opened(
    source: str | Path | Location, *, held: RunLock | None = None, **options: Unpack[OpenOptions]
) -> Iterator[Resumable]:
    """`open_run` for a block: the lock is held until the run ends or the block does.

    Everything that can make it unresumable is raised here, before the caller
    sets up any provider; what the user should know before it runs (a rollback
    allowed, a torn journal) is printed on stderr.
    """
    resumable = open_run(source, held=held, **options)
    for note in resumable.notes:
        print(f"mklang: note: {printable(note)}", file=sys.stderr)
    try:
        yield resumable
    finally:
        resumable.release()


# --- Driving an opened run ----------------------------------------------------------


def proceed(
    resumable: Resumable,
    host: Host,
    *,
    reply: dict[str, Any] | None = None,
    budget: int | None = None,
    on_end: Callable[[Envelope], None] | None = None,
    **options: Unpack[RunSettings],
) -> RunResult:
    """Continue an opened checkpoint with `host`; raised budgets are new totals, spend included.

    `reply` maps dotted context paths to the values set before the run continues (`--set`),
    the answer to a parked question among them.

    The checkpoint then records `host`'s settings, not the ones it was read
    with, so a later resume never reuses settings that an untrusted file
    brought in. The run persists to `checkpoint` (default: where it was read
    from; another location is `_claimed`, so an unfinished run there is
    refused unless `replace`); the lock taken by `open_run` is released when
    the run ends. `on_end` is handed the envelope the run ended with, as `start`'s is.
    """
    from mklang.checkpoint.segments import copy_segments
    from mklang.checkpoint.trust import BUDGETS, run_settings

    preflight(resumable.chain[0].machine, host)
    envelope = resumable.envelope
    given: dict[str, Any] = {name: options.get(name) for name in (*BUDGETS, "hitl", "concurrency")}
    untrusted_flow = options.get("untrusted_flow")
    given["untrusted_flow"] = None if untrusted_flow is None else check_policy(untrusted_flow)
    recorded = {
        **envelope.budgets.model_dump(),
        "hitl": envelope.hitl,
        "concurrency": envelope.concurrency,
        "untrusted_flow": envelope.untrusted_flow,
    }
    settings, ignored = run_settings(recorded, given, resumable.trusted)
    if ignored:
        print(
            f"mklang: the checkpoint is not signed with your key: ignored its recorded {'; '.join(ignored)}",
            file=sys.stderr,
        )
    _require_answer(resumable, reply or {})
    change = {
        "budgets": {name: settings[name] for name in BUDGETS},
        "hitl": settings["hitl"],
        "untrusted_flow": settings["untrusted_flow"],
        "concurrency": settings["concurrency"],
        "host": host.recorded().model_copy(update={"state": envelope.host.state}).model_dump(mode="json"),
        "budget": budget,
        "set": dict(reply or {}),
    }
    chain = resumable.chain
    envelope = _resumed(envelope, chain, change)
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
        with _claimed(target, resumable.lock if in_place else None, replace) as above:
            if not in_place:
                envelope.generation = max(envelope.generation, above)
                copy_segments(resumable.location, target, chain)
            return _drive(
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
    if not pending or any(pending == path or pending.startswith(path + ".") for path in reply):
        return
    for path in sorted(reply):
        hint = did_you_mean(path, [pending])
        if hint:
            raise CheckpointError(
                f"{resumable.location}: the run waits for a reply to {pending}, and --set {path} does not "
                f"answer it{hint}; give --set {pending}=<reply>"
            )


def _resumed(envelope: Envelope, chain: list[Frame], change: dict[str, Any]) -> Envelope:
    """Apply what a resume changes (as its journal records it) to the frames and the envelope.

    `change`: the new budgets, hitl, untrusted-flow policy, concurrency and host record, the innermost
    level's step `budget` (None keeps it) and the `set` values that answer it.
    """
    from mklang.checkpoint.envelope import Budgets, HostSettings

    innermost = chain[-1]
    if change["budget"] is not None:
        innermost.budget = int(change["budget"])
    for dotted, value in change["set"].items():  # a human reply is untrusted data like any host input
        innermost.inject(dotted, value)
    return envelope.model_copy(
        update=dict(
            status="running",
            budgets=Budgets.model_validate(change["budgets"]),
            hitl=bool(change["hitl"]),
            untrusted_flow=change.get("untrusted_flow", envelope.untrusted_flow),
            concurrency=int(change["concurrency"]),
            host=HostSettings.model_validate(change["host"]),
            reason=None,
            ask=None,
            reply_to=None,
            detail=None,
        )
    )


def _drive(
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
    """Run `chain` persisting to `location`, whose lock the caller holds (`_claimed`), its spans
    continuing the trace its envelope names, else naming the new one there (`telemetry.traced`).

    Budgets, concurrency, hitl and the untrusted-flow policy come from the envelope. With `change`
    the stored envelope is continued in place (`StoreJournal.resume`); otherwise a snapshot of
    `chain` starts the run's journal. A `resumed` suspension that has spent its caps launches
    nothing (`continue_run`); a run neither `resumed` nor `recovered` is a new one (`start`).
    `on_end` is handed the envelope the run ended with once it is written, its journal dropped.
    """
    from mklang.checkpoint.journal import StoreJournal, durability_setting

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
        )
        if change is None:
            journal.snapshot(chain, status="running")
        else:
            journal.resume(change, envelope.stored_bytes)
        options: RunOptions = {**host.toolbox(), **envelope.run_options(), "control": control, "observer": observer}
        rt = make_runtime(host.provider, journal=journal, loader=loader, run_id=envelope.run_id, **options)
        caps = Caps(budgets.max_tokens, budgets.max_cost)
        result = continue_run(rt, chain, caps, suspendable=True, resumed=resumed, recovered=recovered)
        usage = result.usage.to_json()
        if result.status == "suspended":
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


def resume(
    source: str | Path | Location | Envelope,
    host: Host,
    *,
    force: bool = False,
    machine_path: str | None = None,
    trust: bool = False,
    allow_rollback: bool = False,
    checkpoint: str | Path | Location | None = None,
    **options: Any,
) -> RunResult:
    """Verify a checkpoint, then continue it with `host`.

    `source` is a checkpoint file or an `Envelope`; an envelope is first
    written to `checkpoint` (required then), with the trace segments it
    names (`segments.placed`). A re-suspension goes to
    `checkpoint`, by default the same file. Other options are those of `proceed`.
    """
    from mklang.checkpoint.envelope import Envelope, save
    from mklang.checkpoint.segments import placed

    if isinstance(source, Envelope):
        if checkpoint is None:
            raise CheckpointError("resuming an Envelope needs checkpoint=PATH to persist the run to")
        target = locate(checkpoint)
        save(target, placed(source, target))
        source = target
    with opened(
        source, force=force, machine_path=machine_path, trust=trust, allow_rollback=allow_rollback
    ) as resumable:
        return proceed(resumable, host, checkpoint=checkpoint, **options)


# --- Runs of a store: what they came to, and taking one under its lock -----------------


@dataclass
class Outcome:
    """What became of one run, as its envelope in the store says."""

    run: str
    status: str  # done | halted | suspended | pending | failed
    reason: str | None = None
    result: Any = None
    usage: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.run,
            "status": self.status,
            "reason": self.reason,
            "result": self.result,
            "usage": self.usage,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Outcome:
        return cls(str(data["id"]), data["status"], data.get("reason"), data.get("result"), data.get("usage") or {})

    @property
    def settled(self) -> bool:
        """Nothing a batch pass can do changes it: done, halted, or parked on a human question."""
        return self.status in ("done", "halted") or (self.status == "suspended" and self.reason == PARKED)


def outcome(store: Store, run: str) -> Outcome:
    """A run's outcome as its envelope says; `pending` when it has not run or is still running.

    A run that cannot be read, or whose envelope is not signed with this
    user's key, is `failed` with the reason: what fails verification is never
    reported as a result.
    """
    return _read_outcome(store, run)[0]


def _read_outcome(store: Store, run: str) -> tuple[Outcome, bool | None]:
    """`outcome`, and whether the store holds an envelope of the run (None: it could not be read)."""
    from mklang.checkpoint.envelope import parse
    from mklang.checkpoint.journal import resume_change

    stored = None
    try:
        raw = store.read(run_name(run))
        stored = raw is not None
        if raw is None:
            return Outcome(run, "pending"), stored
        envelope = parse(raw, run)
        if envelope.seal != "signed":
            return Outcome(run, "failed", f"{run}: the checkpoint is {SEAL_TEXT[envelope.seal]}"), stored
        running = envelope.status == "running" or resume_change(store, run, envelope) is not None
    except MklangError as error:
        return Outcome(run, "failed", first_line(error)), stored
    return _outcome_of(run, envelope, running), stored


def _outcome_of(run: str, envelope: Envelope, running: bool) -> Outcome:
    """What a run came to as its signed `envelope` says; `running`: it is still running, or a
    resume of it started and died (its journal says so)."""
    status: str = envelope.status
    if running or (status == "suspended" and envelope.reason == "interrupted"):
        status = "pending"  # a crashed or interrupted run: the next pass resumes it
    return Outcome(
        run,
        status,
        envelope.reason if status == "suspended" else envelope.error,
        envelope.result,
        dict(envelope.usage),
    )


@dataclass
class Claim:
    """A run of a store whose lock this process holds: what it came to, and starting or
    continuing it, are decided with the run held, never from a read made before."""

    location: Location
    lock: RunLock
    _stored: bool | None = field(default=None, repr=False)  # whether `outcome` found an envelope (None: unread)

    def outcome(self) -> Outcome:
        told, self._stored = _read_outcome(self.location.store, self.location.run)
        return told

    def run(
        self,
        machine: Machine,
        context: dict[str, Any],
        host: Host,
        *,
        texts: Callable[[], dict[str, str]],
        kept_texts: bool,
        hitl: bool | None,
        control: Control,
        observer: EventSink | None = None,
        **budgets: Any,
    ) -> Outcome:
        """Start the run with `context` when the store holds none, else continue it (its own context).

        A run started here keeps `texts()` as its machine texts and `hitl`; a run continued here
        runs the texts the store keeps in place of edited files with `kept_texts`. `budgets`:
        `max_tokens`, `max_cost`, `max_time` and the `untrusted_flow` policy, for either. The
        run's events go to `observer` with the run's name. Whether the store holds the run is
        what `outcome` read under this lock, when it was asked.

        Its outcome is the one `outcome` reads from the store, taken from the envelope the run
        wrote last, under this lock, instead of read and verified again (ADR 0044)."""
        from mklang.checkpoint.envelope import read_back

        store, run = self.location.store, self.location.run
        if observer is not None:
            observer = Named(observer, run)
        ended: list[Envelope] = []
        stored = self._stored if self._stored is not None else store.read(run) is not None
        if not stored:
            start(
                machine,
                context,
                host,
                checkpoint=self.location,
                replace=True,  # nothing is there: read under this lock
                control=control,
                hitl=hitl,
                held=self.lock,
                texts=texts(),
                observer=observer,
                on_end=ended.append,
                **budgets,
            )
        else:
            with opened(self.location, kept_texts=kept_texts, held=self.lock) as resumable:
                proceed(resumable, host, control=control, observer=observer, on_end=ended.append, **budgets)
        (written,) = ended
        return _outcome_of(run, written.model_copy(update=read_back(written, "result", "usage")), running=False)

    def release(self) -> None:
        self.lock.release()


def claim(location: Location) -> Claim:
    """Take the lock of a run of a store (RunBusy while another process holds it)."""
    return Claim(location, location.store.lock(run_name(location.run)))


# --- Removing a stored run -------------------------------------------------------------

FINISHED = ("done", "halted")


@dataclass
class Removal:
    """What `remove_run` did with one run: `status` as its signed envelope says (None: unverified)."""

    run: str
    removed: bool
    status: str | None
    why: str | None = None  # why it was kept

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "removed": self.removed, "status": self.status, "why": self.why}


def remove_run(location: Location, *, unfinished: bool = False, statuses: tuple[str, ...] = FINISHED) -> Removal:
    """Remove a stored run (envelope, journal, summary, run record and worker report) under its lock.

    What may be removed is decided with the lock held, from the envelope, never from a summary: a
    run another process holds is kept; so is one whose signed status is not in `statuses`, and an
    unfinished one (running, suspended, or not signed with this user's key) unless `unfinished`.
    Bytes that are not a checkpoint are never removed.
    """
    from mklang.checkpoint.envelope import parse
    from mklang.checkpoint.journal import resume_change

    store, run = location.store, run_name(location.run)
    shown = printable(str(location))
    try:
        lock = store.lock(run)
    except CheckpointError as error:  # held by a live process (RunBusy), or no lock can be taken there
        return Removal(shown, False, "running" if isinstance(error, RunBusy) else None, first_line(error))
    try:
        try:
            raw = store.read(run)
            if raw is None:
                return Removal(shown, False, None, f"{shown}: no such run")
            envelope = parse(raw, shown)
        except CheckpointError as error:  # not a checkpoint (or not one this version reads): never removed
            return Removal(shown, False, None, f"{first_line(error)}: not removed")
        status: str | None = None
        if envelope.seal == "signed":
            status = "running" if resume_change(store, run, envelope) is not None else envelope.status
        if status not in FINISHED and not unfinished:
            state = status or SEAL_TEXT[envelope.seal]
            return Removal(shown, False, status, f"{shown}: not finished ({state}): --unfinished removes it")
        if status in FINISHED and status not in statuses:
            return Removal(shown, False, status, f"{shown}: {status}, not {' or '.join(statuses)}")
        store.remove(run)
        for key in (record_key(run), report_key(run)):
            store.drop_note(key)
        return Removal(shown, True, status)
    finally:
        lock.release()


# --- Signed notes: run records and worker reports (ADR 0024) ------------------------


def report_key(run: str) -> str:
    """The note under which a worker reports what became of a run."""
    return f"run:{run}"


def record_key(run: str) -> str:
    """The note of a batch run's record: its machine, context and budgets, for a worker."""
    return f"record:{run}"


def write_signed(store: NoteStore, key: str, document: dict[str, Any]) -> None:
    """Replace the note under `key` with `document` signed with the checkpoint key (the fleet's)."""
    store.write_note(key, sign(document, checkpoint_key())[0])


def read_signed(store: NoteStore, key: str, what: str) -> dict[str, Any] | None:
    """The document of a signed note (None when there is none); CheckpointError unless the fleet key signed it."""
    raw = store.read_note(key)
    return None if raw is None else verified(raw, what)


def verified(raw: bytes, what: str) -> dict[str, Any]:
    """The document a signed note's bytes hold; CheckpointError unless the fleet key signed it."""
    try:
        document = load_json(raw)
    except ValueError:
        document = None
    if not isinstance(document, dict):
        raise CheckpointError(f"{what} is not a JSON object")
    seal = seal_of(document, checkpoint_key(), raw)
    if seal != "signed":
        raise CheckpointError(f"{what} is {SEAL_TEXT[seal].replace('your', 'the fleet')}")
    return document


def fleet_mac(message: str) -> str:
    """The MAC of `message` with the checkpoint key: who holds the fleet's key sent it."""
    return hmac.new(checkpoint_key(), message.encode(), hashlib.sha256).hexdigest()
