"""Where runs live: two small store protocols, bytes in and bytes out, and the registry of store URIs.

A run store holds many runs, each named by a run id: its envelope (one
document, replaced atomically), its journal (an append-only byte log that a
new generation replaces whole), its trace segments (immutable documents
named by their sha256, which envelopes refer to) and its lock (one process
at a time). A note
store keeps documents beside them: the machine texts runs share, batch
records and each batch run's spend. Every built-in backend is both (`Store`).
The envelope codec, the journal's records and recovery live above, in
`mklang.checkpoint`, so every backend stores the same bytes.

A checkpoint is named by a `Location`: a file path (the file store), or a
store URI with the run after `#`: `sqlite:///runs.db#RUN`,
`postgresql://host/db#RUN` (docs/scale.md). A URI's scheme picks the backend:
the built-in ones below, else one an installed package registers under the
entry-point group `mklang.stores` (loaded only when its scheme is used).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mklang.errors import UsageError, first_line, redacted
from mklang.stores.summary import RunQuery as RunQuery  # re-exported: what a listing asks stores for
from mklang.stores.summary import RunSummary as RunSummary

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
    """Where runs persist: envelopes, journals and locks. Every method may raise `CheckpointError`."""

    def read(self, run: str) -> bytes | None:
        """The run's envelope, or None when the store holds no such run."""

    def write(self, run: str, payload: bytes, *, generation: int, summary: RunSummary | None = None) -> None:
        """Replace the run's envelope (of `generation`) atomically: a reader sees the old or the new one;
        with `summary`, then keep it as `summarize` does (a store with rows, in the same statement).

        A store that keeps generations refuses one older than it holds (ADR 0022)."""

    def generation(self, run: str) -> int:
        """The generation of the run's envelope written last; 0 for none, or a store that keeps none."""

    def read_journal(self, run: str) -> bytes:
        """The run's journal as written so far (empty when it has none)."""

    def start_journal(self, run: str, payload: bytes) -> None:
        """Replace the run's journal with `payload` atomically (a new generation)."""

    def append(self, run: str, payload: bytes, *, durable: bool) -> None:
        """Append to the journal; it survives the process dying, and a power cut when `durable`."""

    def drop_journal(self, run: str) -> None:
        """Remove the run's journal (a finished run keeps none)."""

    def write_segment(self, run: str, name: str, payload: bytes) -> None:
        """Keep a trace segment of the run under `name` (the sha256 of `payload`), durably: it
        survives a power cut before any envelope names it. One already there is kept as it is."""

    def read_segment(self, run: str, name: str) -> bytes | None:
        """The run's trace segment `name` as stored (its reader checks the sha256), or None."""

    def segment_names(self, run: str) -> set[str]:
        """The names of the run's trace segments the store holds: listing them reads none."""

    def lock(self, run: str) -> RunLock:
        """Lock the run for this process, or raise `CheckpointError` naming who holds it."""

    def holder(self, run: str) -> str | None:
        """Who holds the run's lock (a process id, maybe with its host), or None."""

    def runs(self) -> list[str]:
        """The ids of every run the store holds."""

    def summarize(self, run: str, summary: RunSummary) -> None:
        """Keep `summary` (its times are ignored) as what a listing shows of the run; the store stamps
        it `updated` now, and `started` now unless it holds one for the same run id already."""

    def summaries(self, query: RunQuery) -> list[RunSummary]:
        """The summaries of the store's runs that `query` asks for, newest started first."""

    def remove(self, run: str) -> None:
        """Remove the run's envelope, journal, trace segments and summary (its lock stays: held, it is the caller's)."""

    def close(self) -> None:
        """Release connections and open files (held locks are released by `RunLock.release`)."""


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


class Store(RunStore, NoteStore, Protocol):
    """A backend that keeps runs and their notes: what a URI opens (a run keeps its machine texts as notes)."""


@dataclass(frozen=True)
class Location:
    """One run in one store; `str()` is how the user named it, `key` tells two names of one run apart."""

    store: Store
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

    def __call__(self, uri: str, *, create: bool) -> Store: ...


def is_uri(text: str | Path) -> bool:
    """Whether `text` names a store by URI (any scheme: an unknown one is refused, not taken as a path)."""
    return isinstance(text, str) and URI.match(text) is not None


def open_store(uri: str | Path, *, create: bool = True) -> Store:
    """The store a URI (without `#RUN`) or a folder names.

    With `create` a missing store is made (a folder, a database file, tables);
    without it (commands that only read) a missing one is a one-line error."""
    if not is_uri(uri):
        from mklang.stores.file import FileStore

        folder = Path(uri)
        if create:
            folder.mkdir(mode=0o700, exist_ok=True)
        elif not folder.is_dir():
            raise UsageError(f"{uri}: no such checkpoint store (a folder): check the path")
        return FileStore(folder)
    scheme = str(uri).split(":", 1)[0].lower()
    return opener(scheme, str(uri))(str(uri), create=create)


def opener(scheme: str, uri: str) -> Opener:
    """What opens stores of `scheme`: a built-in backend, else the entry point a package registers for it
    (installed packages are looked up only for a scheme that is not built in)."""
    from importlib.metadata import EntryPoint, entry_points

    value = BUILTIN.get(scheme)
    if value is not None:
        found = EntryPoint(scheme, value, ENTRY_POINTS)
    else:
        registered = {point.name.lower(): point for point in entry_points(group=ENTRY_POINTS)}
        if scheme not in registered:
            known = ", ".join(sorted({*BUILTIN, *registered}))
            raise UsageError(
                f"{redacted(uri)}: unknown store scheme '{scheme}': a store is {STORE_FORMS} (known schemes: {known})"
            )
        found = registered[scheme]
    try:
        loaded: Opener = found.load()
    except Exception as error:  # a broken package: its own import errors, whatever they are
        raise UsageError(
            f"store scheme '{scheme}': cannot load {found.value}: {type(error).__name__}: {first_line(error)}"
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
