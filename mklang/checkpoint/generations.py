"""A run's generation only moves forward, so a restored older copy is refused (ADR 0022).

Every envelope carries the generation of the journal that continues it, and
each snapshot or finish writes the next one. A copy put back from a backup
(a file, a database) carries an older generation than the one last written,
and resuming it would repeat what came after it: paid calls, tool actions,
and a human approval read back from the first line of its journal. So the
highest generation reached is remembered per run id, where the run's store
can keep it (a `GenerationStore`: SQLite, PostgreSQL, which also refuse an
older envelope over a newer one in the run's row), else in the user's state
folder (`$XDG_STATE_HOME/mklang/generations/`, default
`~/.local/state/mklang/`) (ADR 0052). Kept in the store, the record holds
wherever the run is resumed from: another machine, user or CI job. A record
an earlier release left in the state folder still counts. `rollback` below
turns what they hold into the one-line refusal.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from mklang.errors import CheckpointError
from mklang.files import write_atomic
from mklang.stores import GenerationStore, RunStore

ALLOW_FLAG = "--allow-rollback"


def state_folder() -> Path:
    """The user's mklang state folder: $XDG_STATE_HOME/mklang, else ~/.local/state/mklang."""
    state_home = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state_home, "mklang")


def _record(run_id: str) -> str:
    # Run ids come from files: the record is named by their hash. A string: a run's finish names it twice.
    digest = hashlib.sha256(run_id.encode("utf-8")).hexdigest()[:32]
    return os.path.join(state_folder(), "generations", digest)


def written(store: RunStore, run: str) -> int:
    """The generation of the envelope last written at `run` of `store` (0: none, or a store that keeps none)."""
    return store.generation(run) if isinstance(store, GenerationStore) else 0


def newest(store: RunStore, run: str, run_id: str) -> int:
    """The highest generation of `run_id` written or resumed so far: by the run's row, the store's record
    of the run id, or this user's state folder."""
    kept = 0
    if isinstance(store, GenerationStore):
        kept = max(store.generation(run), store.generation_seen(run_id))
    return max(kept, _read(_record(run_id)))


def _read(record: str) -> int:
    try:
        with open(record, encoding="ascii") as file:
            return int(file.read())
    except (FileNotFoundError, ValueError):
        return 0
    except OSError as error:  # the state home is a file, or not the user's to read: no rollback check without it
        raise CheckpointError(f"{record}: cannot read the run's generation: {error.strerror}") from None


def remember(store: RunStore, run_id: str, generation: int) -> None:
    """Raise what is remembered of `run_id` to `generation` (never lowers it): in the store when it keeps
    generations, else in the user's state folder."""
    if isinstance(store, GenerationStore):
        store.record_generation(run_id, generation)
        return
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
