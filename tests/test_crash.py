"""kill -9 at random moments, resume, and get the uninterrupted run (SPEC section 7).

A real `mklang run --checkpoint` subprocess talks to a real HTTP model
server on 127.0.0.1 (OpenAI wire format, some latency per request) and to a
host tool with a side effect (a ledger file). It is killed with SIGKILL at
seeded random moments and resumed with `mklang resume`. The resumed result
must equal the uninterrupted run's (trace, context, result, usage), and the
provider and tool calls executed across crash and resume must equal the
uninterrupted count, except calls in flight at the kill, which are
re-executed (tools with the same idempotency key).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from fakeserver import FakeServer, Request, answer

HERE = Path(__file__).parent / "crash"
MACHINE = HERE / "crash.mk"
PLUGIN = HERE / "ledger.py"
DELAY = 0.04  # seconds per model request
CONCURRENCY = 4  # the fan-out's branches in flight at once
KILLS = 24  # at least 20 land inside the run; a run that ends first is skipped, not counted
LANDED: list[float] = []  # kill moments that landed inside a run


def reply(request: Request) -> object:
    """Deterministic answers: the judge always picks condition 1; produce echoes a digest."""
    text = request.system + "\n" + request.user
    if '"choice"' in text:
        return answer('{"choice": 1}', input_tokens=30, output_tokens=4, delay=DELAY)
    # The data-fence nonce is fresh per call; a real model's answer does not depend on it.
    prompt = re.sub(r"</?data-[0-9a-f]+>", "<data>", request.user)
    digest = hashlib.sha256(prompt.encode()).hexdigest()[:10]
    return answer(f"answer-{digest}", input_tokens=20, output_tokens=7, delay=DELAY)


@pytest.fixture(scope="module")
def server():
    with FakeServer() as fake:
        fake.handler = reply
        yield fake


@pytest.fixture(scope="module")
def config(server, tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "mklang.toml"
    path.write_text(
        '[tiers]\nfast = "local:m"\nbalanced = "local:m"\nreasoning = "local:m"\n\n'
        f'[providers.local]\nkind = "openai"\nbase_url = "{server.openai_url}"\n'
    )
    return path


def _env(ledger: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "MKLANG_"))}
    env["CRASH_LEDGER"] = str(ledger)
    return env


def _run(args: list[str], ledger: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mklang", *args], capture_output=True, text=True, env=_env(ledger), timeout=120
    )


def _comparable(result: dict) -> dict:
    return {key: result[key] for key in ("status", "error", "result", "context", "trace", "usage")}


def _keys(ledger: Path) -> list[str]:
    """Ledger idempotency keys without the run id (which differs between runs)."""
    if not ledger.exists():
        return []
    return [line.split("/", 1)[1] for line in ledger.read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(server, config, tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    ledger = folder / "ledger"
    before = server.count
    process, started = _start_run(folder / "cp.json", ledger, config)
    stdout, stderr = process.communicate(timeout=120)
    elapsed = time.monotonic() - started
    assert process.returncode == 0, stderr
    return {
        "result": _comparable(json.loads(stdout)),
        "requests": server.count - before,
        "tools": _keys(ledger),
        "elapsed": elapsed,
    }


def _start_run(checkpoint: Path, ledger: Path, config: Path) -> tuple[subprocess.Popen, float]:
    """Start `mklang run --checkpoint`; return it once its first checkpoint exists, and when that was."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mklang",
            "run",
            str(MACHINE),
            "--config",
            str(config),
            "--plugin",
            str(PLUGIN),
            "--checkpoint",
            str(checkpoint),
            "--concurrency",
            str(CONCURRENCY),
            "--format",
            "json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(ledger),
    )
    deadline = time.monotonic() + 30
    while not checkpoint.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    return process, time.monotonic()


def test_the_reference_run_exercises_every_kind_of_call(reference):
    states = [step["state"] for step in reference["result"]["trace"]]
    assert states == ["plan", "work", "check", "note", "wrap"]
    assert reference["requests"] == 10  # plan+judge, 4 branches, review+judge, wrap+judge
    assert sorted(Counter(reference["tools"]).values()) == [1, 1]


@pytest.mark.parametrize("seed", range(KILLS))
def test_kill_9_then_resume_gives_the_uninterrupted_run(seed, reference, server, config, tmp_path):
    rng = random.Random(seed)
    ledger = tmp_path / "ledger"
    checkpoint = tmp_path / "cp.json"
    # Kill at a random moment of the run proper: from its first durable loop-top to its end.
    moment = rng.uniform(0.0, 0.9) * reference["elapsed"]
    before = server.count
    process, _ = _start_run(checkpoint, ledger, config)
    time.sleep(moment)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    if process.returncode != -signal.SIGKILL:
        pytest.skip(f"the run finished before the kill at {moment:.2f}s")
    LANDED.append(moment)
    assert checkpoint.exists(), "a durable checkpoint exists from the first loop-top"
    envelope = json.loads(checkpoint.read_text())  # never torn: it always parses
    if envelope["status"] == "done":
        # Killed after the run ended, while printing: the checkpoint holds the whole run.
        assert envelope["frames"][0]["trace"] == reference["result"]["trace"]
        assert envelope["result"] == reference["result"]["result"]
    else:
        assert envelope["status"] == "running"
        resumed = _run(["resume", str(checkpoint), "--format", "json"], ledger)
        assert resumed.returncode == 0, resumed.stderr
        assert _comparable(json.loads(resumed.stdout)) == reference["result"]

    extra_requests = (server.count - before) - reference["requests"]
    assert 0 <= extra_requests <= CONCURRENCY, "only calls in flight at the kill may be paid twice"
    keys = _keys(ledger)
    assert set(keys) == set(reference["tools"])
    repeats = [key for key, count in Counter(keys).items() if count > 1]
    assert len(repeats) <= 1 and all(Counter(keys)[key] == 2 for key in repeats), (
        "a tool runs again only when it was in flight, with the same idempotency key"
    )


def test_at_least_20_kills_landed_at_different_moments():
    assert len(set(LANDED)) >= 20, LANDED


def test_a_finished_run_refuses_to_resume(reference, config, tmp_path):
    ledger = tmp_path / "ledger"
    checkpoint = tmp_path / "cp.json"
    done = _run(
        [
            "run",
            str(MACHINE),
            "--config",
            str(config),
            "--plugin",
            str(PLUGIN),
            "--checkpoint",
            str(checkpoint),
            "--format",
            "json",
        ],
        ledger,
    )
    assert done.returncode == 0, done.stderr
    again = _run(["resume", str(checkpoint)], ledger)
    assert again.returncode == 2
    assert "cannot be resumed" in again.stderr and "Traceback" not in again.stderr
