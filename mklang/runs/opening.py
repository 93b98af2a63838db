"""Opening a stored run in named steps, its lock held from the first (`open_run`):

    lock -> read -> verify -> rebuild -> recover -> fit

`_read` takes the envelope, `_verify` its seal, generation and status and the
sha256 of its machine files, `_rebuild` its frames on those machines,
`_recover` the journal of a run whose process died, and `_fit` checks that
the frames fit the machines and the spend is sane, and distrusts every value
of a run not signed with this user's key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from mklang.checkpoint import generations
from mklang.checkpoint.paths import MachinePaths, located_host, root_file
from mklang.checkpoint.signing import SEAL_TEXT
from mklang.checkpoint.texts import machine_root
from mklang.engine.frame import Frame
from mklang.errors import CheckpointError, LoadError
from mklang.model import Machine
from mklang.providers.base import Usage, decode_answer
from mklang.runs.request import FLAGS, Tell, Words, on_stderr
from mklang.stores import Location, RunLock, locate
from mklang.syntax.machines import MachineLoader, file_sha256
from mklang.version import __version__

if TYPE_CHECKING:
    from mklang.checkpoint.envelope import Envelope


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
    # The machine files that passed the static checks when the run started, as far as this
    # version can tell: those of a trusted checkpoint it wrote, each found with its recorded sha256.
    checked: frozenset[str] = frozenset()

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
    hashed: frozenset[str]  # the machine files found with the sha256 the checkpoint records
    words: Words  # how a refusal names the caller's settings


class OpenOptions(TypedDict, total=False):
    """What a checkpoint is let through with when it is opened (`open_run`); all off by default.

    `trust`: a checkpoint not signed with this user's key is resumed as untrusted data
    (`Resumable.trusted` is False) instead of refused. `force`: its machine files are not
    checked against the sha256 it records. `machine_path`: the root machine file, when it
    moved. `kept_texts` (a worker): edited machine files are replaced by the texts the store
    keeps, as missing ones always are, instead of refused. `allow_rollback`: an older
    generation of a run than one already written is not refused as a rollback (ADR 0022).
    `words`: how a refusal names these settings (default: the command line's flags).
    """

    force: bool
    machine_path: str | None
    trust: bool
    kept_texts: bool
    allow_rollback: bool
    words: Words


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
        _recover(resumable, verified, options.get("trust", False))
        _fit(resumable)
        if resumable.trusted and resumable.envelope.mklang_version == __version__:
            resumable.checked = verified.hashed
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
    words: Words = FLAGS,
) -> _Verified:
    """Its seal (refused unless signed with this user's key, or `trust`), its generation (no
    rollback), its status (not finished), and every machine file it loaded, unchanged."""
    trusted = _require_seal(location, envelope, trust, words)
    newest = generations.newest(location.store, location.run, envelope.run_id)
    rolled_back = generations.rollback(str(location), envelope.run_id, envelope.generation, newest, allow_rollback)
    if envelope.status in ("done", "halted"):
        what = "finished" if envelope.status == "done" else f"halted ({envelope.error})"
        raise CheckpointError(f"{location}: the run already {what}; a finished run cannot be resumed")
    if not envelope.frames:
        raise CheckpointError(f"{location}: the checkpoint holds no frames")
    root = Path(machine_path) if machine_path else _recorded_root(location, envelope, words)
    note = None
    if machine_path is None and not force:  # files gone (or changed, on a worker): the texts the signature covers
        root, note = machine_root(location.store, root, {**envelope.texts, **envelope.machines}, changed=kept_texts)
    paths = MachinePaths(root)
    if not force:
        _verify_hashes(envelope.machines, paths, words)
    hashed = frozenset() if force else frozenset(str(paths.file(name)) for name in envelope.machines)
    return _Verified(trusted, paths, note, [rolled_back] if rolled_back else [], hashed, words)


def _require_seal(location: Location, envelope: Envelope, trust: bool, words: Words) -> bool:
    """Whether the envelope is signed with this user's key; refuse it otherwise, unless `trust`."""
    if envelope.seal == "signed":
        return True
    if not trust:
        raise CheckpointError(
            f"{location}: the checkpoint is {SEAL_TEXT[envelope.seal]}; resume it with {words.given('trust')} "
            f"to run it as untrusted data (host settings from {words.caller} only)"
        )
    return False


def _recorded_root(location: Location, envelope: Envelope, words: Words) -> Path:
    if not envelope.machine.path:
        raise CheckpointError(
            f"{location}: the checkpoint records no root machine file (use {words.given('machine', 'PATH')})"
        )
    return root_file(envelope.machine.path, location.anchor)


def _verify_hashes(machines: dict[str, str], paths: MachinePaths, words: Words) -> None:
    """Every machine file the run loaded is where the checkpoint says, unchanged."""
    for name, digest in sorted(machines.items()):
        file = paths.file(name)
        try:
            current = file_sha256(file)
        except OSError:
            raise CheckpointError(
                f"{file}: machine file of the checkpoint is missing (use {words.given('machine', 'PATH')} "
                f"if the root moved, or {words.given('force')})"
            ) from None
        if current != digest:
            raise CheckpointError(
                f"{file}: machine file changed since the checkpoint was written "
                f"(to move the parked run to it once it is checked compatible: {_migrating(words)}; "
                f"to accept the change unchecked: resume with {words.given('force')})"
            )


def _migrating(words: Words) -> str:
    """How the caller moves a parked run to an edited machine (ADR 0059)."""
    return "resume with --machine FILE --migrate" if words.flags else "mklang.runs.migrate(run, FILE), then resume"


def _rebuild(location: Location, envelope: Envelope, verified: _Verified) -> Resumable:
    """The recorded frames on the machines they run, the root machine first."""
    from mklang.checkpoint.compat import rebuild
    from mklang.checkpoint.segments import reader, require_present

    loader = MachineLoader()
    machine_for = _frame_reader(location, envelope.machines, verified, loader)
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
    location: Location, machines: dict[str, str], verified: _Verified, loader: MachineLoader, *, digests: bool = False
) -> Callable[[dict[str, Any]], Machine]:
    """Loads the machine of a recorded frame: only a hashed file.

    With `digests` (the `enter` lines of a signed journal) a frame may also
    carry the sha256 of a machine first loaded after the last snapshot.
    """
    from mklang.checkpoint.compat import frame_shape_error

    paths = verified.paths

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
            _verify_hashes({name: digest}, paths, verified.words)
        return machine

    return machine_for


