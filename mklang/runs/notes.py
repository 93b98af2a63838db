"""Signed notes a fleet exchanges through a store: run records and worker reports (ADR 0024)."""

from __future__ import annotations

import hashlib
import hmac
from typing import TYPE_CHECKING, Any

from mklang.checkpoint.signing import SEAL_TEXT, checkpoint_key, seal_of, sign
from mklang.errors import CheckpointError
from mklang.limits import load_json
from mklang.stores import NoteStore

if TYPE_CHECKING:
    pass


def report_key(run: str) -> str:
    """The note under which a worker reports what became of a run."""
    return f"run:{run}"


def record_key(run: str) -> str:
    """The note of a batch run's record: its machine, context and budgets, for a worker."""
    return f"record:{run}"


def write_signed(store: NoteStore, key: str, document: dict[str, Any]) -> None:
    """Replace the note under `key` with `document` signed with the checkpoint key (the fleet's)."""
    store.write_note(key, sign(document, checkpoint_key())[0])


def read_signed(store: NoteStore, key: str, what: str) -> dict[str, Any] | None:
    """The document of a signed note (None when there is none); CheckpointError unless the fleet key signed it."""
    raw = store.read_note(key)
    return None if raw is None else verified(raw, what)


def verified(raw: bytes, what: str) -> dict[str, Any]:
    """The document a signed note's bytes hold; CheckpointError unless the fleet key signed it."""
    try:
        document = load_json(raw)
    except ValueError:
        document = None
    if not isinstance(document, dict):
        raise CheckpointError(f"{what} is not a JSON object")
    seal = seal_of(document, checkpoint_key(), raw)
    if seal != "signed":
        raise CheckpointError(f"{what} is {SEAL_TEXT[seal].replace('your', 'the fleet')}")
    return document


def fleet_mac(message: str) -> str:
    """The MAC of `message` with the checkpoint key: who holds the fleet's key sent it."""
    return hmac.new(checkpoint_key(), message.encode(), hashlib.sha256).hexdigest()
