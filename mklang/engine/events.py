"""What a run tells its observers as it goes: typed events, and the sink they are emitted to.

The engine emits an event at each boundary of a run (it started or resumed, a
state was entered, a model, tool or hook was called, a gate decided, a fan-out
branch or a called machine started and finished, the run suspended, halted or
finished) through `Runtime.emit`, the one way anything watches a run: the live
view, `--events` files, tracing and the web console all consume these. Their
JSON form is `docs/events.schema.json`, described in docs/events.md.

Every event carries an envelope: the schema version, the run id (the same
across resumes), a sequence number, the time, and its `path`: the levels it
happened in, root first, each the state (and fan-out branch) it was running,
so a consumer can nest events as the run nested them.

Model and tool output text is not in an event, only its length; prompts and
outputs are added when the run is asked to trace content (ADR 0032).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field
from json.encoder import JSONEncoder, c_make_encoder, encode_basestring  # type: ignore[attr-defined]
from typing import Any, ClassVar, Literal, NamedTuple, Protocol

from mklang.providers.base import Usage

SCHEMA_VERSION = 1  # raised when an event's meaning or a field changes; new kinds or fields keep it (docs/events.md)


@dataclass(frozen=True, init=False)
class PathLevel:
    """One level of a run in an event's path: its machine, the state it runs (the
    state's step number) and, inside a fan-out of that state, the branch's index.
    Made every step of an observed run: its `__init__` fills its dict, as `Usage`'s does."""

    machine: str
    state: str
    step: int
    branch: int | None = None

    def __init__(self, machine: str, state: str, step: int, branch: int | None = None):
        kept = self.__dict__
        kept["machine"], kept["state"], kept["step"], kept["branch"] = machine, state, step, branch

    def to_json(self) -> dict[str, Any]:
        return {"machine": self.machine, "state": self.state, "step": self.step, "branch": self.branch}


# The path of the code running now: set by the engine as it enters a state or a branch, and
# carried into a fan-out branch's thread with the rest of its caller's context.
PATH: ContextVar[tuple[PathLevel, ...]] = ContextVar("mklang_path", default=())


@dataclass(kw_only=True)
class Event:
    """The envelope every event has; `Runtime.emit` fills it in. `run` is the run's name in a
    store, given in batches and workers (`named`). Not frozen, as a frozen dataclass is several
    times dearer to make and `--events` makes several a step: no sink changes an event it is given."""

    kind: ClassVar[str]
    run_id: str = ""
    seq: int = 0  # 1, 2, ... in the order this process emitted the run's events
    time: float = 0.0  # seconds since the epoch
    path: tuple[PathLevel, ...] = ()
    run: str | None = None

    @property
    def in_branch(self) -> bool:
        """Whether the event happened inside a fan-out branch."""
        return any(segment.branch is not None for segment in self.path)

    def to_json(self, content: bool = True) -> dict[str, Any]:
        """The event as one line of `--events` (docs/events.schema.json); without `content`, the
        content fields are left out even when another of the run's sinks asked for them.

        Made from the event's own dict, whose keys are its fields in order (the envelope's
        first), then the few that are not written as they are set in place: the time as
        text, the path as maps, each spend as a map; `run` and the content fields are left
        out when not given. The path's maps are shared by the events of one path."""
        data: dict[str, Any] = {"schema": SCHEMA_VERSION, "event": self.kind, **self.__dict__}
        data["time"] = utc_text(self.time)
        path = _path  # read once: a batch's threads replace it
        data["path"] = (path if path[0] is self.path else _made_path(self.path))[1]
        if self.run is None:
            del data["run"]
        shape = _shape(type(self))
        for name in shape.spends:
            data[name] = data[name].to_json()
        for name in shape.contents:
            if not content or data[name] is None:
                del data[name]
        return data

    def to_line(self, content: bool = True) -> str:
        """`to_json(content)` as one line of JSON, the text `json_text` makes of it: the envelope's
        text is put together here (the path's made once a path, the run id's once a run), only
        the kind's own fields are encoded. Raises ValueError on a NaN or an infinity, as
        `json_text` does."""
        shape = _SHAPES.get(type(self)) or _shape(type(self))
        fields = self.__dict__
        rest = {name: fields[name] for name in shape.own}
        for name in shape.spends:
            rest[name] = rest[name].to_json()
        for name in shape.contents:
            if not content or rest[name] is None:
                del rest[name]
        run_id, path = _run_id, _path  # each read once: a batch's threads replace them
        if run_id[0] != self.run_id:
            run_id = _quote_run_id(self.run_id)
        if path[0] is not self.path:
            path = _made_path(self.path)
        line = f'{shape.head}{run_id[1]}, "seq": {self.seq}, "time": "{utc_text(self.time)}", "path": {path[2]}'
        if self.run is not None:
            line += f', "run": {encode_basestring(self.run)}'
        body = "".join(_encoder(rest, False))
        return f"{line}, {body[1:]}" if len(body) > 2 else f"{line}}}"


