"""What a run leaves on disk, and the fsyncs that make it durable."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from mklang.stores import locate
from mklang.stores.file import MARKS_FOLDER, FileLock, hashed_name, lock_holder


def journal_path(checkpoint: Path) -> Path:
    """The crash journal beside a checkpoint file."""
    return Path(f"{checkpoint}.journal")


def mark_path(checkpoint: Path) -> Path:
    """Where the file store counts the committed bytes of a checkpoint file's journal."""
    return checkpoint.parent / MARKS_FOLDER / hashed_name(checkpoint.name)


def uncommitted(checkpoint: Path) -> None:
    """Forget how much of a checkpoint file's journal was committed, as if none of its lines had been
    synced: cutting it then tears a tail a crash could tear, rather than cutting it short."""
    mark_path(checkpoint).unlink()


def journal_lines(checkpoint: Path) -> list[dict[str, Any]]:
    """Every line of the crash journal beside a checkpoint file, decoded."""
    return [json.loads(line) for line in journal_path(checkpoint).read_bytes().splitlines()]


def write_journal(checkpoint: Path, lines: list[dict[str, Any]]) -> None:
    """Replace the crash journal beside a checkpoint file with `lines` (unsigned: as a hand edit leaves it)."""
    journal_path(checkpoint).write_text("".join(json.dumps(line) + "\n" for line in lines))


class FsyncSpy:
    """Wraps `os.fsync`; for each call records the path behind the descriptor, its bytes then,
    and the bytes of `watched` then."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, watched: Path | None = None):
        self.synced: list[tuple[str, bytes | None]] = []
        self.watched_then: list[bytes] = []
        self._watched = watched
        self._fsync = os.fsync
        monkeypatch.setattr(os, "fsync", self)

    def __call__(self, descriptor: int) -> None:
        path = os.readlink(f"/proc/self/fd/{descriptor}")
        self.synced.append((path, Path(path).read_bytes() if os.path.isfile(path) else None))
        if self._watched is not None:
            self.watched_then.append(self._watched.read_bytes())
        self._fsync(descriptor)


def write_atomic(path: Path, payload: bytes) -> None:
    """Write a checkpoint file through the file store (its errors are one CheckpointError line)."""
    location = locate(path)
    location.store.write(location.run, payload, generation=1)


def lock_path(checkpoint: Path) -> Path:
    """The lock file beside a checkpoint file."""
    return Path(f"{checkpoint}.lock")


def holder(checkpoint: Path) -> int | None:
    """The pid a held lock names (-1 when it names none), or None when the lock is free."""
    named = lock_holder(lock_path(checkpoint))
    return None if named is None else int(named) if named.isdigit() else -1


def refuse_if_running(checkpoint: Path) -> None:
    """Take and release the checkpoint's lock: it raises when a live process holds it."""
    FileLock(lock_path(checkpoint), str(checkpoint)).release()
