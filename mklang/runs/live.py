"""The answers a running run's model is writing, for the console's run page (ADR 0070).

Display only, and only while someone looks. A page that follows a run keeps a signed note
`watching:RUN` fresh (`watch`: an expiry time, written again every few seconds); a run whose
store holds a fresh one streams its produce calls (through the providers that can) and keeps the
answers so far in the signed note `live:RUN` (`LiveAnswers`: at most four writes a second, and
once as each call ends), which the page reads (`read`). Nothing of it is the run's record: the
journal records each answer once, whole, as it does for any call, and a resume never reads
these notes. A run nobody watches reads one note a second at most, at its produce calls, and
streams nothing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from mklang.errors import MklangError
from mklang.runs.notes import read_signed, write_signed
from mklang.stores import Location, NoteStore

WATCH_FOR = 10.0  # seconds a page's watch note stays fresh; the page writes it again every third of that
LOOK_EVERY = 1.0  # seconds between a run's looks for a watch note
WRITE_EVERY = 0.25  # seconds between two writes of the answers so far
SHOWN_CHARS = 20_000  # the end of an answer kept in the note: a page shows what is being written


def watching_key(run: str) -> str:
    return f"watching:{run}"


def live_key(run: str) -> str:
    return f"live:{run}"


def watch(store: NoteStore, run: str) -> None:
    """Ask `run` to stream its answers for the next `WATCH_FOR` seconds."""
    write_signed(store, watching_key(run), {"until": time.time() + WATCH_FOR})


def read(store: NoteStore, run: str) -> dict[str, Any] | None:
    """The answers `run` is writing, `{"calls": [{"key", "text"}], "written": epoch}`, or None when
    it writes none; a note not signed with the checkpoint key, or not of that shape, is none."""
    try:
        document = read_signed(store, live_key(run), "the live answers")
    except MklangError:
        return None
    calls = document.get("calls") if document is not None else None
    if not isinstance(calls, list) or not all(_is_call(call) for call in calls):
        return None
    written = document.get("written") if document is not None else None
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
        self._look_at = 0.0
        self._watched = False
        self._write_at = 0.0
        self._wrote = False

    def deltas(self, key: str) -> Any:
        """What takes call `key`'s answer as it streams (`providers.base.Deltas`), or None when no
        page watches the run."""
        if not self._is_watched():
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

    def _is_watched(self) -> bool:
        if self.store is None:
            return False
        now = time.monotonic()
        if now >= self._look_at:
            self._look_at = now + LOOK_EVERY
            try:
                document = read_signed(self.store, watching_key(self.run), "the watch note")
            except MklangError:  # unsigned, foreign or unreadable: nobody this user trusts watches
                document = None
            until = document.get("until") if document is not None else None
            self._watched = isinstance(until, (int, float)) and until > time.time()
        return self._watched

    def _write(self) -> None:
        """The answers so far, written under the lock (a write that fails is skipped: display only)."""
        assert self.store is not None
        calls = [{"key": key, "text": text} for key, text in self._answers.items()]
        with contextlib.suppress(MklangError):
            write_signed(self.store, live_key(self.run), {"calls": calls, "written": time.time()})
        self._wrote = True
        self._write_at = time.monotonic() + WRITE_EVERY