_run_id: tuple[str, str] = ("", '""')  # the last run id, and its JSON text


def _quote_run_id(run_id: str) -> tuple[str, str]:
    """A run id and its JSON text, kept for the next event: each event of a run carries it."""
    global _run_id
    _run_id = quoted = (run_id, encode_basestring(run_id))
    return quoted


# The C encoder `json.dumps` makes for each call, made once: `json_text(value)` is the text of
# `json.dumps(value, ensure_ascii=False, default=str, allow_nan=False, check_circular=False)`.
_encoder = (
    c_make_encoder(None, str, encode_basestring, None, ": ", ", ", False, False, False)
    if c_make_encoder is not None
    else JSONEncoder(ensure_ascii=False, default=str, allow_nan=False, check_circular=False).iterencode
)


def json_text(value: Any) -> str:
    """`value` as JSON text, as `--events` writes it (a NaN or an infinity raises ValueError)."""
    return "".join(_encoder(value, False))  # False: the C encoder's indent level 0, iterencode's not one-shot


_second: tuple[int, str] = (0, "1970-01-01T00:00:00")  # the last whole second written, as text


def utc_text(seconds: float) -> str:
    """A time since the epoch as ISO 8601 in UTC to the microsecond, as `datetime.isoformat` writes
    it (`2026-12-02T13:08:41.123456Z`; no fraction on a whole second); the second's text is made
    once a second: every event has a time."""
    global _second
    whole = int(seconds)
    micro = round((seconds - whole) * 1e6)  # rounded as datetime rounds it (the difference is exact)
    if micro >= 1_000_000:
        whole, micro = whole + 1, micro - 1_000_000
    if _second[0] != whole:
        _second = (whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)))
    text = _second[1]
    return f"{text}.{micro:06d}Z" if micro else f"{text}Z"


_ENVELOPE = frozenset(item.name for item in dataclasses.fields(Event))
CONTENT = frozenset({"prompt", "output", "arguments", "text"})  # the fields only traced content fills in (ADR 0032)


class _Shape(NamedTuple):
    """What `to_json` and `to_line` read of an event kind, named once per kind (`--events` writes
    every event): its own fields in order, those holding a spend, those that are content, and the
    text its lines begin with."""

    own: tuple[str, ...]
    spends: tuple[str, ...]
    contents: tuple[str, ...]
    head: str


_SHAPES: dict[type[Event], _Shape] = {}


def _shape(kind: type[Event]) -> _Shape:
    known = _SHAPES.get(kind)
    if known is None:
        named = [item for item in dataclasses.fields(kind) if item.name not in _ENVELOPE]
        known = _SHAPES[kind] = _Shape(
            tuple(item.name for item in named),
            tuple(item.name for item in named if item.type in ("Usage", Usage)),
            tuple(item.name for item in named if item.name in CONTENT),
            f'{{"schema": {SCHEMA_VERSION}, "event": {encode_basestring(kind.kind)}, "run_id": ',
        )
    return known


_path: tuple[tuple[PathLevel, ...], list[dict[str, Any]], str] = ((), [], "[]")  # the last path: maps, text


