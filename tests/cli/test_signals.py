"""SIGINT, SIGTERM and SIGKILL sent to a real `mklang run` (SPEC section 7).

The run is the kill-9 example: a scripted model that takes 60 ms per call,
an outline, a fan-out of four drafts and an assembly. The first SIGINT or
SIGTERM suspends it at the next loop-top (exit 3 with a checkpoint, 130
without); a second one exits at once and leaves the last durable checkpoint;
SIGKILL leaves a `running` checkpoint that `mklang show` explains. Every
resumed run must equal the uninterrupted one. The runs that get signals are
real processes (forked: support/forks.py); the reference run, the resumes
and `show` go through the CLI's entry function, in this process.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import forks
from support.commands import cli, cli_env, wait_for
from support.examples import KILL_9

from mklang.checkpoint.envelope import load

RUN = [
    "run",
    str(KILL_9 / "report.mk"),
    "--script",
    str(KILL_9 / "scenarios.yaml"),
    "--scenario",
    "slow-model",
    "--format",
    "json",
    "--quiet",  # stderr holds only what the signals make the run say
]
COMPARED = ("status", "error", "at", "result", "context", "trace", "usage")
MODEL_CALLS = 8  # outline + its judge, four drafts, assembly + its judge

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")


def start(cwd: Path, *options: str) -> forks.Forked:
    return forks.start([*RUN, *options], cli_env(), cwd)


def journaled_calls(checkpoint: Path) -> int:
    """Completed model calls in the checkpoint's journal (the run is past them)."""
    try:
        raw = Path(f"{checkpoint}.journal").read_bytes()
    except FileNotFoundError:
        return 0
    return sum(json.loads(line).get("k") == "call" for line in raw.split(b"\n")[:-1])


def handlers_installed(pid: int) -> bool:
    """mklang catches SIGTERM only while a run is going (Python itself catches SIGINT from the start)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def finish(process: forks.Forked) -> tuple[int, dict | None, str]:
    stdout, stderr = process.communicate(timeout=60)
    assert "Traceback" not in stderr, stderr
    assert process.returncode is not None
    return process.returncode, (json.loads(stdout) if stdout.strip() else None), stderr


def comparable(data: dict) -> dict:
    return {key: data[key] for key in COMPARED}


def model_calls(data: dict) -> int:
    return data["calls"].get("produce", 0) + data["calls"].get("judge", 0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    done = cli(*RUN, cwd=tmp_path_factory.mktemp("reference"))
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert model_calls(data) == MODEL_CALLS
    return data


def interrupted_run(cwd: Path, checkpoint: Path, signum: int) -> forks.Forked:
    """A checkpointed run that got `signum` while the outline's judge was in flight."""
    process = start(cwd, "--checkpoint", str(checkpoint))
    wait_for(lambda: journaled_calls(checkpoint) >= 1, process, "the outline was written")
    process.send_signal(signum)
    return process


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_suspends_at_the_next_loop_top_and_resume_completes_the_run(signum, reference, tmp_path):
    checkpoint = tmp_path / "cp.json"
    code, data, stderr = finish(interrupted_run(tmp_path, checkpoint, signum))
    assert code == 3, stderr
    assert (data["status"], data["reason"], data["at"]) == ("suspended", "interrupted", "draft")
    assert [step["state"] for step in data["trace"]] == ["outline"]
    assert load(checkpoint).status == "suspended" and load(checkpoint).reason == "interrupted"
    resumed = cli("resume", str(checkpoint), "--format", "json", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    resumed_data = json.loads(resumed.stdout)
    assert comparable(resumed_data) == comparable(reference)
    # Suspended at a loop-top: no call is paid twice.
    assert model_calls(data) + model_calls(resumed_data) == MODEL_CALLS


def test_without_a_checkpoint_a_signal_stops_the_run_with_exit_130(tmp_path):
    process = start(tmp_path)
    wait_for(lambda: handlers_installed(process.pid), process, "the run started")
    time.sleep(0.03)
    process.send_signal(signal.SIGINT)
    code, data, stderr = finish(process)
    assert code == 130, stderr
    assert (data["status"], data["error"]) == ("halted", "interrupted")
    assert len(data["trace"]) < 3  # it stopped before the end
    assert list(tmp_path.iterdir()) == []  # and wrote no checkpoint


def test_a_second_signal_exits_at_once_and_the_checkpoint_resumes(reference, tmp_path):
    checkpoint = tmp_path / "cp.json"
    process = interrupted_run(tmp_path, checkpoint, signal.SIGINT)
    assert "interrupt received" in process.stderr_line("interrupt received")  # the first one was handled
    process.send_signal(signal.SIGINT)
    code, data, stderr = finish(process)
    assert (code, data) == (130, None), stderr
    assert "exiting now" in stderr
    assert load(checkpoint).status == "running"  # the last durable state of a run that did not finish
    resumed = cli("resume", str(checkpoint), "--format", "json", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert comparable(json.loads(resumed.stdout)) == comparable(reference)


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """The checkpoint of a run killed with SIGKILL after the outline step and two drafts."""
    folder = tmp_path_factory.mktemp("killed")
    checkpoint = folder / "cp.json"
    process = start(folder, "--checkpoint", str(checkpoint))
    wait_for(lambda: journaled_calls(checkpoint) >= 4, process, "two drafts were written")
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    return checkpoint


def test_show_says_a_killed_run_was_interrupted_and_where(killed):
    shown = cli("show", str(killed), "--summary", "--format", "json", cwd=killed.parent)
    assert shown.returncode == 0
    summary = json.loads(shown.stdout)
    assert (summary["status"], summary["resumable"]) == ("running", True)
    assert "interrupted" in summary["interrupted"]
    # The outline step is durable (journaled); the run was drafting when it was killed.
    assert [(f["machine"], f["state"], f["steps"]) for f in summary["frames"]] == [("report", "draft", 1)]
    assert summary["tokens"]["spent"] == 180
    assert [step["state"] for step in summary["last_steps"]] == ["outline"]
    text = cli("show", str(killed), "--summary", "--format", "text", cwd=killed.parent)
    assert "interrupted" in text.stdout and "report at draft" in text.stdout


def test_a_killed_run_resumes_to_the_uninterrupted_result_paying_only_what_was_left(killed, reference, tmp_path):
    checkpoint = tmp_path / "cp.json"  # a copy: the other tests read the killed checkpoint as it was
    for suffix in ("", ".journal"):
        shutil.copy(f"{killed}{suffix}", f"{checkpoint}{suffix}")
    resumed = cli("resume", str(checkpoint), "--format", "json", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    data = json.loads(resumed.stdout)
    assert comparable(data) == comparable(reference)
    # Four calls were journaled; the two drafts in flight at the kill are made again.
    assert model_calls(data) == MODEL_CALLS - 4
    assert load(checkpoint).status == "done"


def test_the_kill_9_demo_shows_equal_results(tmp_path):
    done = subprocess.run(
        [sys.executable, str(KILL_9 / "demo.py")],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "equals the uninterrupted run's (status, result, context, trace, usage): yes" in done.stdout
    assert f"uninterrupted run {MODEL_CALLS};" in done.stdout
    assert "killed + resumed = 8" in done.stdout
    assert "running" in done.stdout  # what show said about the killed checkpoint
