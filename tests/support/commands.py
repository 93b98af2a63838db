"""The `mklang` CLI as tests run it: in a subprocess, or in this process through its entry function."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


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


def cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI run in this process through its entry function, as `mklang` runs it in a subprocess
    (same environment rules, same no-traceback check), without a new interpreter's start-up."""
    from typer.testing import CliRunner

    from mklang.cli import main

    wanted = env if env is not None else cli_env()
    changes: dict[str, str | None] = {key: None for key in os.environ if key not in wanted}
    changes.update(wanted)
    with CliRunner().isolation(env=changes) as (stdout, stderr, _), contextlib.chdir(cwd or os.getcwd()):
        try:
            main(list(args))
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        sys.stdout.flush()
        sys.stderr.flush()
        out, err = stdout.getvalue().decode(), stderr.getvalue().decode()
    assert "Traceback" not in err, err
    return subprocess.CompletedProcess(["mklang", *args], code, out, err)


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run the CLI in this process under pytest's capture: exit code, stdout, stderr; it never prints a traceback."""
    from mklang.cli import main

    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as stop:
        code = int(stop.code or 0)
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def error_of(done: subprocess.CompletedProcess[str]) -> str:
    """The one error a finished command printed, as its `mklang: error:` line (see `error_in`)."""
    return error_in(done.stdout, done.stderr, done.returncode)


def error_in(stdout: str, stderr: str, code: int | None = None) -> str:
    """The one error a command printed, as its `mklang: error:` line, read where it went: a command
    printing JSON puts the error document alone on stdout and no error on stderr; otherwise it is
    the one line on stderr."""
    from mklang.cli.app import error_line

    assert "Traceback" not in stderr, stderr[-2000:]
    if stdout.startswith("{"):
        document = json.loads(stdout)
        assert set(document) <= {"status", "error", "exit_code", "diagnostics"}, stdout[-2000:]
        assert document["status"] == "error" and code in (None, document["exit_code"]), (code, document)
        assert "mklang: error" not in stderr, stderr[-2000:]
        return error_line(document["error"])
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, (stdout[-500:], stderr[-2000:])
    return lines[0]


def refused(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The error a command refused with: exit 2 and one error, printed once, holding every needle."""
    assert done.returncode == 2, (done.returncode, done.stdout[-500:], done.stderr[-500:])
    line = error_of(done)
    for needle in needles:
        assert needle in line, line
    return line


def wait_for(condition: Callable[[], bool], process: subprocess.Popen[Any], what: str, timeout: float = 30) -> None:
    """Poll `condition` while `process` runs; fail if it ends or stalls first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"the run ended or stalled before {what}: {process.communicate()}")
        time.sleep(0.002)


def model_config(url: str, path: Path) -> Path:
    """A host config whose every tier is model `m` of the OpenAI-compatible server at `url` (its `/v1` base)."""
    path.write_text(
        '[tiers]\nfast = "local:m"\nbalanced = "local:m"\nreasoning = "local:m"\n\n'
        f'[providers.local]\nkind = "openai"\nbase_url = "{url}"\n',
        encoding="utf-8",
    )
    return path
