"""Removing a stored run under its lock, decided from its signed envelope."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mklang.checkpoint.signing import SEAL_TEXT
from mklang.errors import CheckpointError, RunBusy, first_line
from mklang.runs.notes import record_key, report_key
from mklang.stores import Location, NoteStore, run_name
from mklang.terminal import printable

if TYPE_CHECKING:
    pass


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
        if isinstance(store, NoteStore):
            for key in (record_key(run), report_key(run)):
                store.drop_note(key)
        return Removal(shown, True, status)
    finally:
        lock.release()
