"""Trace segments: a level's trace kept by the run's store beside its envelope (ADR 0040).

A snapshot (compaction, suspend, finish) whose level has a trace tail of at
least `SEGMENT_BYTES` seals that tail: its JSON goes to the store as an
immutable segment named by its sha256 (`RunStore.write_segment`, durable
before any envelope names it), and the envelope's frame records the names
and step counts of its segments (`segments`, covered by the signature)
and only the steps since (`trace`). Envelopes written after it refer to
the same segments, so what a resume reads, signs and writes does not grow
with the trace already written.

Nothing reads a segment until something reads the trace (`Trace`); each is
then checked against its signed name, and a missing or edited segment is a
one-line `CheckpointError`. Segments belong to one run (the store keys them
by run and name) and go when it is removed.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Final, TypeGuard

import pydantic_core

from mklang import faults
from mklang.checkpoint.envelope import SEGMENT_NAME, Envelope
from mklang.engine.frame import Frame
from mklang.engine.records import TraceStep
from mklang.engine.trace import Segment, SegmentReader, Trace
from mklang.errors import CheckpointError
from mklang.limits import MAX_CHECKPOINT_DEPTH, NestingError, load_json
from mklang.stores import Location, RunStore, SegmentStore
from mklang.stores.file import SEGMENTS_FOLDER as FOLDER

SEGMENT_BYTES: Final = 64 * 1024  # a smaller tail stays in the envelope
NAME: Final = re.compile(SEGMENT_NAME)
# Where a checkpoint file's segments are, to copy with it.
_FOLDER_HINT: Final = f"a checkpoint file needs the {FOLDER}/ folder beside it copied with it"


def encode(steps: list[TraceStep]) -> bytes:
    """A segment's bytes: the steps as compact JSON, as the envelope encodes them (NaN and infinities as null)."""
    return pydantic_core.to_json(steps, inf_nan_mode="null")


def trace_fields(store: RunStore, run: str, trace: Trace, *, seal: bool) -> dict[str, Any]:
    """The trace fields of a frame record: `segments` (when there are any) and `trace`, the tail.

    With `seal`, a tail of at least `SEGMENT_BYTES` is first written to the
    store as a segment and sealed in `trace`. A store without segments keeps
    every step in the envelope, those of segments sealed elsewhere read (and checked).
    """
    if not keeps_segments(store):
        return {"trace": list(trace)}  # a trace sealed elsewhere (a resume into this store) is read back in
    tail = trace.tail
    if seal and tail:
        body = encode(tail)
        if len(body) >= SEGMENT_BYTES:
            segment = Segment(hashlib.sha256(body).hexdigest(), len(tail))
            store.write_segment(run, segment.name, body)
            faults.reach("segment")  # durable, and no envelope names it yet
            trace.seal(segment)
    sealed = [tuple(segment) for segment in trace.segments]
    return {"segments": sealed, "trace": trace.tail} if sealed else {"trace": trace.tail}


def keeps_segments(store: RunStore) -> TypeGuard[SegmentStore]:
    """Whether `store` keeps trace segments (`SegmentStore`): one that does not keeps every step of
    a trace in the envelope, as format 2 did."""
    return isinstance(store, SegmentStore)


def copy_segments(source: Location, target: Location, chain: list[Frame]) -> None:
    """Give the run at `target` the segments the traces of `chain` (read from `source`) name:
    a run resumed into another checkpoint keeps its trace there. Each is checked as it is read.
    A store without segments gets the steps instead, when the run's first snapshot there reads them."""
    _copy(source, target, [segment for frame in chain for segment in frame.trace.segments])


def _copy(source: Location, target: Location, segments: list[Segment]) -> None:
    store = target.store
    if not keeps_segments(store):
        return
    for segment in segments:
        store.write_segment(target.run, segment.name, _raw(source.store, source.run, str(source), segment))


