"""A folder of session data built once for the whole test run, however many xdist workers share it."""

from __future__ import annotations

import fcntl
from collections.abc import Callable
from pathlib import Path

import pytest


def built_once(request: pytest.FixtureRequest, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name`, filled by `build` in the first worker that asks for it while the others
    wait on a lock: each worker's session fixtures would otherwise build the same data again.
    A build that fails or skips leaves the folder unbuilt, so the next worker tries for itself."""
    own = request.getfixturevalue("tmp_path_factory").getbasetemp()
    root = own.parent if hasattr(request.config, "workerinput") else own  # the workers' common folder
    folder, built = root / name, root / f"{name}.built"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not built.exists():
            folder.mkdir(exist_ok=True)
            build(folder)
            built.touch()
    return folder
