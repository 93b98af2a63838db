"""One process per checkpoint: a run that is still going cannot be resumed twice.

Two resumes of one checkpoint would pay for the same model calls. The run
holds `<checkpoint>.lock` (flock) while it goes; the kernel drops it when
the process dies, even by SIGKILL, so a crashed run is resumable at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import yaml
from support import ROOT
from support.commands import cli, cli_env, refused, wait_for
from support.examples import KILL_9
from support.forks import Forked, start

from mklang.stores import locate

RUN_KILL_9 = ["run", str(KILL_9 / "report.mk"), "--script", str(KILL_9 / "scenarios.yaml"), "--scenario", "slow-model"]


def holder(checkpoint) -> int | None:
    held_by = locate(checkpoint).store.holder(locate(checkpoint).run)
    return None if held_by is None else int(held_by)


def _write_script(folder, delay_ms: int) -> None:
    script = yaml.safe_load((KILL_9 / "scenarios.yaml").read_text())
    scenario = next(s for s in script["scenarios"] if s["name"] == "slow-model")
    scenario["llm"]["delay_ms"] = delay_ms
    (folder / "slow.yaml").write_text(yaml.safe_dump({"scenarios": [scenario]}))


def _slow_run(folder, checkpoint) -> Forked:
    """The kill-9 example with a model that answers after a minute, in a real (forked) process:
    the run is surely still going while the test acts, however loaded the machine is."""
    _write_script(folder, 60_000)
    args = ["run", str(KILL_9 / "report.mk"), "--script", str(folder / "slow.yaml")]
    return start([*args, "--checkpoint", str(checkpoint), "--format", "json"], cli_env(), folder)


def test_a_running_checkpoint_refuses_a_second_resume_until_its_process_dies(tmp_path):
    checkpoint = tmp_path / "cp.json"
    process = _slow_run(tmp_path, checkpoint)
    wait_for(  # the lock is taken before the first checkpoint is written, which `show` reads
        lambda: holder(checkpoint) == process.pid and checkpoint.exists(),
        process,
        "the run took its lock, named itself and wrote its checkpoint",
    )

    # this process, not the one holding the lock
    refused(cli("resume", str(checkpoint), cwd=tmp_path), f"still going in process {process.pid}")
    shown = json.loads(cli("show", str(checkpoint), "--summary", "--format", "json", cwd=tmp_path).stdout)
    assert (shown["status"], shown.get("running_pid"), shown["resumable"]) == ("running", process.pid, False), shown

    process.send_signal(signal.SIGKILL)
    process.communicate()
    deadline = time.monotonic() + 5
    while holder(checkpoint) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert holder(checkpoint) is None  # the kernel released the lock with the process
    shown = json.loads(cli("show", str(checkpoint), "--summary", "--format", "json", cwd=tmp_path).stdout)
    assert shown["resumable"] and "interrupted" in shown["interrupted"]
    _write_script(tmp_path, 0)  # the resumed run need not wait
    resumed = cli("resume", str(checkpoint), "--format", "json", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert holder(checkpoint) is None  # a finished run holds no lock
    assert not (tmp_path / "cp.json.lock").exists()  # and leaves no lock file; the killed run's was taken over


def test_the_lock_file_is_owner_only_and_names_the_process(tmp_path):
    location = locate(tmp_path / "cp.json")
    lock = location.store.lock(location.run)
    try:
        assert ((tmp_path / "cp.json.lock").stat().st_mode & 0o777) == 0o600
        assert holder(tmp_path / "cp.json") == os.getpid()  # held, and it names its process
    finally:
        lock.release()
    assert holder(tmp_path / "cp.json") is None
    assert not (tmp_path / "cp.json.lock").exists()


def test_a_run_that_ends_or_suspends_leaves_no_lock_file(tmp_path):
    """A checkpointed run removes its lock file when it ends, however it ends."""
    suspended = cli(*RUN_KILL_9, "--checkpoint", "cp.json", "--max-tokens", "1", cwd=tmp_path)
    assert suspended.returncode == 3, suspended.stderr
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith("cp.json")) == ["cp.json"]
    resumed = cli("resume", "cp.json", "--max-tokens", "100000", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith("cp.json")) == ["cp.json"]


# Takes and lets go of one lock again and again; while it holds the lock, it alone may have made
# `inside` (O_EXCL), so a second holder at the same time fails to make it and says so.
LOCKER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from mklang.errors import RunBusy
    from mklang.stores.file import FileLock
    lock_path, inside, rounds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    taken = 0
    while taken < rounds:
        try:
            lock = FileLock(lock_path, "cp.json")
        except RunBusy:
            continue
        try:
            os.close(os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            sys.exit("two holders at once")
        inside.unlink()
        lock.release()
        taken += 1
""")


def test_two_processes_that_take_and_remove_one_lock_file_never_hold_it_together(tmp_path):
    """Removing a lock file races with a second locker that opened it just before (mklang.stores.file)."""
    args = [str(tmp_path / "cp.json.lock"), str(tmp_path / "inside"), "1000"]
    lockers = [
        subprocess.Popen([sys.executable, "-c", LOCKER, *args], cwd=ROOT, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outcomes = [(locker.wait(timeout=120), locker.stderr.read()) for locker in lockers]
    assert outcomes == [(0, ""), (0, "")]
    assert not (tmp_path / "cp.json.lock").exists()
