"""The file store: a checkpoint is a file, its journal and lock sit beside it.

For a run `cp.json` in a folder: the envelope `cp.json` (replaced
atomically, 0600), the journal `cp.json.journal` (appended; its handle stays
open while the run goes on) and the lock `cp.json.lock`; what a listing shows of it is
`.mklang-runs/cp.json` (`RunSummary`), its trace segments are files of
`.mklang-segments/<hash of the run>/` named by their sha256. Batches keep notes
in `.mklang-notes/` and each run's spend in `.mklang-spend/`, files named by
the hash of their key.

The lock is an advisory `flock` on the lock file, which names the holder's
pid. It is opened without following symlinks (a planted link cannot make a
run open or truncate another file). The kernel drops the lock when its
process dies, even by SIGKILL, so a crashed run is resumable at once.

The holder removes the lock file when the run ends, while it still holds it,
and a locker keeps a lock only on the file its path names once it holds it.
Removing is what races: a second locker may have opened the file just before
it was removed and get the lock once the holder lets go, on a file no path
names any more, while a third creates and locks a new one; both would run.
That second locker sees its file gone (or replaced) and tries again with the
file there now, so only a lock on the file the path names counts, and a path
names one file at a time. A crashed run leaves its file, taken by the next locker.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import IO

from mklang.errors import CheckpointError, JournalCut, RunBusy
from mklang.files import write_atomic
from mklang.stores.summary import RunQuery, RunSummary, peek_summary

SUFFIXES = (".journal", ".lock", ".tmp")
SEGMENTS_FOLDER = ".mklang-segments"  # each run's trace segments, in a folder per run (ADR 0040)
MARKS_FOLDER = ".mklang-marks"  # how much of each run's journal was committed (`JournalMark`)
# How an envelope file begins: in field order (ADR 0036), or canonical JSON (keys sorted) as written before.
ENVELOPE_STARTS = (b'{"answers":', b'{"format":')


class FileStore:
    """Runs as files in one folder; the run id is the file name."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._journals: dict[str, IO[bytes]] = {}
        self._marks: dict[str, JournalMark] = {}
        self._guard = threading.Lock()

    def _path(self, run: str) -> Path:
        return self.folder / run

    def read(self, run: str) -> bytes | None:
        return _read_if_there(self._path(run), "the checkpoint")

    def write(self, run: str, payload: bytes, *, generation: int, summary: RunSummary | None = None) -> None:
        # A file is copied and restored whole: the user's state folder remembers its generation (no `GenerationStore`).
        try:
            write_atomic(self._path(run), payload, point="envelope")
        except OSError as error:
            raise CheckpointError(f"{self._path(run)}: cannot write the checkpoint: {error.strerror}") from None
        if summary is not None:
            self.summarize(run, summary)

    def _journal(self, run: str) -> Path:
        return self.folder / f"{run}.journal"

    def read_journal(self, run: str) -> bytes:
        try:
            raw = self._journal(run).read_bytes()
        except FileNotFoundError:
            return b""
        except OSError as error:
            raise CheckpointError(f"{self._journal(run)}: cannot read the journal: {error.strerror}") from None
        committed = JournalMark.committed(self._mark(run), raw)
        if committed > len(raw):
            raise JournalCut(str(self._journal(run)), raw, committed)
        return raw

    def _mark(self, run: str) -> Path:
        return self.folder / MARKS_FOLDER / hashed_name(run)

    def start_journal(self, run: str, payload: bytes) -> None:
        path = self._journal(run)
        with self._guard:
            self._close_journal(run)
            try:
                write_atomic(path, payload, point="journal.gen")
                self._journals[run] = open(path, "ab")  # noqa: SIM115 - held open across appends
                (self.folder / MARKS_FOLDER).mkdir(mode=0o700, exist_ok=True)
                self._marks[run] = JournalMark(self._mark(run), payload)
            except OSError as error:
                raise CheckpointError(f"{path}: cannot write the journal: {error.strerror}") from None

    def append(self, run: str, payload: bytes, *, durable: bool) -> None:
        handle = self._journals.get(run)
        if handle is None:
            raise CheckpointError(f"{self._journal(run)}: the journal was not started")
        try:
            handle.write(payload)
            handle.flush()  # at the OS now: it survives kill -9
            if durable:
                os.fsync(handle.fileno())  # on disk: it survives a power cut
                self._marks[run].commit(handle.tell())
        except OSError as error:
            raise CheckpointError(f"{self._journal(run)}: cannot append to the journal: {error.strerror}") from None

    def drop_journal(self, run: str) -> None:
        with self._guard:
            self._close_journal(run)
        for path in (self._mark(run), self._journal(run)):  # the mark first: a journal is never short of it
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _close_journal(self, run: str) -> None:
        handle = self._journals.pop(run, None)
        if handle is not None:
            handle.close()
        mark = self._marks.pop(run, None)
        if mark is not None:
            mark.close()

    def _segments(self, run: str) -> Path:
        # Run names are file names, but a folder per run keyed by their hash keeps them out of `runs()`.
        return self.folder / SEGMENTS_FOLDER / hashed_name(run)

    def write_segment(self, run: str, name: str, payload: bytes) -> None:
        path = self._segments(run) / name
        if path.exists():
            return  # named by its sha256: the bytes there are these (a reader checks)
        try:
            for folder in (path.parent.parent, path.parent):
                folder.mkdir(mode=0o700, exist_ok=True)
            write_atomic(path, payload)  # fsynced with its folder: durable before an envelope names it
        except OSError as error:
            raise CheckpointError(f"{path}: cannot write the trace segment: {error.strerror}") from None

    def read_segment(self, run: str, name: str) -> bytes | None:
        return _read_if_there(self._segments(run) / name, "the trace segment")

    def segment_names(self, run: str) -> set[str]:
        try:
            return set(os.listdir(self._segments(run)))
        except FileNotFoundError:
            return set()
        except OSError as error:
            raise CheckpointError(f"{self._segments(run)}: cannot list the trace segments: {error.strerror}") from None

    def lock(self, run: str) -> FileLock:
        return FileLock(self.folder / f"{run}.lock", str(self._path(run)))

    def holder(self, run: str) -> str | None:
        return lock_holder(self.folder / f"{run}.lock")

    def runs(self) -> list[str]:
        """Files of the folder that hold a checkpoint envelope."""
        found = []
        for path in sorted(self.folder.iterdir()):
            if path.name.startswith(".") or path.name.endswith(SUFFIXES) or not path.is_file():
                continue
            with contextlib.suppress(OSError), open(path, "rb") as handle:
                if handle.read(11).startswith(ENVELOPE_STARTS):
                    found.append(path.name)
        return found

    def _summary(self, run: str) -> Path:
        return self.folder / ".mklang-runs" / run

    def summarize(self, run: str, summary: RunSummary) -> None:
        path = self._summary(run)
        now = time.time()
        kept = _read_summary(path, run)
        started = kept.started if kept is not None and kept.run_id == summary.run_id and kept.started else now
        document = {**summary.to_json(), "started": started, "updated": now}
        try:
            (self.folder / ".mklang-runs").mkdir(mode=0o700, exist_ok=True)
            # Display only: replaced atomically, not worth an fsync of its own (lost, the envelope says it).
            temp = path.with_name(f".{run}.{os.getpid()}.{threading.get_ident()}.tmp")
            descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(json.dumps(document).encode())
            os.replace(temp, path)
        except OSError as error:
            raise CheckpointError(f"{path}: cannot write the run's summary: {error.strerror}") from None

    def summaries(self, query: RunQuery) -> list[RunSummary]:
        """Each run's summary file; a run without one (written before summaries) is peeked at, timed by its file."""
        found = []
        for run in self.runs():
            summary = _read_summary(self._summary(run), run)
            if summary is None:
                raw, when = self.read(run), None
                with contextlib.suppress(OSError):
                    when = self._path(run).stat().st_mtime
                summary = peek_summary(run, raw or b"", when)
            found.append(summary)
        return query.page(found)

    def remove(self, run: str) -> None:
        self.drop_journal(run)
        segments = self._segments(run)
        try:
            shutil.rmtree(segments)
        except FileNotFoundError:
            pass
        except OSError as error:
            raise CheckpointError(f"{segments}: cannot remove the run's trace segments: {error.strerror}") from None
        for path in (self._path(run), self._summary(run)):
            try:
                path.unlink(missing_ok=True)
            except OSError as error:
                raise CheckpointError(f"{path}: cannot remove it: {error.strerror}") from None

    def _note(self, key: str) -> Path:
        return self.folder / ".mklang-notes" / hashed_name(key)

    def read_note(self, key: str) -> bytes | None:
        return _read_if_there(self._note(key), "the batch note")

    def write_note(self, key: str, payload: bytes) -> None:
        self._write_private(self._note(key), payload)

    def add_note(self, key: str, payload: bytes) -> bytes:
        path = self._note(key)
        there = self.read_note(key)
        if there is not None:
            return there
        temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self._write_private(temp, payload)
            os.link(temp, path)  # fails when another process added it first: theirs stays
        except FileExistsError:
            pass
        except (OSError, CheckpointError) as error:
            reason = error.strerror if isinstance(error, OSError) else str(error).rsplit(": ", 1)[-1]
            raise CheckpointError(f"{path}: cannot write the note: {reason}") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()
        return self.read_note(key) or payload

    def drop_note(self, key: str) -> None:
        try:
            self._note(key).unlink(missing_ok=True)
        except OSError as error:
            raise CheckpointError(f"{self._note(key)}: cannot remove the note: {error.strerror}") from None

    def _spend_folder(self, batch: str) -> Path:
        return self.folder / ".mklang-spend" / hashed_name(batch)

    def record_spend(self, batch: str, run: str, tokens: int, cost: float) -> None:
        path = self._spend_folder(batch) / hashed_name(run)
        with self._guard:  # only the run's lock holder records its spend: this process's threads are the race
            old_tokens, old_cost = _spend_of(path)
            if tokens > old_tokens or cost > old_cost:
                self._write_private(path, f"{max(tokens, old_tokens)} {max(cost, old_cost)!r}".encode())

    def spend(self, batch: str) -> tuple[int, float]:
        tokens, cost = 0, 0.0
        folder = self._spend_folder(batch)
        if folder.is_dir():
            for path in sorted(folder.iterdir()):
                if not path.name.startswith("."):
                    run_tokens, run_cost = _spend_of(path)
                    tokens, cost = tokens + run_tokens, cost + run_cost
        return tokens, cost

    def _write_private(self, path: Path, payload: bytes) -> None:
        try:
            for folder in reversed(path.relative_to(self.folder).parents[:-1]):  # each owner-only, not just the last
                (self.folder / folder).mkdir(mode=0o700, exist_ok=True)
            write_atomic(path, payload)
        except OSError as error:
            raise CheckpointError(f"{path}: cannot write the batch note: {error.strerror}") from None

    def close(self) -> None:
        with self._guard:
            for run in list(self._journals):
                self._close_journal(run)


