"""One process at a time per checkpoint: an advisory lock held while a run goes on.

Two processes resuming the same checkpoint would both pay for the same model
calls. The lock (`<checkpoint>.lock`, `flock`) is held from the first
snapshot to the last write; the kernel releases it when the process dies,
even by SIGKILL, so a crashed run is resumable at once, while a run that is
still going is refused (and `mklang show` can tell the two apart).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from mklang.errors import CheckpointError


def lock_path(checkpoint: str | Path) -> Path:
    return Path(f"{checkpoint}.lock")


class RunLock:
    def __init__(self, checkpoint: str | Path):
        self.checkpoint = checkpoint
        self.path = lock_path(checkpoint)
        self._descriptor: int | None = None

    def acquire(self) -> RunLock:
        try:
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            raise CheckpointError(f"{self.checkpoint}: cannot lock the checkpoint: {error.strerror}") from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(descriptor, 32).decode(errors="replace").strip() or "?"
            os.close(descriptor)
            raise still_running(self.checkpoint, pid) from None
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"{os.getpid()}\n".encode())
        self._descriptor = descriptor
        return self

    def release(self) -> None:
        if self._descriptor is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._descriptor)  # closing drops the lock
        self._descriptor = None


def holder(checkpoint: str | Path) -> int | None:
    """The pid of the process running this checkpoint, or None when no process holds it."""
    try:
        descriptor = os.open(lock_path(checkpoint), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.read(descriptor, 32).decode(errors="replace").strip()
        return int(text) if text.isdigit() else -1
    finally:
        os.close(descriptor)
    return None


def still_running(checkpoint: str | Path, pid: object) -> CheckpointError:
    return CheckpointError(
        f"{checkpoint}: the run is still going in process {pid}; "
        f"wait for it, or stop it (Ctrl-C suspends it) before resuming"
    )


def refuse_if_running(checkpoint: str | Path) -> None:
    """Fail early, before any provider is set up, when another process runs this checkpoint."""
    pid = holder(checkpoint)
    if pid is not None:
        raise still_running(checkpoint, pid)
