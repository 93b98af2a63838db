"""Suspend, persist and resume runs (SPEC section 7).

`start` runs a machine with a checkpoint; `open_checkpoint` locks, reads and
verifies one *before* any provider exists; `continue_checkpoint` resumes it
and releases the lock. A checkpoint is a file path or a run in a store
(`mklang.stores`); the engine writes it through the store it is
given. `mklang.session.resume` is the one-call API over the last two.
"""

from __future__ import annotations

import shlex
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack

from mklang.checkpoint import generations
from mklang.checkpoint.compat import first_misfit, frame_shape_error, rebuild
from mklang.checkpoint.envelope import Budgets, Envelope, HostSettings, MachineRef, load, parse
from mklang.checkpoint.journal import StoreJournal, durability_setting, read_journal, recover, resume_change
from mklang.checkpoint.paths import MachinePaths, located_host, root_file
from mklang.checkpoint.signing import SEAL_TEXT
from mklang.checkpoint.texts import keep_texts, machine_root
from mklang.checkpoint.trust import BUDGETS, run_settings
from mklang.effects import check_policy
from mklang.engine import Control, RunOptions, RunResult, continue_run, make_runtime
from mklang.engine.frame import Frame
from mklang.engine.runtime import Caps, Observer
from mklang.errors import CheckpointError, LoadError, did_you_mean
from mklang.host.registry import HostCallables
from mklang.model import Machine
from mklang.providers.base import Provider, Usage, decode_answer
from mklang.stores import Location, RunLock, locate
from mklang.syntax.machines import MachineLoader, file_sha256
from mklang.version import __version__

if TYPE_CHECKING:
    from mklang.scenarios import ScriptedHost

__all__ = ["Resumable", "continue_checkpoint", "open_checkpoint", "resumed", "start"]


def start(
    machine: Machine,
    context: dict[str, Any] | None,
    *,
    checkpoint: str | Path | Location,
    provider: Provider,
    host: HostSettings | None = None,
    scripted: ScriptedHost | None = None,
    replace: bool = False,
    held: RunLock | None = None,
    texts: dict[str, str] | None = None,
    **options: Unpack[RunOptions],
) -> RunResult:
    """Run `machine` durably: a resumable checkpoint exists from the first loop-top on.

    `scripted` (a `ScriptedHost`) lets the checkpoint save which scripted
    answers were consumed. A run that is not finished at `checkpoint` is
    refused unless `replace` (`claimed`); `held` is its lock when the caller
    took it already. `texts` are the machine texts the store keeps already
    (`keep_texts`: a batch keeps them once for all its runs).
    """
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
        budgets=Budgets(
            max_tokens=options.get("max_tokens"), max_cost=options.get("max_cost"), max_time=options.get("max_time")
        ),
        hitl=options.get("hitl", False),
        untrusted_flow=check_policy(options.get("untrusted_flow") or "report"),
        concurrency=options.get("concurrency", 8),
        host=host or HostSettings(),
    )
    frame = Frame.start(machine, context or {})
    with claimed(location, held, replace) as above:
        envelope.generation = above
        return _execute(envelope, [frame], {}, loader, location, provider=provider, scripted=scripted, **options)


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
            require_vacant(location)
        yield location.store.generation(location.run)
    finally:
        if held is None:
            lock.release()


def require_vacant(location: Location) -> None:
    """Refuse a location that holds a run not finished, or anything that is not a run."""
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


@dataclass
class Resumable:
    """A verified checkpoint, rebuilt into frames, ready for a provider.

    `lock` is held from before the checkpoint was read until the resumed run
    ends (`continue_checkpoint`) or `release` is called.
    """

    location: Location
    envelope: Envelope
    chain: list[Frame]
    replay: dict[str, dict[str, Any]] = field(default_factory=dict)
    position: dict[str, Any] | None = None
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


