"""Durable, owner-only file writes shared by checkpoints, journals and cassettes.

A file is replaced atomically (temp file in the same folder, fsync, rename,
fsync of the folder), so a reader or a crash sees the previous or the new
version, never a torn one. Errors are `OSError`; each caller words them for
its own file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from mklang import faults


def write_atomic(path: str | os.PathLike[str], payload: bytes, point: str | None = None) -> None:
    """Replace `path` with `payload` (mode 0600) so that a crash leaves the old or the new file.

    `point` names the crash points around the rename (`mklang.faults`):
    `POINT.temp` before it, `POINT` once the file is in place.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    descriptor, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        os.fchmod(descriptor, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        if point is not None:
            faults.reach(f"{point}.temp")
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    fsync_folder(folder)
    if point is not None:
        faults.reach(point)


def fsync_folder(folder: str | os.PathLike[str]) -> None:
    """Make a rename in `folder` durable."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