def _made_path(path: tuple[PathLevel, ...]) -> tuple[tuple[PathLevel, ...], list[dict[str, Any]], str]:
    """`path`, its maps and their JSON text, kept for the events of one path (the engine sets a
    path once a state)."""
    global _path
    maps = [segment.to_json() for segment in path]
    _path = made = (path, maps, json_text(maps))
    return made


CallOutcome = Literal["paid", "replayed", "failed"]
DecidedBy = Literal["judge", "host", "catch-all"]
BranchStatus = Literal["done", "failed", "stopped"]
CallStatus = Literal["done", "halted", "suspended", "stopped"]


@dataclass(kw_only=True)
class _Begun(Event):
    machine: str
    max_tokens: int | None
    max_cost: float | None
    concurrency: int
    hitl: bool


@dataclass(kw_only=True)
class RunStarted(_Begun):
    """A run starts from its entry state, under these budgets (None: none)."""

    kind = "run.started"


@dataclass(kw_only=True)
class RunResumed(_Begun):
    """A run continues from its checkpoint: a suspension, or (`recovered`) a crash; `spent` is
    what earlier processes paid."""

    kind = "run.resumed"
    recovered: bool
    spent: Usage


@dataclass(kw_only=True)
class StateEntered(Event):
    """A level is at its loop-top before running `state` as its step `step` (the last segment of
    the path); its budgets are checked next. `spent` is the whole run's so far."""

    kind = "state.entered"
    machine: str
    state: str
    step: int
    steps: int  # the level's steps taken
    budget: int  # the level's step budget
    spent: Usage


@dataclass(kw_only=True)
class _ModelCall(Event):
    call: Literal["produce", "judge"]
    key: str
    tier: str
    provider: str | None
    model: str | None


@dataclass(kw_only=True)
class ModelStarted(_ModelCall):
    """A model call is about to be answered: `call` is produce or judge, `key` its idempotency
    key in the run. `provider` and `model` are known when the provider routes by tier."""

    kind = "model.started"
    prompt: dict[str, Any] | None = None  # with trace content: the system and user prompts, or the judged conditions


@dataclass(kw_only=True)
class ModelFinished(_ModelCall):
    """A model call ended: `paid` by this process, `replayed` from the checkpoint (paid by an
    earlier process), or `failed` (`error` says why; what it cost is still in `usage`)."""

    kind = "model.finished"
    outcome: CallOutcome
    usage: Usage
    duration_ms: float
    output_chars: int | None  # the length of the answer (produce) or None (judge)
    choice: int | str | None  # the judge's answer: a gate's index in its batch, none or unparseable
    error: str | None
    output: str | None = None  # with trace content: the answer


@dataclass(kw_only=True)
class ModelDelta(_ModelCall):
    """A piece of a produce call's answer as the provider streams it, told only to an observer that
    asks for them (`wants_deltas`): `offset` is the length of the answer before it (0 again when a
    retried call streams its answer anew), `chars` its own length. A replayed answer has none."""

    kind = "model.delta"
    offset: int
    chars: int
    text: str | None = None  # with trace content: the piece itself


@dataclass(kw_only=True)
class _ToolCall(Event):
    tool: str
    key: str
    read_only: bool


@dataclass(kw_only=True)
class ToolStarted(_ToolCall):
    """A host tool is about to run; `read_only` is the host's (or the machine's) word on it."""

    kind = "tool.started"
    arguments: Any = None  # with trace content: what the tool is given


@dataclass(kw_only=True)
class ToolFinished(_ToolCall):
    """A host tool ended: `paid` (ran in this process), `replayed` or `failed`."""

    kind = "tool.finished"
    outcome: CallOutcome
    duration_ms: float
    output_chars: int | None
    error: str | None
    output: str | None = None  # with trace content: the observation


@dataclass(kw_only=True)
class HookCalled(Event):
    """A hook gate asked its host predicate (hooks are never journaled: they run every time)."""

    kind = "hook.called"
    hook: str
    result: bool | None  # None when it failed
    duration_ms: float
    error: str | None


