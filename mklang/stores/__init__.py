"""Where runs live: the run-store protocol, its optional capabilities, and the registry of store URIs.

A run store holds many runs, each named by a run name: its envelope (one
document, replaced atomically), its journal (an append-only byte log that a
new generation replaces whole) and its lock (one process at a time). That is
all a store must do (`RunStore`, ADR 0052). What it may do besides is
declared by the capability protocols it also implements, each found with
`isinstance` and each with a fallback where it is missing:

- `SegmentStore`: trace segments beside the envelope (ADR 0040); without it
  the whole trace stays in the envelope, as format 2 kept it.
- `SummaryStore`: what a listing shows of each run, kept as envelopes are
  written; without it a listing reads every envelope (`summaries`).
- `TallyStore`: runs counted in groups (by status, by question) by the store;
  without it they are counted from every summary (`tallies_of`).
- `NoteStore`: documents beside the runs (the machine texts runs share, batch
  records and reports, each batch run's spend); without it no texts are kept
  (a run resumes where its files are) and batches and workers refuse it.
- `GenerationStore`: the generation each run id reached, kept in the store
  (ADR 0022, 0052); without it the user's state folder remembers them.
- `PoolStore`: budget pools that runs of many processes draw from (ADR 0067);
  without it `--pool` is refused.

The envelope codec, the journal's records and recovery live above, in
`mklang.checkpoint`, so every backend stores the same bytes; the promises
are checked by `mklang.stores.conformance`, which a plugin's tests run.

A checkpoint is named by a `Location`: a file path (the file store), or a
store URI with the run after `#`: `sqlite:///runs.db#RUN`,
`postgresql://host/db#RUN` (docs/scale.md). A URI's scheme picks the backend:
the built-in ones below, else one an installed package registers under the
entry-point group `mklang.stores` (loaded only when its scheme is used).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from mklang.errors import UsageError, first_line, redacted
from mklang.stores.summary import RunQuery as RunQuery  # re-exported: what a listing asks stores for
from mklang.stores.summary import RunSummary as RunSummary
from mklang.stores.summary import Tally as Tally
from mklang.stores.summary import peek_summary

if TYPE_CHECKING:
    from mklang.stores.pools import Caps as PoolCaps
    from mklang.stores.pools import Hold, Pool

# A run name: how every store and command names a run (docs/scale.md, "Run names"). It is a file
# name in the file store, so it holds no path separator, does not start with a dot (`..`, hidden
# files) and does not end like the files a run keeps beside its checkpoint.
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
RUN_NAME_MAX = 128
RUN_NAME_RULE = (
    f"1 to {RUN_NAME_MAX} ASCII letters, digits, '.', '_', ':' or '-', starting with a letter or digit, "
    "not ending in .journal, .lock or .tmp"
)
RESERVED_ENDINGS = (".journal", ".lock", ".tmp")


class RunLock(Protocol):
    """A held lock on one run; released by `release` or when its process dies."""

    def release(self) -> None: ...


class RunStore(Protocol):
    """What every store does: envelopes, journals, locks. Every method may raise `CheckpointError`."""

    def read(self, run: str) -> bytes | None:
        """The run's envelope, or None when the store holds no such run."""

    def write(self, run: str, payload: bytes, *, generation: int) -> None:
        """Replace the run's envelope (of `generation`) atomically: a reader sees the old or the new one."""

    def read_journal(self, run: str) -> bytes:
        """The run's journal as written so far, its appends in order (empty when it has none)."""

    def start_journal(self, run: str, payload: bytes) -> None:
        """Replace the run's journal with `payload` atomically (a new generation)."""

    def append(self, run: str, payload: bytes, *, durable: bool) -> None:
        """Append to the journal; it survives the process dying, and a power cut when `durable`."""

    def drop_journal(self, run: str) -> None:
        """Remove the run's journal (a finished run keeps none)."""

    def lock(self, run: str) -> RunLock:
        """Lock the run for this process, or raise `RunBusy` naming who holds it. The lock excludes
        every other opener of the store, in this process or another, and dies with its process."""

    def holder(self, run: str) -> str | None:
        """Who holds the run's lock (a process id, maybe with its host), or None."""

    def runs(self) -> list[str]:
        """The names of every run the store holds an envelope of, sorted."""

    def remove(self, run: str) -> None:
        """Remove the run's envelope, journal and whatever else it keeps of the run (its lock stays:
        held, it is the caller's); removing a run the store does not hold does nothing."""

    def close(self) -> None:
        """Release connections and open files (held locks are released by `RunLock.release`)."""


