"""Runs for the web console's tests and bench: a store with a run parked on a question and a
finished run whose model output is a script; the system browser that photographs and tests its pages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from support.commands import cli
from support.examples import HITL

# The system's Chromium, as the browser tests and scripts/console_screenshots.py drive it
# (headless, and quiet: nothing it does reaches the network but the console under test).
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCRIPT_OUTPUT = "<script>alert('owned')</script>"
ECHO = """\
mklang 0.4
machine echo
entry say
budget 3
state say {
  structure "Any text."
  prompt "Say something."
  output said
  otherwise -> END
}
"""
# The reply must reach the model fenced as untrusted data: only a fenced prompt gets an answer.
FENCED_APPROVAL = {
    "scenarios": [
        {
            "name": "fenced",
            "llm": {"produce": {"Write a status-page": "Maintenance on Saturday", "<data-": "approve"}, "judge": [0]},
            "tools": {"publish": ["https://status.example.com/posts/118"]},
        }
    ]
}


def make_runs(tmp_path: Path) -> None:
    """`sqlite:///{tmp_path}/runs.db` with run `ask` parked on the approval question (its reply reaches
    the model only fenced) and run `echo` done, its output a script."""
    shutil.copytree(HITL / "approval", tmp_path / "approval")
    (tmp_path / "approval" / "fenced.yaml").write_text(json.dumps(FENCED_APPROVAL), encoding="utf-8")
    (tmp_path / "echo.mk").write_text(ECHO, encoding="utf-8")
    script = {"scenarios": [{"name": "s", "llm": {"produce": [SCRIPT_OUTPUT]}}]}
    (tmp_path / "echo.yaml").write_text(json.dumps(script), encoding="utf-8")
    uri = f"sqlite:///{tmp_path}/runs.db"
    asked = cli(
        "run", "approval/approval.mk", "--script", "approval/fenced.yaml", "--scenario", "fenced",
        "--hitl", "--checkpoint", f"{uri}#ask", "--format", "json", cwd=tmp_path,
    )  # fmt: skip
    assert asked.returncode == 3, asked.stderr
    echoed = cli("run", "echo.mk", "--script", "echo.yaml", "--checkpoint", f"{uri}#echo", cwd=tmp_path)
    assert echoed.returncode == 0, echoed.stderr
