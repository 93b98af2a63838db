"""Runs of a store: what they came to (`outcome`), and taking one under its lock (`claim`) to start
or continue it, as batches and workers do."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mklang.checkpoint.signing import SEAL_TEXT
from mklang.engine import Control
from mklang.engine.events import EventSink, Named
from mklang.errors import MklangError, first_line
from mklang.model import Machine
from mklang.runs.request import RunRequest
from mklang.runs.resuming import resume
from mklang.runs.starting import start
from mklang.session import Host
from mklang.stores import Location, RunLock, RunStore, run_name

if TYPE_CHECKING:
    from mklang.checkpoint.envelope import Envelope


PARKED = "escalated"  # a run waiting for a human reply; only `resume --set` continues it


@dataclass
class Outcome:
    """What became of one run, as its envelope in the store says."""

    run: str
    status: str  # done | halted | suspended | pending | failed
    reason: str | None = None
    result: Any = None
    usage: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.run,
            "status": self.status,
            "reason": self.reason,
            "result": self.result,
            "usage": self.usage,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Outcome:
        return cls(str(data["id"]), data["status"], data.get("reason"), data.get("result"), data.get("usage") or {})

    @property
    def settled(self) -> bool:
        """Nothing a batch pass can do changes it: done, halted, or parked on a human question."""
        return self.status in ("done", "halted") or (self.status == "suspended" and self.reason == PARKED)


def outcome(store: RunStore, run: str) -> Outcome:
    """A run's outcome as its envelope says; `pending` when it has not run or is still running.

    A run that cannot be read, or whose envelope is not signed with this
    user's key, is `failed` with the reason: what fails verification is never
    reported as a result.
    """
    return _read_outcome(store, run)[0]


def _read_outcome(store: RunStore, run: str) -> tuple[Outcome, bool | None]:
    """`outcome`, and whether the store holds an envelope of the run (None: it could not be read)."""
    from mklang.checkpoint.envelope import parse
    from mklang.checkpoint.journal import resume_change

    stored = None
    try:
        raw = store.read(run_name(run))
        stored = raw is not None
        if raw is None:
            return Outcome(run, "pending"), stored
        envelope = parse(raw, run)
        if envelope.seal != "signed":
            return Outcome(run, "failed", f"{run}: the checkpoint is {SEAL_TEXT[envelope.seal]}"), stored
        running = envelope.status == "running" or resume_change(store, run, envelope) is not None
    except MklangError as error:
        return Outcome(run, "failed", first_line(error)), stored
    return _outcome_of(run, envelope, running), stored


def _outcome_of(run: str, envelope: Envelope, running: bool) -> Outcome:
    """What a run came to as its signed `envelope` says; `running`: it is still running, or a
    resume of it started and died (its journal says so)."""
    status: str = envelope.status
    if running or (status == "suspended" and envelope.reason == "interrupted"):
        status = "pending"  # a crashed or interrupted run: the next pass resumes it
    return Outcome(
        run,
        status,
        envelope.reason if status == "suspended" else envelope.error,
        envelope.result,
        dict(envelope.usage),
    )


@dataclass
class Claim:
    """A run of a store whose lock this process holds: what it came to, and starting or
    continuing it, are decided with the run held, never from a read made before."""

    location: Location
    lock: RunLock
    _stored: bool | None = field(default=None, repr=False)  # whether `outcome` found an envelope (None: unread)

    def outcome(self) -> Outcome:
        told, self._stored = _read_outcome(self.location.store, self.location.run)
        return told

    def run(
        self,
        machine: Machine,
        context: dict[str, Any],
        host: Host,
        *,
        texts: Callable[[], dict[str, str]],
        kept_texts: bool,
        hitl: bool | None,
        control: Control,
        observer: EventSink | None = None,
        **budgets: Any,
    ) -> Outcome:
        """Start the run with `context` when the store holds none, else continue it (its own context).

        A run started here keeps `texts()` as its machine texts and `hitl`; a run continued here
        runs the texts the store keeps in place of edited files with `kept_texts`. `budgets`:
        `max_tokens`, `max_cost`, `max_time` and the `untrusted_flow` policy, for either. The
        run's events go to `observer` with the run's name. Whether the store holds the run is
        what `outcome` read under this lock, when it was asked.

        Its outcome is the one `outcome` reads from the store, taken from the envelope the run
        wrote last, under this lock, instead of read and verified again (ADR 0044)."""
        from mklang.checkpoint.envelope import read_back

        store, run = self.location.store, self.location.run
        if observer is not None:
            observer = Named(observer, run)
        ended: list[Envelope] = []
        stored = self._stored if self._stored is not None else store.read(run) is not None
        if not stored:
            start(
                machine,
                context,
                host,
                checkpoint=self.location,
                replace=True,  # nothing is there: read under this lock
                control=control,
                hitl=hitl,
                held=self.lock,
                texts=texts(),
                observer=observer,
                on_end=ended.append,
                **budgets,
            )
        else:
            resume(
                RunRequest(source=self.location, kept_texts=kept_texts, **budgets),
                host,
                held=self.lock,
                control=control,
                observer=observer,
                on_end=ended.append,
            )
        (written,) = ended
        return _outcome_of(run, written.model_copy(update=read_back(written, "result", "usage")), running=False)

    def release(self) -> None:
        self.lock.release()


def claim(location: Location) -> Claim:
    """Take the lock of a run of a store (RunBusy while another process holds it)."""
    return Claim(location, location.store.lock(run_name(location.run)))
