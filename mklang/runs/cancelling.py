"""Cancelling a stored run: an operator's halt, `cancelled` (ADR 0068).

A parked run (suspended, or one whose process died) is cancelled at once under its lock: its
envelope is written again, halted `cancelled` at the state it stood at, its frames as they
were, the cancel appended to its signed `actions`. A run another process is running holds
its lock, so the cancel is asked of that process instead: a note signed with the checkpoint
key, `cancel:RUN`, which the run's journal looks for at a loop-top at most once a second
(`StoreJournal.watch`); the run then stops at that loop-top as an interrupted one does, and
`driving.drive`, still holding the lock, writes it halted `cancelled` (`halt`). A run that
parks before it looks is cancelled as it parks; one that ends first just drops the note.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from mklang.engine import decisions
from mklang.errors import CheckpointError, MklangError, RunBusy, first_line
from mklang.runs.notes import read_signed, write_signed
from mklang.stores import Location, NoteStore
from mklang.terminal import printable

if TYPE_CHECKING:
    from mklang.checkpoint.envelope import Action
    from mklang.checkpoint.journal import StoreJournal
    from mklang.engine import Control
    from mklang.engine.frame import Frame

CANCELLED = "cancelled"  # the halt of a cancelled run (SPEC section 4's halts, docs/language.md)


@dataclass
class Cancel:
    """What `cancel` did with one run: `cancelled` it (halted now), `requested` it of the process
    running it (it halts at its next loop-top), or `refused` it (the line says why)."""

    run: str
    outcome: Literal["cancelled", "requested", "refused"]
    why: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "outcome": self.outcome, "why": self.why}

    def line(self) -> str:
        """What `runs cancel` prints of it."""
        if self.outcome == "cancelled":
            return f"{self.run}: cancelled"
        if self.outcome == "requested":
            return f"{self.run}: cancel requested (it is running: it halts cancelled at its next loop-top)"
        return f"refused: {self.why}"


def cancel(location: Location, by: str) -> Cancel:
    """Cancel the run at `location` for the operator `by` (`console`, `cli`): halted now when it is
    parked, asked of its process when it is running; refused when it is finished, busy (another
    process holds it without running it), not signed with this user's key, or not there."""
    from mklang.runs.opening import open_run

    store, run = location.store, location.run
    shown = printable(str(location))
    if store.read(run) is None:
        return Cancel(shown, "refused", f"{shown}: no such run")
    try:
        lock = store.lock(run)
    except RunBusy:
        return _ask_running(location, by, shown)
    except MklangError as error:
        return Cancel(shown, "refused", first_line(error))
    try:
        finished = _finished(location)
    except MklangError as error:
        finished = f"unreadable ({first_line(error)})"
    if finished is not None:
        lock.release()
        return Cancel(shown, "refused", f"{shown}: {finished}: not cancelled")
    try:
        resumable = open_run(location, held=lock, kept_texts=True)  # verified: signed by this user
    except MklangError as error:  # the lock is released
        return Cancel(shown, "refused", f"{first_line(error)}: not cancelled")
    try:
        from mklang.checkpoint.journal import StoreJournal
        from mklang.checkpoint.paths import MachinePaths

        journal = StoreJournal(
            location,
            resumable.envelope,
            answers=resumable.answers,
            hashes=resumable.loader.hashes,
            paths=MachinePaths(resumable.chain[0].machine.path),
        )
        halt(journal, resumable.chain, action(by))
        _drop_request(location)
    finally:
        resumable.release()
    return Cancel(shown, "cancelled")


def _ask_running(location: Location, by: str, shown: str) -> Cancel:
    """The cancel of a run whose lock another process holds: asked of it when it is running the
    run (the envelope says running, or a resume of it began), else refused as busy."""
    from mklang.checkpoint.envelope import parse
    from mklang.checkpoint.journal import resume_change

    store, run = location.store, location.run
    raw = store.read(run)
    try:
        envelope = parse(raw, shown) if raw is not None else None
    except CheckpointError as error:
        return Cancel(shown, "refused", first_line(error))
    holder = store.holder(run) or "another process"
    if envelope is None or (envelope.status != "running" and resume_change(store, run, envelope) is None):
        return Cancel(shown, "refused", f"{shown}: busy (held by {holder}, not running it): not cancelled, try again")
    if not isinstance(store, NoteStore):
        why = f"{shown}: running in {holder}, and this store keeps no notes to ask it: not cancelled"
        return Cancel(shown, "refused", why)
    write_signed(store, note_key(run), {"run": run, "by": by, "at": decisions.stamp(decisions.now())})
    return Cancel(shown, "requested")


def _finished(location: Location) -> str | None:
    """How the run at `location` finished (`already done`, `already halted (gate-fail)`), read under
    its lock; None when it has not."""
    from mklang.checkpoint.envelope import load

    envelope = load(location)
    if envelope.status == "done":
        return "already done"
    return f"already halted ({envelope.error})" if envelope.status == "halted" else None


class Watch:
    """What a running run looks for at a loop-top (`StoreJournal.watch`, once a second at most):
    a cancel asked of it, which interrupts it, so it stops at that loop-top."""

    def __init__(self, location: Location, control: Control):
        self.location, self.control = location, control
        self.asked: Action | None = None

    def __call__(self) -> None:
        if self.asked is None and (asked := requested(self.location)) is not None:
            self.asked = asked
            self.control.interrupted.set()

    def ended(self) -> Action | None:
        """The cancel asked of the run as it stops (looked for once more: it may have been asked
        since the last look); its note is dropped, so it asks nothing of a later resume."""
        self()
        if self.asked is not None:
            _drop_request(self.location)
        return self.asked


def action(by: str, at: str | None = None) -> Action:
    """The record of a cancel by `by`, made at `at` (default now)."""
    from mklang.checkpoint.envelope import Action

    return Action(action="cancel", by=by, at=at or decisions.stamp(decisions.now()))


def halt(journal: StoreJournal, chain: list[Frame], cancelled: Action, **fields: Any) -> None:
    """Write the run `journal` persists as halted `cancelled` at the state its innermost frame
    stands at, its frames as they are, `cancelled` appended to its actions (the lock is held)."""
    journal.finish(
        chain,
        status="halted",
        error=CANCELLED,
        at=chain[-1].state,
        detail=None,
        reason=None,
        ask=None,
        reply_to=None,
        actions=[*journal.envelope.actions, cancelled],
        **fields,
    )


def note_key(run: str) -> str:
    """The note asking the process running `run` to cancel it."""
    return f"cancel:{run}"


def requested(location: Location) -> Action | None:
    """The cancel asked of the run at `location` by a signed note, if one was (an unsigned or
    tampered note asks nothing)."""
    store = location.store
    if not isinstance(store, NoteStore):
        return None
    try:
        note = read_signed(store, note_key(location.run), "a cancel request")
    except CheckpointError:
        return None
    if note is None or note.get("run") != location.run:
        return None
    return action(str(note.get("by") or "operator"), str(note.get("at") or "") or None)


def _drop_request(location: Location) -> None:
    if isinstance(location.store, NoteStore):
        location.store.drop_note(note_key(location.run))
