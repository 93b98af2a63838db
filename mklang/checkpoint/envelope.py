"""The checkpoint envelope (SPEC section 7): a versioned pydantic model, and its file.

Files are written atomically (temp file in the same folder, fsync, rename,
fsync of the folder) and owner-only, so a reader sees the previous or the new
version, never a torn one. Older formats are migrated forward on load by the
functions in `MIGRATIONS`.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from mklang import faults
from mklang.checkpoint.signing import Seal, checkpoint_key, seal_of, sign
from mklang.errors import CheckpointError
from mklang.limits import MAX_CHECKPOINT_DEPTH, NestingError, load_json

FORMAT: Final = 2
Status = Literal["running", "suspended", "done", "halted"]


class Budgets(BaseModel):
    """The host budgets of the run; `max_time` restarts with every process."""

    max_tokens: int | None = None
    max_cost: float | None = None
    max_time: float | None = None


class MachineRef(BaseModel):
    """The root machine; `path` is its file relative to the checkpoint's folder."""

    name: str
    path: str | None
    sha256: str | None


class HostSettings(BaseModel):
    """How the run was hosted, so `resume` can rebuild the same host without secrets."""

    model_config = ConfigDict(extra="allow")

    script: str | None = None  # scenario script of a scripted run
    scenario: str | None = None
    position: dict[str, Any] | None = None  # the scripted answers consumed so far
    provider: str | None = None
    model: str | None = None
    config: str | None = None
    replay: str | None = None
    record: str | None = None
    plugins: list[str] = Field(default_factory=list)  # --plugin modules or files


class Signature(BaseModel):
    """HMAC-SHA256 of the envelope's canonical JSON, and which key made it (`signing.py`)."""

    key_id: str
    hmac: str


class Envelope(BaseModel):
    """Everything needed to continue a run, as one JSON document."""

    model_config = ConfigDict(extra="forbid")

    format: Literal[2] = FORMAT
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
    frames: list[dict[str, Any]]  # root..innermost (mklang.engine.frame.Frame.to_json)
    budgets: Budgets = Field(default_factory=Budgets)
    usage: dict[str, Any] = Field(default_factory=dict)
    hitl: bool = False
    ask: str | None = None
    reply_to: str | None = None
    concurrency: int = 8
    host: HostSettings = Field(default_factory=HostSettings)
    result: Any = None
    generation: int = 0  # which journal generation continues this envelope
    # Paid answers of the step in flight not yet replayed (key -> {"kind", "v"}): kept
    # in the snapshot itself, so that no crash between snapshot and journal loses them,
    # and in a suspended envelope for the fan-out branches a ceiling stopped mid-way
    # (marked "consumed": true, the saved scripted position counts them already).
    answers: dict[str, dict[str, Any]] = Field(default_factory=dict)
    signature: Signature | None = None  # written by `dump`; checked by `load` into `seal`

    _seal: Seal = PrivateAttr(default="unsigned")

    @property
    def seal(self) -> Seal:
        """How the file this envelope was read from was signed (`load` sets it)."""
        return self._seal


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
    while version < FORMAT:
        if version not in MIGRATIONS:
            raise CheckpointError(f"checkpoint format {version} is too old to migrate")
        data = MIGRATIONS[version](data)
        version = data["format"]
    if version > FORMAT:
        raise CheckpointError(f"checkpoint format {version} is newer than this mklang understands ({FORMAT})")
    return data


def write_atomic(path: str | Path, payload: bytes, point: str = "envelope") -> None:
    """Replace `path` with `payload` so that a crash leaves the old or the new file.

    `point` names the crash points around the rename (mklang.faults)."""
    path = Path(path)
    try:
        _write_atomic(path, payload, point)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot write the checkpoint: {error.strerror}") from None


def _write_atomic(path: Path, payload: bytes, point: str) -> None:
    folder = path.parent  # Path("cp.json").parent is Path(".")
    descriptor, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        os.fchmod(descriptor, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        faults.reach(f"{point}.temp")
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    fsync_folder(folder)
    faults.reach(point)


def fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def dump_signed(envelope: Envelope) -> tuple[bytes, str]:
    """The file bytes of `envelope`, signed with the checkpoint key, and the signature's MAC."""
    document = envelope.model_dump(mode="json")
    document["signature"] = sign(document, checkpoint_key())
    payload = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return payload, document["signature"]["hmac"]


def dump(envelope: Envelope) -> bytes:
    return dump_signed(envelope)[0]


def save(path: str | Path, envelope: Envelope) -> None:
    write_atomic(path, dump(envelope))


def load(path: str | Path) -> Envelope:
    """Read a checkpoint; every way it can be unusable is one CheckpointError line."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint file") from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read the checkpoint: {error.strerror}") from None
    if not raw.strip():
        raise CheckpointError(f"{path}: the checkpoint is empty")
    try:
        data = load_json(raw, MAX_CHECKPOINT_DEPTH)
    except NestingError as error:
        raise CheckpointError(f"{path}: the checkpoint holds values {error}") from None
    except ValueError as error:
        from mklang.vocabulary import SUFFIXES

        if path.suffix.lower() in SUFFIXES:
            raise CheckpointError(
                f"{path} is a machine file, not a checkpoint: `mklang run {path} --checkpoint cp.json` writes one"
            ) from None
        raise CheckpointError(f"{path}: the checkpoint is not valid JSON (truncated or corrupted?): {error}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a mklang checkpoint (expected a JSON object)")
    seal = seal_of(data, checkpoint_key())
    try:
        envelope = Envelope.model_validate(migrate(data))
    except CheckpointError as error:
        raise CheckpointError(f"{path}: {error}") from None
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise CheckpointError(f"{path}: not a valid mklang checkpoint: {where}: {first['msg']}") from None
    envelope._seal = seal
    return envelope


def json_schema() -> dict[str, Any]:
    """The published JSON schema of the envelope (docs/checkpoint.schema.json)."""
    return Envelope.model_json_schema()
