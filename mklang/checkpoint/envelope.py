"""The checkpoint envelope (SPEC section 7): a versioned pydantic model and its JSON codec.

Frames are typed (`FrameRecord`, declared once here for envelopes and
journals alike), so the published schema describes them.
Where the bytes live is a store's business (`mklang.stores`);
older formats are migrated forward on load by the functions in `MIGRATIONS`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, NotRequired

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
    with_config,
)
from typing_extensions import TypedDict

from mklang.checkpoint.signing import UNSIGNED, Seal, checkpoint_key, seal_of, sign_encoded, signed_as_written
from mklang.errors import CheckpointError
from mklang.limits import MAX_CHECKPOINT_DEPTH, NestingError, load_json
from mklang.stores import Location, RunStore, SummaryStore, locate
from mklang.stores.summary import RunSummary, summarized, summary_reason
from mklang.vocabulary import DEFAULT_RUN_CONCURRENCY

if TYPE_CHECKING:
    from mklang.engine import RunOptions

FORMAT: Final = 3
# Formats read as they are: a format-2 envelope is a format-3 one whose frames have no trace segments.
CURRENT: Final = (2, 3)
SEGMENT_NAME = r"^[0-9a-f]{64}$"
Status = Literal["running", "suspended", "done", "halted"]


class Budgets(BaseModel):
    """The host budgets of the run; `max_time` restarts with every process."""

    max_tokens: int | None = Field(default=None, ge=0)
    max_cost: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    max_time: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class MachineRef(BaseModel):
    """The root machine; `path` is its file relative to the checkpoint's folder."""

    name: str
    path: str | None
    sha256: str | None


class HostSettings(BaseModel):
    """How the run was hosted, so `resume` can rebuild the same host without secrets."""

    # Its fields are `mklang.host.settings.SETTINGS`, in that order (ADR 0039).

    model_config = ConfigDict(extra="allow")

    script: str | None = None  # scenario script of a scripted run
    scenario: str | None = None
    state: dict[str, Any] | None = None  # what the host remembers across calls (`journal.HostState`)
    provider: str | None = None
    model: str | None = None
    config: str | None = None
    replay: str | None = None
    record: str | None = None
    pool: str | None = None  # the budget pool of the run's store its model calls draw from (ADR 0067)
    plugins: list[str] = Field(default_factory=list)  # --plugin modules or files
    mcp: list[str] = Field(default_factory=list)  # --mcp servers, NAME=COMMAND or NAME=URL

    @model_validator(mode="before")
    @classmethod
    def _earlier_state(cls, data: Any) -> Any:
        """Checkpoints written before host states call a scripted host's state `position`."""
        if isinstance(data, dict) and "position" in data:
            position = data["position"]
            data = {key: value for key, value in data.items() if key != "position"}
            data.setdefault("state", position)
        return data


class Signature(BaseModel):
    """HMAC-SHA256 of the envelope's JSON as written (without the signature), and which key made it (`signing.py`)."""

    key_id: str
    hmac: str


class UsageRecord(TypedDict):
    """Spend as recorded (`Usage.to_json`); `Usage.from_json` checks its numbers."""

    input_tokens: int
    output_tokens: int
    cost_usd: float


@with_config(ConfigDict(extra="allow"))
class BranchRecord(TypedDict):
    """A finished branch of a fan-out a budget cut short: its output, spend and trace extras."""

    output: Any
    usage: UsageRecord