def open_checkpoint(
    target: str | Path | Location,
    *,
    force: bool = False,
    machine_path: str | None = None,
    trust: bool = False,
    lock: bool = True,
    kept_texts: bool = False,
    allow_rollback: bool = False,
    held: RunLock | None = None,
) -> Resumable:
    """Lock (unless `lock` is False, or `held` is the lock already taken), read and verify a checkpoint.

    The lock comes first, so no other process can change or run the
    checkpoint between this read and the end of the resumed run. Raises
    CheckpointError for anything unresumable, with the lock released.

    A checkpoint not signed with this user's key is refused unless `trust`;
    then it is resumed as untrusted data (`Resumable.trusted` is False).
    Missing machine files are replaced by the texts the store keeps; edited
    ones too with `kept_texts` (a worker), else they are refused.
    An older generation of a run than one already written is refused as a
    rollback unless `allow_rollback` (ADR 0022).
    """
    location = locate(target)
    if held is None and lock:
        held = location.store.lock(location.run)
    try:
        resumable = _read_checkpoint(
            location,
            force=force,
            machine_path=machine_path,
            trust=trust,
            kept_texts=kept_texts,
            allow_rollback=allow_rollback,
        )
    except BaseException:
        if held is not None:
            held.release()
        raise
    resumable.lock = held
    return resumable


def _read_checkpoint(
    location: Location,
    *,
    force: bool,
    machine_path: str | None,
    trust: bool,
    kept_texts: bool,
    allow_rollback: bool,
) -> Resumable:
    envelope = load(location)
    trusted = require_seal(location, envelope, trust)
    envelope = envelope.model_copy(update={"host": located_host(envelope.host, location.anchor)})
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
        verify_hashes(envelope.machines, paths)
    loader = MachineLoader()
    machine_for = _frame_reader(location, envelope.machines, paths, loader)
    chain = [rebuild(frame, machine_for(frame), str(location)) for frame in map(dict, envelope.frames)]
    if paths.root is not None and chain[0].machine.path != str(paths.root):
        raise CheckpointError(f"{location}: the first frame does not run the root machine {paths.root}")
    if envelope.reason == "escalated" and "ask" not in envelope.frames[-1]:
        # Written before frames kept their pending ask: the envelope's ask is the one pending.
        chain[-1].ask = {"ask": envelope.ask, "reply_to": envelope.reply_to}
    resumable = Resumable(
        location,
        envelope,
        chain,
        dict(envelope.answers),
        envelope.host.position,
        loader,
        machines_note=note,
        trusted=trusted,
    )
    resumable.notes += [rolled_back] if rolled_back else []
    change = resume_change(location.store, location.run, envelope)
    if envelope.status == "running" or change is not None:  # the process died: replay its journal
        records, resumable.trusted = _journal(location, envelope, trusted, trust, resumable.notes)
        try:
            if change is not None:  # it died resuming this envelope: redo what that resume changed
                resumable.envelope = resumed(envelope, chain, change)
            entered = _frame_reader(location, envelope.machines, paths, loader, digests=resumable.trusted)
            resumable.chain, resumable.replay, position = recover(chain, envelope.answers, records, entered)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
            raise CheckpointError(f"{location}: malformed journal: {type(error).__name__}: {error}") from None
        resumable.position = position or resumable.position
        resumable.crashed = True
    misfit = first_misfit(resumable.chain)
    if misfit is not None:
        raise CheckpointError(f"{location}: {misfit}")
    _check_spend(location, resumable)
    if not resumable.trusted:
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
    else:
        generations.remember(envelope.run_id, envelope.generation)
    return resumable


def _check_spend(location: Location, resumable: Resumable) -> None:
    """Every spend the file records is a finite, non-negative number within limits: the run's,
    its frames' and their kept branches', and each paid answer's (budgets stop a run by them)."""
    try:
        Usage.from_json(resumable.envelope.usage)
        for frame in resumable.chain:
            _ = frame.spent
        for entry in resumable.replay.values():
            decode_answer(entry["kind"], entry["v"])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{location}: malformed spend: {type(error).__name__}: {error}") from None


