"""Helpers shared by the test modules (import them with `from conftest import ...`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment without mklang settings or provider keys, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MKLANG_", "OPENAI_", "ANTHROPIC_"))}
    env.update(extra)
    return env


def mklang(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run the CLI of this tree in a subprocess; no run of it may print a Python traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "mklang", *args],
        cwd=cwd,
        env=env if env is not None else cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done


def wait_for(condition: Callable[[], bool], process: subprocess.Popen[Any], what: str, timeout: float = 30) -> None:
    """Poll `condition` while `process` runs; fail if it ends or stalls first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"the run ended or stalled before {what}: {process.communicate()}")
        time.sleep(0.002)


def outcome(result: Any, fields: tuple[str, ...] = ("status", "result", "context", "trace", "usage")) -> dict[str, Any]:
    """The comparable, JSON-shaped part of a `RunResult`."""
    data = result.to_json()
    return json.loads(json.dumps({key: data[key] for key in fields}))