def _recover(resumable: Resumable, verified: _Verified, trust: bool) -> None:
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
            resumable.envelope = apply_resume(envelope, resumable.chain, change)
        entered = _frame_reader(location, envelope.machines, verified, resumable.loader, digests=resumable.trusted)
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
        generations.remember(location.store, resumable.envelope.run_id, resumable.envelope.generation)
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
    source: str | Path | Location,
    *,
    held: RunLock | None = None,
    tell: Tell = on_stderr,
    **options: Unpack[OpenOptions],
) -> Iterator[Resumable]:
    """`open_run` for a block: the lock is held until the run ends or the block does.

    Everything that can make it unresumable is raised here, before the caller
    sets up any provider; what the user should know before it runs (a rollback
    allowed, a torn journal, machines run from the texts the store keeps) is told to `tell`.
    """
    resumable = open_run(source, held=held, **options)
    for note in resumable.notes:
        tell(f"note: {note}")
    if resumable.machines_note is not None and not options.get("kept_texts"):
        tell(resumable.machines_note)  # a worker (`kept_texts`) says which texts it runs in its own log
    try:
        yield resumable
    finally:
        resumable.release()


def apply_resume(envelope: Envelope, chain: list[Frame], change: dict[str, Any]) -> Envelope:
    """Apply what a resume changes (as its journal records it) to the frames and the envelope.

    `change`: the new budgets, hitl, untrusted-flow policy, concurrency and host record, the innermost
    level's step `budget` (None keeps it), the `set` values that answer it, the `decision`
    of the human decision it waits on, when one was given, and the operator's `action` it
    records (a console's raised budget), when it is one.
    """
    from mklang.checkpoint.envelope import Action, Budgets, Edit, HostSettings

    edits = envelope.edits
    if edits is not None and (change["set"] or change["budget"] is not None):  # a fork replays them (ADR 0066)
        edits = [*edits, Edit(at=loop_top(chain), set=dict(change["set"]), budget=change["budget"])]
    innermost = chain[-1]
    if change["budget"] is not None:
        innermost.budget = int(change["budget"])
    for dotted, value in change["set"].items():  # a human reply is untrusted data like any host input
        innermost.inject(dotted, value)
    if change.get("decision") is not None:
        innermost.decide(change["decision"])
    acted = [Action.model_validate(change["action"])] if change.get("action") is not None else []
    return envelope.model_copy(
        update=dict(
            actions=[*envelope.actions, *acted],
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
            edits=edits,
        )
    )


def loop_top(chain: list[Frame]) -> str:
    """The loop-top a chain of frames stands at, as dotted step numbers root first (`4.2`: step 2
    of the run that step 4 of the root calls), numbered as the engine numbers its steps."""
    return ".".join(str(len(frame.trace) + 1) for frame in chain)
