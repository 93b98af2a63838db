"""The answers a running run's model is writing, for the console's run page (ADR 0070).

Display only, and only while someone looks. A page that follows a run keeps its run in the
store's signed note `watching` fresh (`watch`: the runs watched, each with an expiry time,
written again every few seconds); a run the note names streams its produce calls (through the
providers that can) and keeps the answers so far in the signed note `live:RUN` (`LiveAnswers`:
at most four writes a second, and once as each call ends), which the page reads (`read`).
Nothing of it is the run's record: the journal records each answer once, whole, as it does for
any call, and a resume never reads these notes. The runs of one process that share a store
share its look at `watching`, once a second at most: a run nobody watches streams nothing and
a batch's runs pay one read a second between them.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import Any

from mklang.errors import MklangError
from mklang.providers.base import Deltas
from mklang.runs.notes import read_signed, write_signed
from mklang.stores import Location, NoteStore

WATCH_FOR = 10.0  # seconds a page's watch stays fresh; the page writes it again every third of that
LOOK_EVERY = 1.0  # seconds between a process's looks at a store's watch note
WRITE_EVERY = 0.25  # seconds between two writes of the answers so far
SHOWN_CHARS = 20_000  # the end of an answer kept in the note: a page shows what is being written
WATCHING = "watching"  # the note of the runs pages watch: {"runs": {RUN: expiry epoch}}


def live_key(run: str) -> str:
    return f"live:{run}"


def watch(store: NoteStore, run: str) -> None:
    """Ask `run` to stream its answers for the next `WATCH_FOR` seconds (the other runs the note
    names and that are still watched are kept). The pages of one console take turns, so none
    drops another's run; two consoles at the same instant may, until the next write."""
    with _watch_lock:
        now = time.time()
        runs = {name: until for name, until in _watched(store).items() if until > now}
        write_signed(store, WATCHING, {"runs": {**runs, run: now + WATCH_FOR}})


_watch_lock = threading.Lock()


def _watched(store: NoteStore) -> dict[str, float]:
    """The runs the store's watch note names, with their expiry; none when it is not signed with
    the checkpoint key (forged, another fleet's) or not of its shape."""
    try:
        document = read_signed(store, WATCHING, "the watch note")
    except MklangError:
        return {}
    runs = document.get("runs") if document is not None else None
    if not isinstance(runs, dict):
        return {}
    return {name: until for name, until in runs.items() if isinstance(until, (int, float))}


class _Look:
    """A process's last look at one store's watch note."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.at = 0.0  # monotonic time of the next look
        self.runs: dict[str, float] = {}


_looks: weakref.WeakKeyDictionary[NoteStore, _Look] = weakref.WeakKeyDictionary()
_looks_lock = threading.Lock()


def is_watched(store: NoteStore, run: str) -> bool:
    """Whether a page watches `run` now, as the store said at this process's last look (at most
    `LOOK_EVERY` seconds ago)."""
    with _looks_lock:
        look = _looks.get(store) or _looks.setdefault(store, _Look())
    with look.lock:
        now = time.monotonic()
        if now >= look.at:
            look.at, look.runs = now + LOOK_EVERY, _watched(store)
        until = look.runs.get(run)
    return until is not None and until > time.time()


def read(store: NoteStore, run: str) -> dict[str, Any] | None:
    """The answers `run` is writing, `{"calls": [{"key", "text"}], "written": epoch}`, or None when
    it writes none; a note not signed with the checkpoint key, or not of that shape, is none."""
    try:
        document = read_signed(store, live_key(run), "the live answers")
    except MklangError:
        return None
    calls = document.get("calls") if document is not None else None
    if document is None or not isinstance(calls, list) or not all(_is_call(call) for call in calls):
        return None
    written = document.get("written")
    return {"calls": calls, "written": written if isinstance(written, (int, float)) else None}


def _is_call(call: Any) -> bool:
    return isinstance(call, dict) and isinstance(call.get("key"), str) and isinstance(call.get("text"), str)


class LiveAnswers:
    """A running run's side: whether a page watches it (`deltas` is None when none does) and the
    note of the answers its produce calls are streaming. Thread-safe: fan-out branches stream at once."""

    def __init__(self, location: Location):
        store = location.store
        self.store: NoteStore | None = store if isinstance(store, NoteStore) else None
        self.run = location.run
        self._lock = threading.Lock()
        self._answers: dict[str, str] = {}  # the calls streaming now, by key
        self._write_at = 0.0
        self._wrote = False

    def deltas(self, key: str) -> Deltas | None:
        """What takes call `key`'s answer as it streams (`providers.base.Deltas`), or None when no
        page watches the run."""
        if self.store is None or not is_watched(self.store, self.run):
            return None

        def tell(offset: int, text: str) -> None:
            with self._lock:
                before = self._answers.get(key, "") if offset else ""  # 0 again: a cut stream started over
                self._answers[key] = (before + text)[-SHOWN_CHARS:]
                if time.monotonic() >= self._write_at:
                    self._write()

        return tell

    def ended(self, key: str) -> None:
        """Call `key` ended (answered, failed or cut): its answer leaves the note."""
        with self._lock:
            if self._answers.pop(key, None) is not None:
                self._write()

    def close(self) -> None:
        """The run stopped: a note it wrote is dropped."""
        if self._wrote and self.store is not None:
            with contextlib.suppress(MklangError):  # display only: a note left is dropped at the next end
                self.store.drop_note(live_key(self.run))

    def _write(self) -> None:
        """The answers so far, written under the lock (a write that fails is skipped: display only)."""
        assert self.store is not None
        calls = [{"key": key, "text": text} for key, text in self._answers.items()]
        with contextlib.suppress(MklangError):
            write_signed(self.store, live_key(self.run), {"calls": calls, "written": time.time()})
        self._wrote = True
        self._write_at = time.monotonic() + WRITE_EVERY