@runtime_checkable
class SegmentStore(Protocol):
    """A store that keeps trace segments beside each run's envelope (ADR 0040)."""

    def write_segment(self, run: str, name: str, payload: bytes) -> None:
        """Keep a trace segment of the run under `name` (the sha256 of `payload`), durably: it
        survives a power cut before any envelope names it. One already there is kept as it is."""

    def read_segment(self, run: str, name: str) -> bytes | None:
        """The run's trace segment `name` as stored (its reader checks the sha256), or None."""

    def segment_names(self, run: str) -> set[str]:
        """The names of the run's trace segments the store holds: listing them reads none."""


@runtime_checkable
class SummaryStore(Protocol):
    """A store that keeps what a listing shows of each run, so listing many runs reads no envelope."""

    def write(self, run: str, payload: bytes, *, generation: int, summary: RunSummary | None = None) -> None:
        """`RunStore.write`, and with `summary` then keep it as `summarize` does (in the same statement)."""

    def summarize(self, run: str, summary: RunSummary) -> None:
        """Keep `summary` (its times are ignored) as what a listing shows of the run; the store stamps
        it `updated` now, and `started` now unless it holds one for the same run id already."""

    def summaries(self, query: RunQuery) -> list[RunSummary]:
        """The summaries of the store's runs that `query` asks for, newest started first."""


@runtime_checkable
class TallyStore(Protocol):
    """A summary store that counts runs in groups itself, so counting many reads no summary."""

    def tally(self, query: RunQuery, by: tuple[str, ...]) -> list[Tally]:
        """`RunQuery.tally` of the summaries `query` keeps, grouped `by` summary fields."""


@runtime_checkable
class NoteStore(Protocol):
    """Documents kept beside the runs: machine texts, batch records and reports, and batch spend."""

    def read_note(self, key: str) -> bytes | None:
        """The note under `key` (a machine text, a run record, what a worker made of a run), or None."""

    def write_note(self, key: str, payload: bytes) -> None:
        """Replace the note under `key` atomically."""

    def add_note(self, key: str, payload: bytes) -> bytes:
        """Write the note under `key` unless there is one (never replaced): the note now there."""

    def record_spend(self, batch: str, run: str, tokens: int, cost: float) -> None:
        """Raise what `run` has spent in `batch` to at least these totals (never lowers them)."""

    def spend(self, batch: str) -> tuple[int, float]:
        """What every run of `batch` has spent: tokens and dollars."""

    def drop_note(self, key: str) -> None:
        """Remove the note under `key`, if there is one."""


@runtime_checkable
class GenerationStore(Protocol):
    """A store that keeps the generations runs reached, so a restored older envelope is refused
    wherever it is resumed from (ADR 0022, 0052)."""

    def generation(self, run: str) -> int:
        """The generation of the run's envelope written last (0 for none). `write` refuses an older one."""

    def generation_seen(self, run_id: str) -> int:
        """The highest generation recorded for the run id `run_id` (0 for none), whatever run name it had;
        removing the run keeps it."""

    def record_generation(self, run_id: str, generation: int) -> None:
        """Raise what is recorded of `run_id` to `generation` (never lowers it)."""


