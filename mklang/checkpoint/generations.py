"""A run's generation only moves forward, so a restored older copy is refused (ADR 0022).

Every envelope carries the generation of the journal that continues it, and
each snapshot or finish writes the next one. A copy put back from a backup
(a file, a database) carries an older generation than the one last written,
and resuming it would repeat what came after it: paid calls, tool actions,
and a human approval read back from the first line of its journal. So the
highest generation seen is remembered per run id in the user's state folder
(`$XDG_STATE_HOME/mklang/generations/`, default `~/.local/state/mklang/`),
and a store with rows (SQLite, PostgreSQL) also keeps it in the run's row,
which refuses an older one; `rollback` below turns what they hold into the
one-line refusal.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from mklang.errors import CheckpointError
from mklang.files import write_atomic

ALLOW_FLAG = "--allow-rollback"


def state_folder() -> Path:
    """The user's mklang state folder: $XDG_STATE_HOME/mklang, else ~/.local/state/mklang."""
    state_home = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state_home, "mklang")


def _record(run_id: str) -> str:
    # Run ids come from files: the record is named by their hash. A string: a run's finish names it twice.
    digest = hashlib.sha256(run_id.encode("utf-8")).hexdigest()[:32]
    return os.path.join(state_folder(), "generations", digest)


def seen(run_id: str) -> int:
    """The highest generation of `run_id` this user has written or resumed (0: none)."""
    return _read(_record(run_id))


def _read(record: str) -> int:
    try:
        with open(record, encoding="ascii") as file:
            return int(file.read())
    except (FileNotFoundError, ValueError):
        return 0
    except OSError as error:  # the state home is a file, or not the user's to read: no rollback check without it
        raise CheckpointError(f"{record}: cannot read the run's generation: {error.strerror}") from None


def remember(run_id: str, generation: int) -> None:
    """Raise what is remembered of `run_id` to `generation` (never lowers it)."""
    record = _record(run_id)
    if generation <= _read(record):
        return
    payload = str(generation).encode("ascii")
    try:
        try:
            write_atomic(record, payload)
        except FileNotFoundError:  # the folder is made by the first record (a run writes one or two)
            os.makedirs(os.path.dirname(record), mode=0o700, exist_ok=True)
            write_atomic(record, payload)
    except OSError as error:
        raise CheckpointError(f"{record}: cannot record the run's generation: {error.strerror}") from None


def rollback(where: str, run_id: str, generation: int, newest: int, allow: bool) -> str | None:
    """Refuse generation `generation` of a run when `newest` was seen; with `allow`, the note to print."""
    if generation >= newest:
        return None
    what = (
        f"{where}: generation {generation} of run {run_id} is older than generation {newest} already written: "
        "a restored copy would repeat what ran after it (paid calls, tool actions, human approvals)"
    )
    if not allow:
        raise CheckpointError(f"{what}; resume with {ALLOW_FLAG} to run it anyway")
    return f"{what}; resuming it anyway ({ALLOW_FLAG})"