@with_config(ConfigDict(extra="forbid"))
class FrameRecord(TypedDict):
    """One run level at its loop-top (`mklang.engine.frame.Frame.to_json`), in an envelope or a journal."""

    machine: str
    path: str | None
    state: str
    context: dict[str, Any]
    tainted: list[str]  # top-level context keys that hold untrusted data
    steps: Annotated[int, Field(ge=0)]
    budget: Annotated[int, Field(ge=0)]
    usage: UsageRecord
    feedback: str | None
    repair_left: list[tuple[str, int, int]]  # [state, gate index, repairs left]
    visits: dict[str, int]
    # The trace: sealed segments the run's store keeps, [sha256 of its bytes, steps] each
    # (`segments.py`; none in format 2), then the steps since.
    segments: NotRequired[list[tuple[Annotated[str, Field(pattern=SEGMENT_NAME)], Annotated[int, Field(ge=1)]]]]
    trace: list[dict[str, Any]]
    last_output: Any
    branches: NotRequired[list[tuple[int, BranchRecord]]]  # finished branches of a fan-out a budget cut short
    halted: NotRequired[str | None]  # the halt that ended the level
    # The human question it waits on: {ask, reply_to}, a decision's whole record (`engine.decisions`).
    ask: NotRequired[dict[str, Any] | None]
    # Control-flow taint; a frame without them resumes as all external with a tainted decision.
    external: NotRequired[list[str]]  # top-level keys holding data from outside the run
    decision_tainted: NotRequired[bool]  # a judge reading external data chose the way here, unconfirmed


@with_config(ConfigDict(extra="forbid"))
class EnteredFrame(FrameRecord):
    """The frame of a journal `enter` line: a level started after the last snapshot."""

    sha256: NotRequired[str | None]  # its machine file's hash, when the snapshot did not record it


class Ancestor(BaseModel):
    """A run a fork was made from (ADR 0058): which run, where it was read, the step the fork
    starts at, the sha256 of that run's machine files, and what its prefix had spent (inherited)."""

    run_id: str
    checkpoint: str
    step: str
    machines: dict[str, str] = Field(default_factory=dict)
    inherited: UsageRecord


class Edit(BaseModel):
    """What one resume changed before the run went on (ADR 0066): the loop-top it continued from
    (the dotted step numbers root first, as `fork --at` takes them), the values it set there (`--set`,
    tainted) and the innermost level's new step budget (`--budget`), so a fork replays them there."""

    model_config = ConfigDict(extra="forbid")

    at: str
    set: dict[str, Any] = Field(default_factory=dict)
    budget: int | None = Field(default=None, ge=0)


class Action(BaseModel):
    """What an operator did to the run, outside its machine (ADR 0068): `cancel` (it halted
    `cancelled`) or `raise-budget` (it was resumed with the caps in `budgets`); `by` says from
    where (`console`, `cli`), `at` when (ISO 8601, UTC)."""

    model_config = ConfigDict(extra="forbid")

    action: Literal["cancel", "raise-budget"]
    by: str
    at: str
    budgets: dict[str, float | int] | None = None