def _recorded_root(location: Location, envelope: Envelope) -> Path:
    if not envelope.machine.path:
        raise CheckpointError(f"{location}: the checkpoint records no root machine file (use --machine PATH)")
    return root_file(envelope.machine.path, location.anchor)


def verify_hashes(machines: dict[str, str], paths: MachinePaths) -> None:
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


def _frame_reader(
    location: Location, machines: dict[str, str], paths: MachinePaths, loader: MachineLoader, *, digests: bool = False
) -> Callable[[dict[str, Any]], Machine]:
    """Loads the machine of a recorded frame: only a hashed file.

    With `digests` (the `enter` lines of a signed journal) a frame may also
    carry the sha256 of a machine first loaded after the last snapshot.
    """

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
            verify_hashes({name: digest}, paths)
        return machine

    return machine_for


def require_seal(location: Location, envelope: Envelope, trust: bool) -> bool:
    """Whether the envelope is signed with this user's key; refuse it otherwise, unless `trust`."""
    if envelope.seal == "signed":
        return True
    if not trust:
        raise CheckpointError(
            f"{location}: the checkpoint is {SEAL_TEXT[envelope.seal]}; resume it with --trust to run it "
            f"as untrusted data (host settings from your command line only)"
        )
    return False


def _journal(
    location: Location, envelope: Envelope, trusted: bool, trust: bool, notes: list[str]
) -> tuple[list[dict[str, Any]], bool]:
    """The journal records of a crashed run, and whether the checkpoint is still trusted.

    The journal of a signed envelope must carry its chained MACs; with `trust`
    an edited journal is read as untrusted data instead of refused. A torn end is reported in `notes`.
    """
    if not trusted or envelope.signature is None:
        return read_journal(location, envelope.generation, notes=notes), False
    try:
        return read_journal(location, envelope.generation, chain_from=envelope.signature.hmac, notes=notes), True
    except CheckpointError:
        if not trust:
            raise
        return read_journal(location, envelope.generation, notes=notes), False


def continue_checkpoint(
    resumable: Resumable,
    *,
    provider: Provider,
    tools: HostCallables = None,
    hooks: HostCallables = None,
    read_only_tools: frozenset[str] = frozenset(),
    set_values: dict[str, Any] | None = None,
    max_tokens: int | None = None,
    max_cost: float | None = None,
    budget: int | None = None,
    max_time: float | None = None,
    hitl: bool | None = None,
    untrusted_flow: str | None = None,
    concurrency: int | None = None,
    checkpoint: str | Path | Location | None = None,
    scripted: ScriptedHost | None = None,
    host: HostSettings | None = None,
    control: Control | None = None,
    observer: Observer | None = None,
    replace: bool = False,
) -> RunResult:
    """Resume a verified checkpoint; raised budgets are new totals, spend included.

    `host` records how this process hosts the run (the checkpoint keeps the
    old record when it is None), so a later resume never reuses settings
    that an untrusted file brought in. The run persists to `checkpoint`
    (default: where it was read from; another location is `claimed`, so an
    unfinished run there is refused unless `replace`); the lock taken by
    `open_checkpoint` is released when the run ends.
    """
    envelope = resumable.envelope
    given = dict(
        max_tokens=max_tokens,
        max_cost=max_cost,
        max_time=max_time,
        hitl=hitl,
        concurrency=concurrency,
        untrusted_flow=None if untrusted_flow is None else check_policy(untrusted_flow),
    )
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
    require_answer(resumable, set_values or {})
    change = {
        "budgets": {name: settings[name] for name in BUDGETS},
        "hitl": settings["hitl"],
        "untrusted_flow": settings["untrusted_flow"],
        "concurrency": settings["concurrency"],
        "host": (
            envelope.host if host is None else host.model_copy(update={"position": envelope.host.position})
        ).model_dump(mode="json"),
        "budget": budget,
        "set": dict(set_values or {}),
    }
    chain = resumable.chain
    envelope = resumed(envelope, chain, change)
    if scripted is not None and resumable.position:
        scripted.restore(resumable.position)
    target = locate(checkpoint) if checkpoint is not None else resumable.location
    in_place = target.key == resumable.location.key
    # A clean resume of a signed envelope continues it where it is instead of rewriting it.
    continues = in_place and resumable.trusted and not resumable.crashed and envelope.signature is not None
    try:
        with claimed(target, resumable.lock if in_place else None, replace or in_place) as above:
            if not in_place:
                envelope.generation = max(envelope.generation, above)
            return _execute(
                envelope,
                chain,
                resumable.replay,
                resumable.loader,
                target,
                change if continues else None,
                resumed=not resumable.crashed,
                provider=provider,
                scripted=scripted,
                tools=tools,
                hooks=hooks,
                read_only_tools=read_only_tools,
                control=control,
                observer=observer,
            )
    finally:
        resumable.release()