def placed(envelope: Envelope, target: Location) -> Envelope:
    """`envelope`, about to be saved at `target` and resumed there (`runs.resume` of an
    `Envelope`), with every trace step it names within reach of the run there.

    The segments it names are copied from the store it was read from, each read and checked;
    into a store without segments their steps are written back into its frames instead. An
    envelope read from no store (or from `target` itself) is refused at once, naming the first
    segment `target` does not hold, rather than resumed into a run that fails when its trace is read.
    """
    source = envelope.source
    frames = []
    for record in envelope.frames:
        frame: dict[str, Any] = dict(record)
        trace = recorded_trace(source or target, frame, trusted=envelope.seal == "signed")
        if not trace.segments:
            frames.append(frame)
            continue
        if source is None or source.key == target.key:
            _require_held(target, trace.segments)
        elif keeps_segments(target.store):
            _copy(source, target, trace.segments)
        else:
            frame.pop("segments")
            frame["trace"] = list(trace)
        frames.append(frame)
    return envelope.model_copy(update={"frames": frames})


def _require_held(target: Location, segments: list[Segment]) -> None:
    """Refuse to save an envelope at `target` that names a segment the store there does not hold."""
    store = target.store
    for segment in segments:
        if not keeps_segments(store) or store.read_segment(target.run, segment.name) is None:
            raise CheckpointError(
                f"{target}: the envelope names trace segment {segment.name}, which the store there does not "
                f"hold: resume the checkpoint it was read from, or copy the run's segments there first "
                f"({_FOLDER_HINT})"
            )


def _raw(store: RunStore, run: str, where: str, segment: Segment) -> bytes:
    """The bytes of `segment`, refused unless they have its sha256 (or the store keeps no segments)."""
    raw = store.read_segment(run, segment.name) if keeps_segments(store) else None
    if raw is None:
        raise _missing(where, segment)
    if hashlib.sha256(raw).hexdigest() != segment.name:
        raise CheckpointError(f"{where}: trace segment {segment.name} was edited after it was written")
    return raw


def require_present(location: Location, chain: list[Frame]) -> None:
    """Refuse a run to be resumed whose traces name a segment its store does not hold, before
    anything runs: listing the names reads no segment."""
    store = location.store
    if not keeps_segments(store):
        return  # a trace that names segments is refused when it is read (`_raw`)
    held = store.segment_names(location.run)
    for frame in chain:
        for segment in frame.trace.segments:
            if segment.name not in held:
                raise _missing(str(location), segment)


def _missing(where: str, segment: Segment) -> CheckpointError:
    return CheckpointError(
        f"{where}: trace segment {segment.name} is missing from the run's store (removed, or the "
        f"checkpoint was copied without it; {_FOLDER_HINT})"
    )


def reader(store: RunStore, run: str, where: str, *, trusted: bool) -> SegmentReader:
    """What reads the segments an envelope at `where` names, each checked against its name.

    A segment named by an envelope signed with this user's key is this user's
    own bytes once its sha256 matches (`trusted`); any other is held to the
    nesting limit of a checkpoint someone else may have written.
    """

    def read(segment: Segment) -> list[TraceStep]:
        raw = _raw(store, run, where, segment)
        try:
            steps = load_json(raw, MAX_CHECKPOINT_DEPTH, scan=not trusted)
        except NestingError as error:
            raise CheckpointError(f"{where}: trace segment {segment.name} holds values {error}") from None
        except ValueError:
            steps = None
        if not isinstance(steps, list) or len(steps) != segment.steps or not all(isinstance(s, dict) for s in steps):
            raise CheckpointError(
                f"{where}: trace segment {segment.name} does not hold the {segment.steps} trace steps it is named for"
            )
        return steps

    return read


def recorded_trace(location: Location, frame: dict[str, Any], *, trusted: bool) -> Trace:
    """The whole trace of a frame an envelope at `location` records (its segments read when it is read)."""
    malformed = CheckpointError(f"{location}: malformed frame: its trace segments are not [sha256, steps] pairs")
    try:
        segments = [Segment(name, steps) for name, steps in frame.get("segments", [])]
    except (TypeError, ValueError):
        raise malformed from None
    if not all(isinstance(s.steps, int) and isinstance(s.name, str) and NAME.fullmatch(s.name) for s in segments):
        raise malformed
    return Trace(frame.get("trace", []), segments, reader(location.store, location.run, str(location), trusted=trusted))