@dataclass(kw_only=True)
class GateDecided(Event):
    """Where a state goes: the gate that fired (its index and label, None when none did), by
    whom (`judge`, `host` or `catch-all`), its policy (or the halt), and whether a judge reading
    outside data chose it (`decision_tainted`)."""

    kind = "gate.decided"
    machine: str
    state: str
    gate: int | None
    label: str | None
    decided_by: DecidedBy | None
    policy: str
    to: str | None
    judge_fallback: bool  # the judge's answer was unreadable and `otherwise` caught it
    decision_tainted: bool


@dataclass(kw_only=True)
class _Branch(Event):
    index: int  # the branch's place in the fan-out, from 0
    count: int  # the fan-out's branches


@dataclass(kw_only=True)
class BranchStarted(_Branch):
    """A fan-out branch starts (its path is the fan-out state's; inside it, the segment gets `branch`)."""

    kind = "branch.started"


@dataclass(kw_only=True)
class BranchFinished(_Branch):
    """A fan-out branch ended: `done`, `failed` (its output is a branch error) or `stopped`
    (a run-wide ceiling stopped it; a resume runs it again)."""

    kind = "branch.finished"
    status: BranchStatus
    usage: Usage


@dataclass(kw_only=True)
class _Call(Event):
    machine: str  # the called machine


@dataclass(kw_only=True)
class CallStarted(_Call):
    """A `call` state starts (or, `resumed`, continues) a machine one level deeper."""

    kind = "call.started"
    resumed: bool


@dataclass(kw_only=True)
class CallFinished(_Call):
    """A called machine ended: done, halted, suspended (the run parks inside it) or stopped."""

    kind = "call.finished"
    status: CallStatus
    usage: Usage


@dataclass(kw_only=True)
class RunSuspended(Event):
    """The run parks: why, where, and the human question it waits on (if any)."""

    kind = "run.suspended"
    reason: str
    at: str | None
    ask: str | None
    reply_to: str | None


@dataclass(kw_only=True)
class RunHalted(Event):
    """The run ends for good with `error` at its state `at`."""

    kind = "run.halted"
    error: str
    at: str | None


@dataclass(kw_only=True)
class RunFinished(Event):
    """The last event of a run in this process: how it ended, its spend (earlier processes'
    included) and the calls this process paid for, by kind."""

    kind = "run.finished"
    status: str  # done, halted or suspended
    usage: Usage
    calls: dict[str, int] = field(default_factory=dict)


KINDS: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        RunStarted,
        RunResumed,
        StateEntered,
        ModelStarted,
        ModelFinished,
        ModelDelta,
        ToolStarted,
        ToolFinished,
        HookCalled,
        GateDecided,
        BranchStarted,
        BranchFinished,
        CallStarted,
        CallFinished,
        RunSuspended,
        RunHalted,
        RunFinished,
    )
}


class EventSink(Protocol):
    """What observes runs. `emit` is called for each event of a run in `seq` order, one call at a
    time for a run (events of its fan-out branches are serialized; a batch's runs are not), on
    the thread that reached the boundary.
    An exception it raises ends the run as a crash would: a sink that must never stop a run
    catches its own errors. A sink with an attribute `trace_content = True` asks for prompts,
    outputs and tool arguments in the events (`traces_content`); one with `stream_deltas = True`
    asks for `model.delta` events, so the providers that can stream answers do (`wants_deltas`),
    their text given with trace content, or to a sink that shows the answer and records nothing
    (`stream_text = True`, as `--stream` does: `--events` writes the text only with content)."""

    def emit(self, event: Event) -> None: ...


def traces_content(sink: EventSink | None) -> bool:
    """Whether `sink` asks for the content of calls (prompts, outputs) in the events."""
    return bool(getattr(sink, "trace_content", False))


def wants_deltas(sink: EventSink | None) -> bool:
    """Whether `sink` asks for the answers of produce calls as they are streamed (`model.delta`)."""
    return bool(getattr(sink, "stream_deltas", False)) or wants_text(sink)


def wants_text(sink: EventSink | None) -> bool:
    """Whether `sink` asks for the text of `model.delta` events without asking for content."""
    return bool(getattr(sink, "stream_text", False))