@runtime_checkable
class PoolStore(Protocol):
    """A store that keeps budget pools (`mklang.stores.pools`, ADR 0067). Every change of a pool is one
    atomic statement (or transaction), so pools shared by processes on many hosts never go past a cap."""

    def create_pool(self, name: str, caps: PoolCaps) -> bool:
        """Make the pool `name` with `caps`, nothing spent; False when there is one of that name already."""

    def pool(self, name: str) -> Pool | None:
        """The pool `name` as its row says (checked: a malformed row raises `CheckpointError`), or None."""

    def pool_names(self) -> list[str]:
        """The names of the store's pools, sorted."""

    def top_up(self, name: str, cost: float, tokens: int) -> bool:
        """Raise the pool's dollar and token caps by `cost` and `tokens` (a cap it lacks stays none) and
        forget who waited on it; False when there is no such pool."""

    def remove_pool(self, name: str) -> bool:
        """Remove the pool and its holds; False when there is no such pool."""

    def reserve(self, hold: Hold, now: float) -> bool:
        """Take `hold` in one conditional statement: only when spent plus reserved plus its worst case stays
        within each cap, a call-in-flight slot is free, the rate buckets have room and the pool is not
        paused at `now`; False (nothing changed) otherwise. A hold of the same key must not exist (the
        run's lock holder charges an earlier one first: `charge_held`)."""

    def settle(self, pool: str, key: str, cost: float, tokens: int) -> bool:
        """Release the hold `key` and charge what its call cost instead, atomically; False (nothing
        charged) when the pool holds no such hold (settled already, or charged when it expired)."""

    def charge_held(self, pool: str, now: float, key: str | None = None) -> int:
        """Charge the holds of the pool whose lease expired by `now` (and, with `key`, that hold whatever
        its lease) at their full reservation and release them: their calls may have been paid. How many."""

    def held(self, pool: str, run: str) -> list[str]:
        """The keys of the holds the run `run` has in the pool."""

    def pause(self, pool: str, until: float) -> None:
        """Make the pool's calls wait until `until` (epoch seconds), unless it waits longer already."""

    def note_waiting(self, run: str, pool: str | None) -> None:
        """Record that the run `run` waits on `pool` for a top-up (it suspends `pool-exhausted`), or (None)
        that it waits on no pool (it is driven again). A pool's `waiting` counts the runs recorded as
        waiting on it whose summary still says they are suspended `pool-exhausted`, each once."""


class Store(RunStore, NoteStore, Protocol):
    """A run store that keeps notes: what batches, workers and kept machine texts need."""


def open_note_store(uri: str | Path, needed_by: str) -> Store:
    """The store `uri` names (made when missing), which must keep notes: else it is closed and
    refused in one line saying that `needed_by` needs them."""
    store = open_store(uri)
    if isinstance(store, NoteStore):
        return store
    store.close()
    raise UsageError(
        f"{redacted(str(uri))}: {needed_by} needs a store that keeps notes (machine texts, records, spend), "
        f"which {type(store).__name__} does not"
    )


def summaries_of(store: RunStore, query: RunQuery) -> list[RunSummary]:
    """What a listing shows of the runs `query` asks for: the store's summaries, or (a store that keeps
    none) what each envelope says, read one by one."""
    if isinstance(store, SummaryStore):
        return store.summaries(query)
    return query.page([peek_summary(run, store.read(run) or b"", None) for run in store.runs()])


def pools_of(store: RunStore) -> list[Pool]:
    """The store's budget pools, by name (none in a store that keeps none): what the runs list shows."""
    if not isinstance(store, PoolStore):
        return []
    return [pool for name in store.pool_names() if (pool := store.pool(name)) is not None]


def tallies_of(store: RunStore, query: RunQuery, by: tuple[str, ...]) -> list[Tally]:
    """The runs `query` keeps (every page) counted in groups `by` summary fields: by the store, or
    from every summary (`summaries_of`)."""
    if isinstance(store, TallyStore):
        return store.tally(query, by)
    return query.tally(summaries_of(store, RunQuery()), by)


@dataclass(frozen=True)
class Location:
    """One run in one store; `str()` is how the user named it, `key` tells two names of one run apart."""

    store: RunStore
    run: str
    text: str
    key: str
    # The file a checkpoint's relative machine paths are relative to the folder of:
    # the checkpoint file, the SQLite database, or (PostgreSQL) the current folder.
    anchor: Path = Path("checkpoint")

    def __str__(self) -> str:
        return self.text


def run_name(text: str, where: str = "") -> str:
    """`text` when it is a valid run name, else a one-line UsageError (`where` says where it was given)."""
    if len(text) <= RUN_NAME_MAX and RUN_NAME.fullmatch(text) and not text.endswith(RESERVED_ENDINGS):
        return text
    shown = repr(text[:40]) + ("..." if len(text) > 40 else "")
    raise UsageError(f"{where}{': ' if where else ''}run name {shown} is not valid: a run name is {RUN_NAME_RULE}")


URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
STORE_FORMS = "a folder, sqlite:///runs.db (sqlite:////abs/runs.db) or postgresql://user@host/db"
ENTRY_POINTS = "mklang.stores"
# The built-in schemes: each names what opens a store from its URI, `opener(uri, create=...)`,
# as an entry point of the group `mklang.stores` does.
BUILTIN: dict[str, str] = {
    "sqlite": "mklang.stores.sqlite:SqliteStore.from_uri",
    "postgresql": "mklang.stores.postgres:PostgresStore.from_uri",
    "postgres": "mklang.stores.postgres:PostgresStore.from_uri",
}


class Opener(Protocol):
    """What a scheme names: it opens the store a URI names, making a missing one when `create`."""

    def __call__(self, uri: str, *, create: bool) -> RunStore: ...


def is_uri(text: str | Path) -> bool:
    """Whether `text` names a store by URI (any scheme: an unknown one is refused, not taken as a path)."""
    return isinstance(text, str) and URI.match(text) is not None


def target(uri: str, run: str) -> str:
    """How commands name `run` of the store `uri`: `STORE-URI#RUN`, or `FOLDER/RUN` of a folder store."""
    return f"{uri}#{run}" if is_uri(uri) else str(Path(uri) / run)


def open_store(uri: str | Path, *, create: bool = True) -> RunStore:
    """The store a URI (without `#RUN`) or a folder names.

    With `create` a missing store is made (a folder, a database file, tables);
    without it (commands that only read) a missing one is a one-line error."""
    if not is_uri(uri):
        from mklang.stores.file import FileStore

        folder = Path(uri)
        if create:
            try:
                folder.mkdir(mode=0o700, exist_ok=True)
            except OSError as error:  # its parent is missing, or not ours to write in
                raise UsageError(f"{uri}: cannot make the checkpoint store (a folder): {error.strerror}") from None
        elif not folder.is_dir():
            raise UsageError(f"{uri}: no such checkpoint store (a folder): check the path")
        return FileStore(folder)
    scheme = str(uri).split(":", 1)[0].lower()
    return opener(scheme, str(uri))(str(uri), create=create)


def opener(scheme: str, uri: str) -> Opener:
    """What opens stores of `scheme`: a built-in backend, else the entry point a package registers for it
    (installed packages are looked up only for a scheme that is not built in: `importlib.metadata`
    is not imported to open a built-in store)."""
    value = BUILTIN.get(scheme)
    point = None
    if value is None:
        from importlib.metadata import entry_points

        registered = {point.name.lower(): point for point in entry_points(group=ENTRY_POINTS)}
        if scheme not in registered:
            known = ", ".join(sorted({*BUILTIN, *registered}))
            raise UsageError(
                f"{redacted(uri)}: unknown store scheme '{scheme}': a store is {STORE_FORMS} (known schemes: {known})"
            )
        point = registered[scheme]
        value = point.value
    try:
        if point is not None:
            loaded: Opener = point.load()
        else:
            module, _, name = value.partition(":")
            loaded = importlib.import_module(module)  # then its attribute
            for part in name.split("."):
                loaded = getattr(loaded, part)
    except Exception as error:  # a broken package: its own import errors, whatever they are
        raise UsageError(
            f"store scheme '{scheme}': cannot load {value}: {type(error).__name__}: {first_line(error)}"
        ) from None
    return loaded


def split_target(target: str | Path) -> tuple[str, str]:
    """The store (a URI, or a file's folder) and the run a checkpoint target names, the run name checked;
    nothing is opened."""
    if not is_uri(target):
        path = Path(target)
        return str(path.parent), run_name(path.name, str(path.parent))
    uri, _, run = str(target).partition("#")
    if not run:
        raise UsageError(f"{target}: a store URI names a run after '#', e.g. sqlite:///runs.db#RUN_ID")
    return uri, run_name(run, uri)


def locate(target: str | Path | Location, *, create: bool = True) -> Location:
    """The location of a checkpoint named by a path or by `STORE-URI#RUN`; without `create`
    a missing store is an error (a missing run is for the caller to say)."""
    if isinstance(target, Location):
        return target
    uri, run = split_target(target)
    if not is_uri(target):
        path = Path(target)
        from mklang.stores.file import FileStore

        return Location(FileStore(path.parent), run, str(target), str(path.resolve()), path)
    store = open_store(uri, create=create)
    return Location(store, run, str(target), str(target), getattr(store, "path", Path.cwd() / "checkpoint"))
