"""Moving a parked run to a new version of its machines (ADR 0061).

`migrate` opens the run as a resume does (lock, seal, hashes of the machines
it ran, frames rebuilt on them), rebuilds the same frames, their state names
renamed (by each new machine's `moved` lines and the caller's `--map`), on the
new machines, and classifies the run (`checkpoint.migration`).
A compatible or migratable run is then written again under its lock: the new
frames, the new machines' sha256 and kept texts, and one more `lineage` entry
(its own run id, the step it is parked at, the old machines' sha256), signed
like every envelope. Nothing runs and nothing is paid: the run stays parked,
and an ordinary resume continues it under the new machines.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mklang.engine import RunResult
from mklang.engine.frame import Frame
from mklang.errors import CheckpointError, LoadError
from mklang.model import Machine
from mklang.runs.opening import Resumable, loop_top, open_run
from mklang.runs.places import location as stored
from mklang.runs.request import RunRequest
from mklang.runs.resuming import resume
from mklang.stores import Location, RunLock, locate
from mklang.syntax.machines import MachineLoader

if TYPE_CHECKING:  # loaded by a migration only: pydantic stays out of `mklang run`'s start-up
    from mklang.checkpoint.migration import Verdict


@dataclass
class Examined:
    """A parked run opened on its own machines, its frames rebuilt on the new ones, and the verdict."""

    old: Resumable
    chain: list[Frame]
    loader: MachineLoader
    root: Path
    verdict: Verdict


def migrate(
    source: str | Path | Location,
    machine: str | Path,
    renames: dict[str, str] | None = None,
    *,
    write: bool = True,
    held: RunLock | None = None,
) -> Verdict:
    """Classify the parked run at `source` against the root machine file `machine` (state names
    renamed by each new machine's `moved` lines, then by `renames`) and, if `write` and it is
    not incompatible, write it migrated.

    A write holds the run's lock: `held` when the caller took it (and keeps it), else taken and
    released here. A classification alone (`write` False: `runs migrate --dry-run`, the console)
    reads without it, as `show` does, so it never makes a resume of the run find it busy.
    Raises CheckpointError for a run that is not a parked, signed, unchanged one.
    """
    location = locate(source)
    lock = held if held is not None or not write else location.store.lock(location.run)
    try:
        examined = _examine(location, Path(machine), renames or {})
        if write and examined.verdict.movable:
            _write(location, examined)
        return examined.verdict
    finally:
        if held is None and lock is not None:
            lock.release()


def against_its_files(source: str | Path | Location) -> tuple[Path, Verdict] | None:
    """A parked run whose machine files were edited since it parked, classified against them as
    they are now (`migrate` without writing, renames from their `moved` lines): the root file and
    the verdict. None for a run not parked, or whose files are as it recorded them or gone (it runs
    from the texts its store keeps)."""
    from mklang.checkpoint.envelope import load
    from mklang.checkpoint.paths import MachinePaths, root_file
    from mklang.syntax.machines import file_sha256

    location = locate(source)
    envelope = load(location)
    if envelope.status != "suspended" or not envelope.machine.path:
        return None
    root = root_file(envelope.machine.path, location.anchor)
    paths = MachinePaths(root)

    def edited(name: str, digest: str) -> bool:
        try:
            return file_sha256(paths.file(name)) != digest
        except OSError:
            return False

    if not any(edited(name, digest) for name, digest in envelope.machines.items()):
        return None
    return root, migrate(location, root, write=False)


def resume_migrated(request: RunRequest, machine: str | Path, renames: dict[str, str], **options: Any) -> RunResult:
    """`resume --migrate`: migrate the parked run `request` continues, then resume it under the
    new machines (`resuming.resume` with `options`), its lock held from the check to the end.
    An incompatible run is refused and left as it was."""
    if request.source is None or not isinstance(request.source, (str, Path, Location)):
        raise CheckpointError("migrating needs the checkpoint of a stored run")
    location = locate(request.source)
    lock = location.store.lock(location.run)
    try:
        verdict = migrate(location, machine, renames, held=lock)
        if not verdict.movable:
            raise CheckpointError(f"{location}: {verdict.text()}; not migrated (the run is left as it was)")
    except BaseException:
        lock.release()
        raise
    return resume(replace(request, source=location, machine_path=None, force=False), held=lock, **options)


def migrate_store(uri: str, machine: str | Path, renames: dict[str, str], *, write: bool) -> list[tuple[str, str]]:
    """`runs migrate`: every parked run of `machine`'s root machine in the store at `uri`, each
    classified (and, if `write`, migrated) under its own lock: (run, its line) pairs, sorted."""
    from mklang.stores import RunQuery, open_store, summaries_of

    name = _load(MachineLoader(), Path(machine)).name
    store = open_store(uri, create=False)
    try:
        listed = summaries_of(store, RunQuery(statuses=("suspended",), machine=name))
        lines = []
        for run in sorted(summary.run for summary in listed):
            try:
                lines.append((run, migrate(stored(store, uri, run), machine, renames, write=write).text()))
            except CheckpointError as error:  # a busy, unsigned or damaged run: said, and the others go on
                lines.append((run, f"refused: {error}"))
        return lines
    finally:
        store.close()


def _examine(location: Location, root: Path, renames: dict[str, str]) -> Examined:
    """The run opened on its own machines (the store's kept texts for a file edited in place),
    and its frames, renamed, rebuilt on the machines under `root`."""
    from mklang.checkpoint.compat import rebuild
    from mklang.checkpoint.migration import classify, renamed
    from mklang.checkpoint.paths import MachinePaths
    from mklang.checkpoint.segments import reader

    old = open_run(location, lock=False, kept_texts=True)
    envelope = old.envelope
    if envelope.status != "suspended" or old.crashed:
        status = "running (or its process died)" if old.crashed else envelope.status
        raise CheckpointError(f"{location}: only a parked (suspended) run is migrated; this one is {status}")
    paths = MachinePaths(root)
    loader = MachineLoader()
    read = reader(location.store, location.run, str(location), trusted=True)
    chain, renames_used = [], False
    for depth, recorded in enumerate(envelope.frames):
        record = dict(recorded)
        file = paths.root if depth == 0 else paths.file(str(record["path"]))
        machine = _load(loader, Path(str(file)))
        moved = renamed(record, {**machine.renames(), **renames})  # `--map` over the machine's `moved`
        renames_used |= moved != record
        chain.append(rebuild(moved, machine, str(location), read))
    chain[-1].ask = old.chain[-1].ask  # the question it waits on, as the open read it
    verdict = classify(old.chain, chain, renames_used=renames_used)
    return Examined(old, chain, loader, root.resolve(), verdict)


def _load(loader: MachineLoader, file: Path) -> Machine:
    try:
        return loader.load_path(file)
    except LoadError as error:
        raise CheckpointError(f"cannot load machine {file}: {error}") from None
    except OSError as error:
        raise CheckpointError(f"cannot read machine {file}: {error.strerror}") from None


def _write(location: Location, examined: Examined) -> None:
    """The run again, on the new machines, one generation on, its migration in its signed lineage."""
    from mklang.checkpoint.envelope import Ancestor, UsageRecord
    from mklang.checkpoint.journal import StoreJournal
    from mklang.checkpoint.paths import MachinePaths
    from mklang.checkpoint.texts import keep_texts

    envelope = examined.old.envelope
    root_machine = examined.chain[0].machine
    step = loop_top(examined.chain)
    migration = Ancestor(
        run_id=envelope.run_id,
        checkpoint=str(location),
        step=step,
        machines=dict(envelope.machines),
        inherited=UsageRecord(input_tokens=0, output_tokens=0, cost_usd=0.0),
    )
    template = envelope.model_copy(
        update={
            "machine": envelope.machine.model_copy(
                update={"name": root_machine.name, "sha256": examined.loader.hashes.get(str(root_machine.path))}
            ),
            "texts": keep_texts(location.store, root_machine, location),
            "lineage": [*envelope.lineage, migration],
        }
    )
    journal = StoreJournal(
        location,
        template,
        answers=examined.old.answers,
        hashes=examined.loader.hashes,
        paths=MachinePaths(examined.root),
    )
    journal.snapshot(examined.chain, status="suspended")