def require_answer(resumable: Resumable, set_values: dict[str, Any]) -> None:
    """Refuse a `--set` that misspells the reply the run waits on (`approval.anwser` for
    `approval.answer`) when none answers it: the run would only ask again. A value set
    under another name leaves the question pending, as documented."""
    ask = resumable.chain[-1].ask
    pending = str(ask.get("reply_to") or "") if ask else ""
    if not pending or any(pending == path or pending.startswith(path + ".") for path in set_values):
        return
    for path in sorted(set_values):
        hint = did_you_mean(path, [pending])
        if hint:
            raise CheckpointError(
                f"{resumable.location}: the run waits for a reply to {pending}, and --set {path} does not "
                f"answer it{hint}; give --set {pending}=<reply>"
            )


def resumed(envelope: Envelope, chain: list[Frame], change: dict[str, Any]) -> Envelope:
    """Apply what a resume changes (as its journal records it) to the frames and the envelope.

    `change`: the new budgets, hitl, untrusted-flow policy, concurrency and host record, the innermost
    level's step `budget` (None keeps it) and the `set` values that answer it.
    """
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


def _execute(
    envelope: Envelope,
    chain: list[Frame],
    replay: dict[str, dict[str, Any]],
    loader: MachineLoader,
    location: Location,
    change: dict[str, Any] | None = None,
    *,
    resumed: bool = False,
    provider: Provider,
    scripted: ScriptedHost | None,
    **options: Unpack[RunOptions],
) -> RunResult:
    """Run `chain` persisting to `location`, whose lock the caller holds (`claimed`).

    Budgets, concurrency, hitl and the untrusted-flow policy come from the envelope; of `options` only the
    host callables and the tools the host classifies read-only, the control and the observer. With `change` the stored
    envelope is continued in place (`StoreJournal.resume`); otherwise a
    snapshot of `chain` starts the run's journal. A `resumed` suspension that has
    spent its caps launches nothing (`continue_run`).
    """
    budgets = envelope.budgets
    recorded: RunOptions = {
        **options,
        "concurrency": envelope.concurrency,
        "hitl": envelope.hitl,
        "untrusted_flow": envelope.untrusted_flow,
        "max_time": budgets.max_time,
    }
    journal = StoreJournal(
        location,
        envelope,
        hashes=loader.hashes,
        position=scripted.position if scripted is not None else None,
        skip=scripted.skip if scripted is not None else None,
        replay=replay,
        durability=durability_setting(),
        paths=MachinePaths(chain[0].machine.path),
    )
    if change is None:
        journal.snapshot(chain, status="running")
    else:
        journal.resume(change, envelope.stored_bytes)
    rt = make_runtime(
        provider,
        journal=journal,
        loader=loader,
        run_id=envelope.run_id,
        **recorded,
    )
    result = continue_run(rt, chain, Caps(budgets.max_tokens, budgets.max_cost), suspendable=True, resumed=resumed)
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
    return result