class JournalMark:
    """How many bytes of a run's journal were committed, kept beside it (`.mklang-marks/`), so a
    journal cut short after a crash (a truncated copy, lines removed) is refused, not recovered
    from less than was committed (ADR 0052).

    One fixed-width line, `<bytes> <sha256 of the journal's first line>`, rewritten in place after
    each durable append, once the fsync put those bytes on disk, so it never counts more than a
    power cut keeps. Naming the first line, the generation's header, it speaks only of the journal
    it was written for: a mark left from an older generation (its rewrite lost in a power cut) is
    ignored. The mark itself is not synced.
    """

    WIDTH = 20

    def __init__(self, path: Path, header: bytes):
        self._descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._digest = hashlib.sha256(header.partition(b"\n")[0]).hexdigest()
        self.commit(len(header))

    def commit(self, length: int) -> None:
        os.pwrite(self._descriptor, f"{length:0{self.WIDTH}d} {self._digest}\n".encode(), 0)

    def close(self) -> None:
        os.close(self._descriptor)

    @staticmethod
    def committed(path: Path, journal: bytes) -> int:
        """The bytes the mark at `path` says were committed to `journal` (0: no mark, or not this journal's)."""
        try:
            length, _, digest = path.read_text(encoding="ascii").strip().partition(" ")
            named = digest == hashlib.sha256(journal.partition(b"\n")[0]).hexdigest()
            return int(length) if named else 0
        except (OSError, ValueError):
            return 0