class Envelope(BaseModel):
    """Everything needed to continue a run, as one JSON document."""

    model_config = ConfigDict(extra="forbid")

    format: Literal[2, 3] = FORMAT
    mklang_version: str
    run_id: str
    status: Status
    reason: str | None = None  # why a suspended run stopped
    detail: str | None = None
    error: str | None = None  # the halt of a halted run
    at: str | None = None
    machine: MachineRef
    # sha256 of every machine file loaded, by name relative to the root's folder (`stdlib:<file>` for the library)
    machines: dict[str, str] = Field(default_factory=dict)
    # sha256 of the root and every machine it may call, by the same names, when the run started:
    # their texts are kept in the run's store (`texts.py`), so it runs where the files are not
    texts: dict[str, str] = Field(default_factory=dict)
    frames: list[FrameRecord]  # root..innermost
    budgets: Budgets = Field(default_factory=Budgets)
    usage: UsageRecord = Field(default_factory=lambda: UsageRecord(input_tokens=0, output_tokens=0, cost_usd=0.0))
    hitl: bool = False
    untrusted_flow: Literal["report", "halt"] = "report"  # a tainted decision reaching an effect: report or halt
    ask: str | None = None
    reply_to: str | None = None
    concurrency: int = Field(default=DEFAULT_RUN_CONCURRENCY, ge=1)
    host: HostSettings = Field(default_factory=HostSettings)
    result: Any = None
    generation: int = 0  # which journal generation continues this envelope
    # Paid answers of the step in flight not yet replayed (key -> {"kind", "v"}): kept
    # in the snapshot itself, so that no crash between snapshot and journal loses them,
    # and in a suspended envelope for the fan-out branches a ceiling stopped mid-way.
    answers: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # The context the run started with, its host's inputs, so a fork starts as it did (ADR 0058).
    input: dict[str, Any] | None = None
    lineage: list[Ancestor] = Field(default_factory=list)  # the runs it was forked from, oldest first
    # What each resume set, in order (ADR 0066); None in a run begun before they were recorded.
    edits: list[Edit] | None = None
    actions: list[Action] = Field(default_factory=list)  # what operators did to it, oldest first
    # The W3C trace context (`traceparent`, ...) the run's spans continue under when it resumes
    # (ADR 0034). Display data, left out of the signature: a malformed one reads as none.
    trace: dict[str, str] | None = None
    signature: Signature | None = None  # written by `dump`; checked by `load` into `seal`

    _seal: Seal = PrivateAttr(default="unsigned")
    _stored_bytes: int = PrivateAttr(default=0)
    _source: Location | None = PrivateAttr(default=None)

    @field_validator("trace", mode="before")
    @classmethod
    def _display_only(cls, value: Any) -> Any:
        """An edited trace context only changes where spans go: one that is not a map of texts is none."""
        is_texts = isinstance(value, dict) and all(isinstance(item, str) for item in (*value, *value.values()))
        return value if is_texts else None

    def run_options(self) -> RunOptions:
        """How the run it records goes on: its time budget, calls in flight, whether escalations
        wait for a human, and the untrusted-flow policy (the token and dollar caps are `Caps`)."""
        return {
            "max_time": self.budgets.max_time,
            "concurrency": self.concurrency,
            "hitl": self.hitl,
            "untrusted_flow": self.untrusted_flow,
        }

    @property
    def source(self) -> Location | None:
        """Where the envelope was read from (`load` sets it): its trace segments are there."""
        return self._source

    @property
    def seal(self) -> Seal:
        """How the file this envelope was read from was signed (`load` sets it)."""
        return self._seal

    @property
    def stored_bytes(self) -> int:
        """The size of the file this envelope was read from (`load` sets it)."""
        return self._stored_bytes


def _relative_machine_paths(data: dict[str, Any]) -> dict[str, Any]:
    """Format 1 -> 2: machine files were absolute; now they are named relative to the root's folder.

    The root keeps its absolute path, which is also a valid name relative to
    the checkpoint's folder.
    """
    from mklang.checkpoint.paths import MachinePaths

    data = {**data, "format": 2}
    root = data.get("machine", {}).get("path") if isinstance(data.get("machine"), dict) else None
    if not isinstance(root, str) or not os.path.isabs(root):
        return data
    paths = MachinePaths(root)
    if isinstance(data.get("machines"), dict):
        data["machines"] = {paths.name(name): digest for name, digest in data["machines"].items()}
    if isinstance(data.get("frames"), list):
        data["frames"] = [
            {**frame, "path": paths.name(frame["path"])}
            if isinstance(frame, dict) and isinstance(frame.get("path"), str)
            else frame
            for frame in data["frames"]
        ]
    return data


# format -> function that turns a document of that format into the next one.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _relative_machine_paths}


def migrate(data: dict[str, Any]) -> dict[str, Any]:
    version = data.get("format")
    if not isinstance(version, int):
        raise CheckpointError("not a mklang checkpoint (no 'format' field)")
    while version < CURRENT[0]:
        if version not in MIGRATIONS:
            raise CheckpointError(f"checkpoint format {version} is too old to migrate")
        data = MIGRATIONS[version](data)
        version = data["format"]
    if version > FORMAT:
        raise CheckpointError(f"checkpoint format {version} is newer than this mklang understands ({FORMAT})")
    return data


def dump_signed(envelope: Envelope, key: bytes | None = None) -> tuple[bytes, str]:
    """The file bytes of `envelope`, signed with `key` (by default the checkpoint key, read now), and
    the signature's MAC.

    Encoded once, in field order (ADR 0036): the MAC covers the bytes as written.
    """
    signed, signature = sign_encoded(_encoded(envelope), key or checkpoint_key(), envelope.trace)
    return signed, signature["hmac"]


def _encoded(envelope: Envelope) -> bytes:
    """The JSON of `envelope` without its `UNSIGNED` fields, in field order: what its signature covers."""
    return Envelope.__pydantic_serializer__.to_json(envelope, exclude=set(UNSIGNED))


