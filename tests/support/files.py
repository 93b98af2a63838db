"""What a run leaves on disk, and the fsyncs that make it durable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def journal_path(checkpoint: Path) -> Path:
    """The crash journal beside a checkpoint file."""
    return Path(f"{checkpoint}.journal")


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
