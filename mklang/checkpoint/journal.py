"""Crash-safe persistence of a run: the envelope plus an append-only journal.

The durable state at any loop-top is the last envelope (a full snapshot)
followed by the journal lines of the same generation:

- `step`: a run level applied a step (the `Frame.apply` record);
- `enter`: a call state started a child level;
- `halt`: a run level's state halted before it could make a step;
- `call`: a provider or tool call of the step in flight completed (its
  answer), written and fsynced before the engine uses the answer.

A host that remembers something across calls (a scripted host: which answers
it gave) hands the journal a `HostState`; every line then carries that state
as of the line (`s`), and every envelope too (`host.state`), so a recovered
or resumed run gives the host back the state of the last call it knows of.

A level's outcome (END, a halt, a pending human question) is part of the
line that reaches it, so a recovered run completes it rather than running
the state again. The paid answers not yet replayed travel in the snapshot
(`answers`), so a new generation never drops one; a suspended envelope
keeps those of fan-out branches that a token, dollar or time ceiling stopped
mid-way, so the resume replays them too (ADR 0012).

Durability (`MKLANG_DURABILITY`): every line reaches the OS at once, so it
survives `kill -9`. With `call` (the default) each `call` line is also
fsynced before its answer is used, so not even a power cut makes a call be
paid twice; with `step` there is one fsync per step (a group commit at the
`step` line), and a power cut may lose the calls of the step in flight,
which a resume then pays again.

A resume of a suspended envelope starts a generation against it without
rewriting it; the generation's first line records what the resume changed
(`StoreJournal.resume`, `resume_change`).

Every line costs the same whatever the length of the run; the envelope is
rewritten only when the journal has grown as large as it (compaction), so
the checkpoint work per step stays flat (ADR 0009). A torn last line, the
only thing a crash can leave, is dropped on recovery; a journal shorter than
what its store counted as committed is refused by the store (ADR 0052).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

from mklang import faults
from mklang.checkpoint import generations
from mklang.checkpoint.envelope import FORMAT, Envelope, dump_signed, store_envelope, summary_of
from mklang.checkpoint.paths import MachinePaths, checkpoint_folder, portable_host
from mklang.checkpoint.segments import trace_fields
from mklang.checkpoint.signing import check_lines, checkpoint_key, sign_line
from mklang.engine.frame import Frame
from mklang.engine.records import StepRecord
from mklang.errors import CheckpointError, JournalCut, UsageError
from mklang.limits import MAX_CHECKPOINT_DEPTH, load_json
from mklang.providers.base import Usage, decode_answer, earlier_key, encode_answer
from mklang.stores import Location, RunStore, SummaryStore
from mklang.version import __version__

MIN_COMPACT_BYTES = 256 * 1024
WATCH_EVERY = 1.0  # seconds between a running run's looks for what was asked of it (a cancel)
DURABILITY_VARIABLE = "MKLANG_DURABILITY"
Durability = Literal["call", "step"]


def durability_setting() -> Durability:
    """The durability the host asked for in `MKLANG_DURABILITY` (default `call`)."""
    value = os.environ.get(DURABILITY_VARIABLE, "call")
    if value == "call":
        return "call"
    if value == "step":
        return "step"
    raise UsageError(f"{DURABILITY_VARIABLE} must be call or step, not {value!r}")


class HostState(Protocol):
    """What a host remembers across the calls of one run, as JSON data: saved with every
    journal line and envelope, and restored into the host that continues the run."""

    def save(self) -> dict[str, Any]: ...

    def restore(self, saved: dict[str, Any]) -> None: ...


class StoreJournal:
    """The engine's persistence port for runs started with `--checkpoint`; writes go to a store."""

    def __init__(
        self,
        location: Location,
        envelope: Envelope,
        *,
        host_state: HostState | None = None,
        answers: dict[str, dict[str, Any]] | None = None,
        hashes: dict[str, str] | None = None,
        durability: Durability = "call",
        paths: MachinePaths | None = None,
        new_run: bool = False,
        watch: Callable[[], None] | None = None,
    ):
        self.store, self.run, self.anchor = location.store, location.run, location.anchor
        self.paths = paths or MachinePaths(None)  # how machine files are named in the files
        # Named once: the root machine and the host's files do not move while the run goes on.
        folder = checkpoint_folder(self.anchor)
        self._root = self.paths.root_from(folder)
        self._host = portable_host(envelope.host, folder)
        # The first envelope of a new run id is not remembered (ADR 0022): no envelope of the run is
        # older, so there is nothing a restored copy of it could repeat.
        self._remembers = not new_run
        self.durability = durability
        self.hashes = hashes if hashes is not None else {}  # live: grows as machines load
        self.envelope = envelope  # the template every snapshot is written from
        self.host_state = host_state
        self.answers = dict(answers or {})  # the paid answers not yet replayed, by key
        self.in_flight: dict[str, dict[str, Any]] = {}  # answers used since the last step or halt
        self._lock = threading.Lock()
        self._written = 0
        self._threshold = MIN_COMPACT_BYTES
        self._key = checkpoint_key()
        self._mac = ""  # the MAC the next journal line chains from
        # Called at a loop-top once every WATCH_EVERY seconds at most: how the process running the
        # run learns what an operator asked of it through the store (a cancel, ADR 0068).
        self.watch = watch
        self._look_at = time.monotonic() + WATCH_EVERY

    # --- snapshots --------------------------------------------------------

    def snapshot(self, chain: list[Frame], **fields: Any) -> None:
        """Write a full envelope of `chain` and start a fresh journal generation."""
        generation = self.envelope.generation + 1
        envelope = self.envelope.model_copy(
            update=dict(
                frames=[self._frame(frame) for frame in chain],
                usage=sum((frame.spent for frame in chain), self.unreplayed()).to_json(),
                generation=generation,
                answers=dict(self.answers),
                **self._host_update(),
                **fields,
            )
        )
        payload, self._mac = dump_signed(envelope, self._key)
        self._write(envelope, payload)
        self._open_generation({"k": "gen", "g": generation}, len(payload))

    def _write(self, envelope: Envelope, payload: bytes) -> None:
        """Store the next generation's envelope; the store, or the user's state folder, remembers it (ADR 0022)."""
        store_envelope(self.store, self.run, envelope, payload)
        if self._remembers:
            generations.remember(self.store, envelope.run_id, envelope.generation)
        self._remembers = True
        self.envelope = envelope

    def resume(self, change: dict[str, Any], envelope_bytes: int) -> None:
        """Continue the stored (suspended, signed) envelope without rewriting it.

        The new journal generation chains from the envelope's signature and its
        first line records what the resume changed (`change`, see
        `mklang.checkpoint.resumed`), so the work of a resume does not grow with
        the trace it carries (ADR 0009).
        """
        assert self.envelope.signature is not None, "only a signed envelope is continued in place"
        self._mac = self.envelope.signature.hmac
        self._open_generation({"k": "gen", "g": self.envelope.generation, "resume": change}, envelope_bytes)
        if isinstance(self.store, SummaryStore):
            self.store.summarize(self.run, summary_of(self.run, self.envelope))  # running again

    def _host_update(self) -> dict[str, Any]:
        """Fields that change as the run goes: machines loaded, the host's state; and the format
        it is written in and the package writing it (a resumed format-2 envelope of mklang 0.4.0
        goes on as format 3 of this version).

        Machine files are named relative to the root's folder, the root and
        the host's files relative to the checkpoint's, so the files can move together.
        """
        update: dict[str, Any] = {
            "format": FORMAT,
            "mklang_version": __version__,
            "machines": self.paths.names(self.hashes),
        }
        if self._root is not None:
            update["machine"] = self.envelope.machine.model_copy(update={"path": self._root})
        host = self._host
        update["host"] = host if self.host_state is None else host.model_copy(update={"state": self.host_state.save()})
        return update

    def _open_generation(self, header: dict[str, Any], envelope_bytes: int) -> None:
        """Replace the journal with one that starts with `header`; compact once it grows as large as the envelope."""
        self.store.start_journal(self.run, self._signed(header))
        self._written = 0
        self._threshold = max(MIN_COMPACT_BYTES, envelope_bytes)

    def _append(self, record: dict[str, Any], durable: bool) -> None:
        """Append one line, with the host's state as of this line. Every line reaches the OS
        at once (it survives kill -9); `durable` lines are also fsynced (they survive a power cut)."""
        with self._lock:  # the state is read in line order: a later line never holds an older one
            if self.host_state is not None:
                record = {**record, "s": self.host_state.save()}
            data = self._signed(record)
            self.store.append(self.run, data, durable=durable)
            self._written += len(data)
        faults.reach(f"journal.{record['k']}")

    # --- the engine's port --------------------------------------------------

    def loop_top(self, chain: list[Frame]) -> None:
        if self._written >= self._threshold:
            self.snapshot(chain, status="running")
        if self.watch is not None and (now := time.monotonic()) >= self._look_at:
            self._look_at = now + WATCH_EVERY
            self.watch()

    def enter(self, depth: int, frame: Frame) -> None:
        # A machine first loaded after the snapshot: its hash travels with the (signed) line.
        entered = {**self._frame(frame, seal=False), "sha256": self.hashes.get(frame.machine.path or "")}
        self._append({"k": "enter", "d": depth, "f": entered}, durable=False)

    def step(self, depth: int, record: StepRecord) -> None:
        self._settle()
        line = {"k": "step", "d": depth, "r": record}
        # Per call: a step lost to a power cut is re-executed from its durable calls.
        # Per step: this line commits the step and its calls together.
        self._append(line, durable=self.durability == "step")

    def halt(self, depth: int, error: str, usage: Usage) -> None:
        self._settle()
        self._append({"k": "halt", "d": depth, "e": error, "u": usage.to_json()}, durable=self.durability == "step")

    def replay(self, key: str, kind: str) -> Any:
        """The answer of a call that an earlier process paid for, or None."""
        if not self.answers:
            return None
        entry = self.answers.pop(key, None) or self.answers.pop(earlier_key(key), None)
        if entry is None or entry["kind"] != kind:
            return None
        with self._lock:
            self.in_flight[key] = entry  # kept again should its branch stop again
        return decode_answer(kind, entry["v"])

    def record(self, key: str, kind: str, value: Any) -> None:
        # Paid for: durable before the engine uses it, so it is never paid twice (per call).
        answer = {"kind": kind, "v": encode_answer(kind, value)}
        self._append({"k": "call", "key": key, **answer}, durable=self.durability == "call")
        with self._lock:
            self.in_flight[key] = answer

    def fold(self, prefix: str) -> None:
        """A fan-out branch finished: its record holds its answers' outputs and spend."""
        with self._lock:
            for key in [key for key in self.in_flight if key.startswith((f"{prefix}.", f"{prefix}/"))]:
                del self.in_flight[key]

    def unreplayed(self) -> Usage:
        """The spend of the answers an earlier process paid for that no frame counts
        and this one has not replayed yet (part of the run's spend so far)."""
        with self._lock:
            entries = list(self.answers.values())
        usages = (getattr(decode_answer(entry["kind"], entry["v"]), "usage", None) for entry in entries)
        return sum((usage for usage in usages if usage is not None), Usage())

    def _settle(self) -> None:
        """A level made a step or halted: the calls of the step in flight are folded into it."""
        with self._lock:
            self.answers.clear()
            self.in_flight.clear()

    def finish(self, chain: list[Frame], **fields: Any) -> None:
        """Record a terminal or suspended status as a full envelope; drop the journal.

        A suspended envelope keeps the paid answers a resume replays: those not yet
        replayed, and those of the step in flight (fan-out branches stopped mid-way)."""
        answers: dict[str, dict[str, Any]] = {}
        if fields.get("status") == "suspended":
            answers = {**self.answers, **self.in_flight}
        envelope = self.envelope.model_copy(
            update=dict(
                frames=[self._frame(frame) for frame in chain],
                generation=self.envelope.generation + 1,  # no journal left behind continues it
                answers=answers,
                **self._host_update(),
                **fields,
            )
        )
        self._write(envelope, dump_signed(envelope, self._key)[0])
        self.store.drop_journal(self.run)

    def _frame(self, frame: Frame, *, seal: bool = True) -> dict[str, Any]:
        """A frame as a snapshot records it: a long enough trace tail is sealed into a segment first
        (`segments.py`: durable before the envelope that names it), unless not `seal` (a journal line)."""
        recorded = frame.to_json(trace_fields(self.store, self.run, frame.trace, seal=seal))
        recorded["path"] = self.paths.name(recorded["path"])
        return recorded

    def _signed(self, record: dict[str, Any]) -> bytes:
        """One journal line, its MAC chained to the line before (callers hold the order)."""
        line, self._mac = sign_line(_body(record), self._mac, self._key)
        return line


