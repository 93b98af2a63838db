"""Runs for the web console's tests and bench: a store with a run parked on a question and a
finished run whose model output is a script; the system browser that photographs and tests its pages."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from support.commands import cli, cli_env
from support.examples import EXAMPLES, HITL

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


def park_many(folder: Path, count: int, machines: int = 2) -> str:
    """`sqlite:///{folder}/parked.db` with `count` runs parked on the approval example's decision
    (`parked-0000`, ...): one real run parked, then copies of it, each its own run (a new run id
    and question id, its own announcement and the digest of it), signed with this user's key and
    summarized as the checkpoint layer does; every `machines`-th run's summary names another
    machine, so the inbox has groups. Returns the store's URI."""
    import secrets

    from mklang.checkpoint.envelope import parse, save
    from mklang.engine.decisions import digest
    from mklang.stores import locate

    shutil.copytree(EXAMPLES / "approval", folder / "approval", dirs_exist_ok=True)
    uri = f"sqlite:///{folder}/parked.db"
    parked = cli(
        "run", "approval/approval.mk", "--script", "approval/scenarios.yaml", "--scenario", "ask-then-publish",
        "--checkpoint", f"{uri}#parked-0000", cwd=folder,
    )  # fmt: skip
    assert parked.returncode == 3, parked.stderr
    first = locate(f"{uri}#parked-0000")
    raw = first.store.read(first.run) or b""
    for number in range(1, count):
        envelope = parse(raw, first.run)
        envelope.run_id = secrets.token_hex(16)
        frame = envelope.frames[-1]
        text = f"{frame['context']['announcement']} (notice {number})"
        frame["context"]["announcement"] = text
        frame["ask"] = {**frame["ask"], "question": secrets.token_hex(8), "digest": digest(text)}
        if number % machines:
            envelope.machine = envelope.machine.model_copy(update={"name": f"approval-{number % machines}"})
        save(f"{uri}#parked-{number:04d}", envelope)
    first.store.close()
    return uri


def park_soon(folder: Path, target: str, within: str = "2s", env: dict[str, str] | None = None) -> None:
    """A run of the approval example whose decision times out `within` (it drops the announcement),
    parked at `target` (`STORE#RUN`): the example copied into `folder/soon-WITHIN` with that deadline."""
    soon = folder / f"soon-{within}"
    if not soon.exists():
        shutil.copytree(EXAMPLES / "approval", soon)
        machine = soon / "approval.mk"
        machine.write_text(machine.read_text().replace("within 48h fail", f"within {within} fail"))
    parked = cli(
        "run", f"{soon.name}/approval.mk", "--script", f"{soon.name}/scenarios.yaml", "--scenario", "ask-then-publish",
        "--checkpoint", target, cwd=folder, env=env,
    )  # fmt: skip
    assert parked.returncode == 3, parked.stderr


@contextmanager
def serving(folder: Path, store: str, *options: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """`mklang serve --store STORE` on a free port of 127.0.0.1, run in `folder` as a process: the
    URL it prints, with its token. Stopped at the end, which must leave no traceback."""
    server = subprocess.Popen(
        [sys.executable, "-m", "mklang", "serve", "--store", store, "--port", "0", *options],
        cwd=folder, env=env or cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        first = server.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:\d+/\?token=\S+", first)
        assert found, (first, server.stderr.read() if server.poll() is not None else "")
        yield found.group(0)
    finally:
        server.terminate()
        _, errors = server.communicate(timeout=30)
        assert "Traceback" not in errors, errors