def hashed_name(text: str) -> str:
    """The file name of user text (a run id, a note's key): its hash, so any text is one safe name."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _read_summary(path: Path, run: str) -> RunSummary | None:
    """The summary a file keeps (None: none, or not one this version wrote); display only."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or (data.get("status") == "suspended" and "asks" not in data):
        return None  # a parked run summarized before summaries kept what it asks: its envelope says
    return RunSummary.from_json(run, data)


def _read_if_there(path: Path, what: str) -> bytes | None:
    """The bytes of `path`, None when there is no such file; `what` names it in errors."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read {what}: {error.strerror}") from None


def open_lock_file(path: Path) -> int:
    """A descriptor of the lock file at `path`: created owner-only, never opened through a symlink."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


class FileLock:
    """An exclusive `flock` on a lock file that names its holder's pid (module docstring)."""

    def __init__(self, path: Path, what: str):
        self._path = path
        while True:
            try:
                descriptor = open_lock_file(path)
            except OSError as error:
                raise CheckpointError(f"{what}: cannot lock the checkpoint: {error.strerror}") from None
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _named_holder(descriptor)
                os.close(descriptor)
                raise still_running(what, pid) from None
            if _names(path, descriptor):
                break
            os.close(descriptor)  # its holder removed it as we opened it: lock the file there now
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"{os.getpid()}\n".encode())
        self._descriptor: int | None = descriptor

    def release(self) -> None:
        """Remove the lock file, then let go of it (the order matters: module docstring)."""
        if self._descriptor is not None:
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()
            os.close(self._descriptor)  # closing drops the lock
            self._descriptor = None


def _names(path: Path, descriptor: int) -> bool:
    """Whether `path` (not followed if a link) is the file open as `descriptor`."""
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(descriptor)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def lock_holder(path: Path) -> str | None:
    """The pid written in a held lock file, or None when no process holds it."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _named_holder(descriptor)
    finally:
        os.close(descriptor)
    return None


def _named_holder(descriptor: int) -> str:
    """The pid a held lock file names. Its holder writes it just after taking the lock,
    so an empty file is read again for a moment before the holder is called unknown."""
    for _ in range(100):
        named = os.pread(descriptor, 64, 0).decode(errors="replace").strip()
        if named:
            return named
        time.sleep(0.002)
    return "?"


def _spend_of(path: Path) -> tuple[int, float]:
    try:
        tokens, cost = path.read_text(encoding="ascii").split()
        return int(tokens), float(cost)
    except FileNotFoundError:
        return 0, 0.0
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: cannot read a run's recorded spend: {error}") from None


def still_running(what: str, holder: str) -> RunBusy:
    return RunBusy(
        f"{what}: the run is still going in process {holder}; "
        f"wait for it, or stop it (Ctrl-C suspends it) before resuming"
    )