def _body(record: dict[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def read_journal(
    location: Location, generation: int, chain_from: str | None = None, notes: list[str] | None = None
) -> list[dict[str, Any]]:
    """The intact records of the journal that continues envelope `generation`.

    With `chain_from` (the MAC of a signed envelope) every line must carry its
    chained MAC made with the checkpoint key; an edited line is refused. A
    torn or unreadable end (a crash mid-write, or a truncated copy) is left
    out and, given `notes`, reported there: what it recorded runs again.
    """
    raw = location.store.read_journal(location.run)
    *complete, torn = raw.split(b"\n")  # the part after the last newline is torn
    lines: list[bytes] = []
    records = []
    for line in complete:
        try:
            record = load_json(line, MAX_CHECKPOINT_DEPTH)
        except ValueError:
            break
        if not isinstance(record, dict):
            break
        lines.append(line)
        records.append(record)
    if not records or records[0].get("k") != "gen" or records[0].get("g") != generation:
        return []  # a stale journal: the envelope already holds everything
    if chain_from is not None:
        bad = check_lines(lines, chain_from, checkpoint_key())
        if bad is not None:
            raise CheckpointError(
                f"{location}: journal line {bad + 1} was edited after it was signed "
                f"(resume with --trust to use it as untrusted data)"
            )
    lost = len(complete) - len(lines) + (1 if torn else 0)
    if lost and notes is not None:
        notes.append(
            f"{location}: the journal ends in {lost} incomplete or unreadable line(s) after line {len(lines)} "
            "(a crash mid-write, or a truncated copy): what they recorded runs again, paid calls included"
        )
    return records[1:]


def resume_change(store: RunStore, run: str, envelope: Envelope) -> dict[str, Any] | None:
    """What a resume changed in a suspended envelope while that resume runs (or after it
    died): the `resume` field of the journal generation it started, else None."""
    if envelope.status != "suspended":
        return None
    try:
        journal = store.read_journal(run)
    except JournalCut as cut:  # its head still says whether a resume began; recovering from it is refused
        journal = cut.journal
    head, newline, _ = journal.partition(b"\n")
    try:
        record = load_json(head, MAX_CHECKPOINT_DEPTH) if newline else None
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("k") != "gen" or record.get("g") != envelope.generation:
        return None
    change = record.get("resume")
    return change if isinstance(change, dict) else None


def recover(
    chain: list[Frame],
    answers: dict[str, dict[str, Any]],
    records: list[dict[str, Any]],
    machine_for: Callable[[dict[str, Any]], Any],
) -> tuple[list[Frame], dict[str, dict[str, Any]], dict[str, Any] | None]:
    """Replay journal records onto the envelope's frames and its unreplayed paid `answers`.

    Returns the frame chain at the last durable loop-top, the paid answers
    still to replay (the calls of the step in flight, by key), and the host's state as of the last line
    that holds one (`p` on the step lines of journals written before `s`).
    `machine_for(frame_json)` loads the machine a frame runs.
    """
    chain = list(chain)
    answers = dict(answers)
    host_state = None
    for record in records:
        host_state = record.get("s", record.get("p", host_state))
        kind = record.get("k")
        if kind == "enter":
            depth = record["d"]
            chain = [*chain[:depth], Frame.from_json(record["f"], machine_for(record["f"]))]
        elif kind == "step":
            depth = record["d"]
            chain = chain[: depth + 1]
            frame = chain[depth]
            frame.apply(frame.machine.state(record["r"]["step"]["state"]), record["r"])
            answers = {}  # the calls of a completed step are folded into it
        elif kind == "halt":
            depth = record["d"]
            chain = chain[: depth + 1]
            chain[depth].stop(record["e"], Usage.from_json(record["u"]))
            answers = {}
        elif kind == "call":
            answers[record["key"]] = {"kind": record["kind"], "v": record["v"]}
    return chain, answers, host_state