def read_back(envelope: Envelope, *fields: str) -> dict[str, Any]:
    """`fields` of `envelope` as a reader of its stored JSON gets them (a tuple as a list, NaN as
    null): encoded by the envelope's own serializer and decoded, the other fields left alone."""
    stored: dict[str, Any] = json.loads(Envelope.__pydantic_serializer__.to_json(envelope, include=set(fields)))
    return stored


def dump(envelope: Envelope) -> bytes:
    return dump_signed(envelope)[0]


def save(target: str | Path | Location, envelope: Envelope) -> None:
    """Write `envelope`, signed, to a checkpoint path or store location, atomically."""
    location = locate(target)
    store_envelope(location.store, location.run, envelope, dump(envelope))


def store_envelope(store: RunStore, run: str, envelope: Envelope, payload: bytes) -> None:
    """Write an envelope's bytes `payload` to a store, with the summary a listing shows of it."""
    if isinstance(store, SummaryStore):
        store.write(run, payload, generation=envelope.generation, summary=summary_of(run, envelope))
    else:  # a listing reads the envelope itself (`stores.summaries_of`)
        store.write(run, payload, generation=envelope.generation)


def summary_of(run: str, envelope: Envelope) -> RunSummary:
    """What a listing shows of a run whose envelope is `envelope` (`RunSummary`; display only)."""
    usage = envelope.usage
    frame: dict[str, Any] = dict(envelope.frames[-1]) if envelope.frames else {}
    summary = RunSummary(
        run,
        run_id=envelope.run_id,
        machine=envelope.machine.name,
        status=envelope.status,
        reason=summary_reason(envelope.status, envelope.reason, envelope.error, envelope.ask),
        tokens=usage["input_tokens"] + usage["output_tokens"],
        cost_usd=usage["cost_usd"],
        budget_tokens=envelope.budgets.max_tokens,
        budget_cost=envelope.budgets.max_cost,
    )
    return summarized(summary, frame.get("ask"), envelope.ask, frame.get("context"))


def load(target: str | Path | Location) -> Envelope:
    """Read a checkpoint from a path or store location; every way it can be unusable is one CheckpointError line."""
    location = locate(target)
    raw = location.store.read(location.run)
    if raw is None:
        raise CheckpointError(f"{location}: no such checkpoint")
    envelope = parse(raw, str(location))
    envelope._source = location
    return envelope


def parse(raw: bytes, where: str) -> Envelope:
    """The envelope in `raw` (migrated to the current format, its seal checked); errors name `where`."""
    if not raw.strip():
        raise CheckpointError(f"{where}: the checkpoint is empty")
    key = checkpoint_key()
    signed = signed_as_written(raw, key) is not None  # this user's own bytes need no scan for hostile nesting
    try:
        data = load_json(raw, MAX_CHECKPOINT_DEPTH, scan=not signed)
    except NestingError as error:
        raise CheckpointError(f"{where}: the checkpoint holds values {error}") from None
    except ValueError as error:
        from mklang.vocabulary import SUFFIXES

        if Path(where).suffix.lower() in SUFFIXES:
            raise CheckpointError(
                f"{where} is a machine file, not a checkpoint: `mklang run {where} --checkpoint cp.json` writes one"
            ) from None
        raise CheckpointError(f"{where}: the checkpoint is not valid JSON (truncated or corrupted?): {error}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: not a mklang checkpoint (expected a JSON object)")
    try:
        envelope = Envelope.model_validate(migrate(data))
    except CheckpointError as error:
        raise CheckpointError(f"{where}: {error}") from None
    except ValidationError as error:
        first = error.errors()[0]
        spot = ".".join(str(part) for part in first["loc"])
        raise CheckpointError(f"{where}: not a valid mklang checkpoint: {spot}: {first['msg']}") from None
    envelope._seal = "signed" if signed else seal_of(data, key, raw, lambda: _encoded(envelope))
    envelope._stored_bytes = len(raw)
    return envelope


def json_schema() -> dict[str, Any]:
    """The published JSON schema of the envelope (docs/checkpoint.schema.json)."""
    return Envelope.model_json_schema()
