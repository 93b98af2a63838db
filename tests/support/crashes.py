"""Runs crashed in process (mklang.verification crashes every golden scenario at every point; these
helpers serve the tests that crash one run at one moment)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mklang.checkpoint.segments import recorded_trace
from mklang.runs import start
from mklang.scenarios import load_script
from mklang.session import Host
from mklang.stores import locate
from mklang.syntax import load_file
from support import ROOT
from support.runs import LoopTops


class Crash(BaseException):
    """Not an Exception: nothing in the engine may catch it, as nothing catches SIGKILL."""


def crash() -> None:
    raise Crash


def finished_outcome(checkpoint: Path) -> dict[str, Any] | None:
    """The outcome a checkpoint file holds once its run is done or halted (JSON as written), else None."""
    envelope = json.loads(checkpoint.read_text())
    if envelope["status"] not in ("done", "halted"):
        return None
    root = envelope["frames"][0]
    trace = recorded_trace(locate(checkpoint), root, trusted=True)
    return {
        "status": envelope["status"],
        "error": envelope["error"],
        "at": envelope["at"],
        "result": envelope["result"],
        "context": root["context"],
        "trace": list(trace),
        "usage": envelope["usage"],
    }


def dead_run(folder: Path, example: str, main: str, crash_at: int) -> Path:
    """A copy of an example whose checkpointed run died at its `crash_at`-th loop-top."""
    shutil.copytree(ROOT / "examples" / example, folder / example)
    machine = load_file(folder / example / main)
    scenario = load_script(folder / example / "scenarios.yaml")[0]
    tops = iter(range(crash_at - 1))

    def die_at_loop_top(event: Any) -> None:
        if next(tops, None) is None:
            raise Crash

    path = folder / "cp.json"
    try:
        start(machine, None, Host.for_scenario(scenario), checkpoint=path, observer=LoopTops(die_at_loop_top))
    except Crash:
        return path
    raise AssertionError(f"the run of {example} ended before loop-top {crash_at}")