class Tee:
    """Several sinks as one, each given every event in turn."""

    def __init__(self, sinks: Iterable[EventSink | None]):
        self.sinks = [sink for sink in sinks if sink is not None]
        self.trace_content = any(traces_content(sink) for sink in self.sinks)
        self.stream_deltas = any(wants_deltas(sink) for sink in self.sinks)
        self.stream_text = any(wants_text(sink) for sink in self.sinks)

    def emit(self, event: Event) -> None:
        for sink in self.sinks:
            sink.emit(event)


class Named:
    """A sink whose events carry the run's name in its store (a batch's, a worker's runs)."""

    def __init__(self, sink: EventSink, run: str):
        self.sink, self.run = sink, run
        self.trace_content = traces_content(sink)
        self.stream_deltas, self.stream_text = wants_deltas(sink), wants_text(sink)

    def emit(self, event: Event) -> None:
        # Named in place, as `Runtime.emit` stamps the envelope: made for this emit, the event is
        # no other sink's yet (a run's observer is wrapped whole, `Named(Tee(...))`).
        event.run = self.run
        self.sink.emit(event)


def joined(*sinks: EventSink | None) -> EventSink | None:
    """The sinks given as one (None when there are none)."""
    present = [sink for sink in sinks if sink is not None]
    return None if not present else present[0] if len(present) == 1 else Tee(present)


class CallAbout(Protocol):
    """What the events of one model or tool call say of it, built by the engine before the call."""

    def started(self, key: str, content: bool) -> Event: ...

    def finished(self, key: str, value: Any, replayed: bool, seconds: float, content: bool) -> Event: ...

    def failed(self, key: str, error: BaseException, usage: Usage | None, seconds: float) -> Event: ...


@dataclass
class ModelAbout:
    """A produce or judge call, with its prompt (the system and user prompts, or the conditions judged)."""

    call: Literal["produce", "judge"]
    tier: str
    provider: str | None
    model: str | None
    prompt: dict[str, Any]

    def _common(self, key: str) -> dict[str, Any]:
        return {"call": self.call, "key": key, "tier": self.tier, "provider": self.provider, "model": self.model}

    def started(self, key: str, content: bool) -> Event:
        return ModelStarted(**self._common(key), prompt=self.prompt if content else None)

    def finished(self, key: str, value: Any, replayed: bool, seconds: float, content: bool) -> Event:
        text = getattr(value, "text", None)
        return ModelFinished(
            **self._common(key),
            outcome="replayed" if replayed else "paid",
            usage=value.usage,
            duration_ms=ms(seconds),
            output_chars=None if text is None else len(text),
            choice=getattr(value, "choice", None),
            error=None,
            output=text if content else None,
        )

    def delta(self, key: str, offset: int, text: str, content: bool) -> Event:
        return ModelDelta(**self._common(key), offset=offset, chars=len(text), text=text if content else None)

    def failed(self, key: str, error: BaseException, usage: Usage | None, seconds: float) -> Event:
        return ModelFinished(
            **self._common(key),
            outcome="failed",
            usage=usage or Usage(),
            duration_ms=ms(seconds),
            output_chars=None,
            choice=None,
            error=str(error),
        )


@dataclass
class ToolAbout:
    """A host tool call, with the arguments it is given."""

    tool: str
    read_only: bool
    arguments: Any

    def started(self, key: str, content: bool) -> Event:
        return ToolStarted(
            tool=self.tool, key=key, read_only=self.read_only, arguments=self.arguments if content else None
        )

    def finished(self, key: str, value: Any, replayed: bool, seconds: float, content: bool) -> Event:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        return ToolFinished(
            tool=self.tool,
            key=key,
            read_only=self.read_only,
            outcome="replayed" if replayed else "paid",
            duration_ms=ms(seconds),
            output_chars=len(text),
            error=None,
            output=text if content else None,
        )

    def failed(self, key: str, error: BaseException, usage: Usage | None, seconds: float) -> Event:
        return ToolFinished(
            tool=self.tool,
            key=key,
            read_only=self.read_only,
            outcome="failed",
            duration_ms=ms(seconds),
            output_chars=None,
            error=str(error),
        )


def ms(seconds: float) -> float:
    """A duration as events give it: milliseconds, to the microsecond."""
    return round(seconds * 1000, 3)
