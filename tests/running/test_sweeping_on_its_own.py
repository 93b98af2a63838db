"""`mklang serve --sweep` and `mklang worker --sweep`: deadlines are taken without cron. A run parked
on a decision that times out in two seconds is taken along its timeout by the process sweeping the
store, exactly once, while a run not due is left waiting."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.commands import cli_env
from support.console import park_soon
from support.fleet import FLEET_KEY
from support.services import require_server

from mklang.checkpoint.envelope import load
from mklang.stores import locate

pytestmark = pytest.mark.slow


def timed_out(store: str, run: str, within: float = 30) -> bool:
    """Whether the run was taken along its timeout within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        envelope = load(locate(f"{store}#{run}"))
        if envelope.status != "suspended":
            decided = envelope.frames[0]["trace"][-1].get("decision") or {}
            return envelope.status == "halted" and decided.get("by") == "deadline"
        time.sleep(0.2)
    return False


def sweeping(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "mklang", *command], cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def ended(process: subprocess.Popen[str]) -> str:
    """Stop a sweeping process; what it said on stderr (no traceback)."""
    process.terminate()
    _, errors = process.communicate(timeout=30)
    assert "Traceback" not in errors, errors
    return errors


def test_serve_sweeps_the_store_it_serves(tmp_path):
    pytest.importorskip("starlette", reason="the console extra is not installed")
    store = f"sqlite:///{tmp_path}/runs.db"
    env = cli_env(MKLANG_CHECKPOINT_KEY=FLEET_KEY)
    park_soon(tmp_path, f"{store}#soon", env=env)
    park_soon(tmp_path, f"{store}#later", within="1h", env=env)
    server = sweeping(["serve", "--store", store, "--port", "0", "--sweep", "0.5"], tmp_path, env)
    try:
        assert server.stdout is not None and "mklang console of" in server.stdout.readline()
        assert timed_out(store, "soon")
        assert load(locate(f"{store}#later")).status == "suspended"
    finally:
        errors = ended(server)
    assert f"mklang: sweep: {store}#soon: continued question " in errors and "-> halted" in errors
    assert errors.count(": continued question") == 1 and "#later" not in errors


def test_a_worker_sweeps_its_store_beside_the_runs_it_takes(tmp_path):
    require_server("RabbitMQ")
    pytest.importorskip("celery", reason="the distributed extra is not installed")
    store = f"sqlite:///{tmp_path}/runs.db"
    env = cli_env(MKLANG_CHECKPOINT_KEY=FLEET_KEY, XDG_CONFIG_HOME=str(tmp_path / "home"))
    park_soon(tmp_path, f"{store}#soon", env=env)
    broker = "amqp://guest:guest@127.0.0.1:5672//"
    worker = sweeping(["worker", "--store", store, "--broker", broker, "--sweep", "0.5"], tmp_path, env)
    try:
        assert timed_out(store, "soon", within=60)
    finally:
        errors = ended(worker)
    assert f"mklang: sweep: {store}#soon: continued question " in errors


def test_a_sweep_interval_is_a_positive_number_of_seconds(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mklang", "serve", "--store", str(tmp_path), "--sweep", "0"],
        capture_output=True, text=True, env=cli_env(), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2 and "--sweep" in done.stderr and "Traceback" not in done.stderr
